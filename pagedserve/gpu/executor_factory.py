"""Build the executor ``ParallelConfig.executor`` names (gpu/executor.py is the interface).

The concrete executors import only the interface; this module is the one place that knows them
all. mp and Ray are imported when asked for (Ray is an optional extra).
"""
from __future__ import annotations

import logging
import threading

from pagedserve.contracts import env
from pagedserve.contracts.config import EngineConfig
from pagedserve.contracts.cpu_threads import openmp_defaults, openmp_loaded
from pagedserve.contracts.errors import ExecutorError
from pagedserve.gpu.executor import Executor, InprocExecutor

logger = logging.getLogger(__name__)


def create_executor(config: EngineConfig, cancel: threading.Event | None = None) -> Executor:
    """``cancel`` set while the model loads (a shutdown during a restart) stops the start with
    ExecutorError: worker processes are killed mid-load; an in-process load is undone after it."""
    kind = config.parallel.resolved_executor()
    loaded = openmp_loaded()
    if openmp_defaults() and loaded and kind == "inproc":  # workers started from here still get them
        logger.debug("OpenMP was loaded before its wait settings were set: in-process threads spin "
                     "libgomp's default time (start through the CLI, or import pagedserve before torch)")
    if kind == "inproc":
        if config.parallel.tensor_parallel_size != 1:
            raise ExecutorError("tensor_parallel_size > 1 needs executor='mp' (or 'ray')")
        if config.parallel.pipeline_parallel_size != 1:
            raise ExecutorError("pipeline_parallel_size > 1 needs executor='mp' (or 'ray')")
        executor = InprocExecutor(config)
        if cancel is not None and cancel.is_set():
            executor.shutdown()
            raise ExecutorError("the model load was cancelled (the server is shutting down)")
        return executor
    if kind == "mp":
        from pagedserve.gpu.mp_executor import MultiprocExecutor

        return MultiprocExecutor(config, cancel=cancel)
    if kind == "ray":  # Ray is imported there, never here (an optional extra)
        return create_ray_executor(config)
    raise ExecutorError(f"unknown executor {kind!r}: choose inproc, mp or ray")


def create_ray_executor(config: EngineConfig, *, runner_factory: str | None = None,
                        startup_timeout: float | None = None, num_threads: int | None = None,
                        transport: str | None = None) -> Executor:
    """Place the actors, then run steps over the ring (all on this node) or over Ray calls.
    ``transport`` (shm | ray) forces one; None = $PAGEDSERVE_RAY_TRANSPORT, else by placement."""
    from pagedserve.gpu.ray_cluster import place_workers

    p = config.parallel
    world = p.world_size  # rank = stage * tp + tp rank, one actor (and bundle) each
    wanted = transport or env.RAY_TRANSPORT.get()  # None = the ring on one node, Ray calls across
    if wanted not in (None, "shm", "ray"):
        raise ExecutorError(f"unknown Ray executor transport {wanted!r}: use shm or ray")
    placed = place_workers(config, world)
    try:
        transport = wanted or ("shm" if placed.all_local else "ray")
        if transport == "shm" and not placed.all_local:
            raise ExecutorError(f"{env.RAY_TRANSPORT.name}=shm needs every worker on this node; Ray placed "
                                "some elsewhere (use --ray-placement-strategy STRICT_PACK)")
        logger.info("Ray executor: %d worker(s) (tp %d x pp %d), steps over %s", world,
                    p.tensor_parallel_size, p.pipeline_parallel_size,
                    "the shared-memory ring" if transport == "shm" else "Ray actor calls")
        if transport == "shm":
            from pagedserve.gpu.ray_executor import RayRingExecutor

            return RayRingExecutor(config, placed, runner_factory=runner_factory,
                                   startup_timeout=startup_timeout, num_threads=num_threads)
        from pagedserve.gpu.ray_call_executor import RayCallExecutor

        return RayCallExecutor(config, placed, runner_factory=runner_factory,
                               startup_timeout=startup_timeout, num_threads=num_threads)
    except BaseException:
        placed.release()
        placed.leave_ray()
        raise
