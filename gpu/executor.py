"""Executors run a StepInput on the workers and return the StepOutput.

One interface, chosen by ``ParallelConfig.executor``: ``inproc`` (the model runner in this
process; its async form runs the step in a worker thread so the event loop stays free) and
``mp`` (worker processes fed over shared-memory rings, see gpu/mp_executor.py). A Ray
executor would be a third implementation of the same four methods.
"""
from __future__ import annotations

import abc
import asyncio
import concurrent.futures

from gpu.config import EngineConfig
from gpu.messages import StepInput, StepOutput


class ExecutorError(RuntimeError):
    """The workers failed (died, or a step raised); in-flight requests cannot finish."""


class Executor(abc.ABC):
    num_blocks: int  # KV blocks each worker allocated

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
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pagedserve-step")

    def execute(self, step: StepInput) -> StepOutput:
        return self.runner.execute(step)

    async def execute_async(self, step: StepInput) -> StepOutput:
        return await asyncio.get_running_loop().run_in_executor(self._pool, self.runner.execute, step)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)
        self.runner = None


def create_executor(config: EngineConfig) -> Executor:
    kind = config.parallel.resolved_executor()
    if kind == "inproc":
        if config.parallel.tensor_parallel_size != 1:
            raise ExecutorError("tensor_parallel_size > 1 needs executor='mp'")
        if config.parallel.pipeline_parallel_size != 1:
            raise ExecutorError("pipeline_parallel_size > 1 needs executor='mp'")
        return InprocExecutor(config)
    if kind == "mp":
        from gpu.mp_executor import MultiprocExecutor

        return MultiprocExecutor(config)
    raise ExecutorError(f"unknown executor {kind!r}: choose inproc or mp")
