"""Executors run a StepInput on the workers and return the StepOutput.

One interface, chosen by ``ParallelConfig.executor``: ``inproc`` (the model runner in this
process; its async form runs the step in a worker thread so the event loop stays free) and
``mp`` (worker processes fed over shared-memory rings, see gpu/mp_executor.py) and ``ray``
(Ray actors in a placement group, on one node or many: gpu/ray_executor.py).
"""
from __future__ import annotations

import abc
import asyncio
import concurrent.futures
import threading

from contracts.config import EngineConfig
from contracts.errors import ExecutorError
from contracts.messages import StepInput, StepOutput


class Executor(abc.ABC):
    num_blocks: int  # KV blocks each worker allocated
    num_swap_blocks: int = 0  # host swap-pool blocks each worker allocated (--preemption-mode swap)

    @abc.abstractmethod
    def execute(self, step: StepInput) -> StepOutput:
        """Run one step synchronously (offline API, tests)."""

    @abc.abstractmethod
    async def execute_async(self, step: StepInput) -> StepOutput:
        """Run one step without blocking the event loop."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Release workers, shared memory and caches. Safe to call twice."""

    def check_health(self) -> None:
        """Raise ExecutorError if a worker is gone."""

    async def check_health_async(self) -> None:
        """``check_health`` for the event loop: never blocks on a worker (reaping, pipes)."""
        self.check_health()


class InprocExecutor(Executor):
    def __init__(self, config: EngineConfig):
        from gpu.model_runner import ModelRunner

        self.runner = ModelRunner(config)
        self.num_blocks = self.runner.initialize()
        self.num_swap_blocks = self.runner.num_swap_blocks
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pagedserve-step")

    def execute(self, step: StepInput) -> StepOutput:
        return self.runner.execute(step)

    async def execute_async(self, step: StepInput) -> StepOutput:
        return await asyncio.get_running_loop().run_in_executor(self._pool, self.runner.execute, step)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)
        self.runner = None


def create_executor(config: EngineConfig, cancel: threading.Event | None = None) -> Executor:
    """``cancel`` set while the model loads (a shutdown during a restart) stops the start with
    ExecutorError: worker processes are killed mid-load; an in-process load is undone after it."""
    kind = config.parallel.resolved_executor()
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
        from gpu.mp_executor import MultiprocExecutor

        return MultiprocExecutor(config, cancel=cancel)
    if kind == "ray":  # Ray is imported there, never here (an optional extra)
        from gpu.ray_executor import create_ray_executor

        return create_ray_executor(config)
    raise ExecutorError(f"unknown executor {kind!r}: choose inproc, mp or ray")
