"""`pagedserve bench ipc --ray`: the Ray executor's step transports next to the ring and the Queue.

Rows added to loadtest/micro/bench_ipc.py's table, each a one-rank Ray actor running the echo runner:

  ray-ring     RayRingExecutor.execute: the actor on this node, steps over the shared-memory ring
  ray-call     RayCallExecutor.execute: one Ray actor call per step (the transport across nodes)
  ray-cgraph   a Ray compiled graph over the same actor method (Ray's own low-latency channel)

A local Ray instance is started for the measurement (4 logical CPUs, small object store) and
stopped after it. Ray is imported here only, and this module only with ``--ray``.
"""
from __future__ import annotations

from pagedserve.loadtest.micro.ipc_echo import _Echo
from pagedserve.contracts.messages import STEP_OUTPUT_DECODER, StepInput
from pagedserve.gpu.worker import encode_step

ECHO_RUNNER = "pagedserve.loadtest.micro.bench_ipc:EchoRunner"


class _ExecutorEcho(_Echo):
    def __init__(self, executor):
        self.ex = executor

    def round_trip(self, step: StepInput):
        return self.ex.execute(step)

    def close(self) -> None:
        self.ex.shutdown()


class _CompiledGraphEcho(_Echo):
    """A compiled graph ``input -> RayWorker.execute`` (bytes in, bytes out)."""

    def __init__(self):
        import ray
        from ray.dag import InputNode

        from pagedserve.contracts.config import EngineConfig
        from pagedserve.gpu.ray_worker import RayWorker

        self.actor = ray.remote(RayWorker).options(num_cpus=1).remote()
        ray.get(self.actor.start.remote(EngineConfig(), 0, 1, None, ECHO_RUNNER, 30, 1))
        with InputNode() as inp:
            dag = self.actor.execute.bind(inp)
        self.graph = dag.experimental_compile()

    def round_trip(self, step: StepInput):
        import ray

        return STEP_OUTPUT_DECODER.decode(ray.get(self.graph.execute(bytes(encode_step(step)))))

    def close(self) -> None:
        import ray

        self.graph.teardown()
        ray.kill(self.actor)


def ray_echoes() -> dict[str, _Echo]:
    import ray

    from pagedserve.contracts.config import EngineConfig
    from pagedserve.gpu.executor_factory import create_ray_executor

    ray.init(address="local", num_cpus=4, object_store_memory=128 << 20, include_dashboard=False)
    config = EngineConfig.from_options(executor="ray")
    echoes: dict[str, _Echo] = {}
    try:
        for name, transport in (("ray-ring", "shm"), ("ray-call", "ray")):
            echoes[name] = _ExecutorEcho(create_ray_executor(config, runner_factory=ECHO_RUNNER,
                                                             startup_timeout=120, transport=transport))
        echoes["ray-cgraph"] = _CompiledGraphEcho()
    except BaseException:
        close_ray(echoes)
        raise
    return echoes


def close_ray(echoes: dict[str, _Echo]) -> None:
    """Close the Ray rows, then stop the local instance."""
    import ray

    for echo in echoes.values():
        try:
            echo.close()
        except Exception:
            pass
    ray.shutdown()
