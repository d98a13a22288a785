"""Executors run a StepInput on the workers and return the StepOutput.

One interface, chosen by ``ParallelConfig.executor`` (gpu/executor_factory.py builds the one
asked for): ``inproc`` (the model runner in this process; its async form runs the step in a
worker thread so the event loop stays free) and ``mp`` (worker processes fed over
shared-memory rings, see gpu/mp_executor.py) and ``ray`` (Ray actors in a placement group, on
one node or many: gpu/ray_executor.py). The concrete executors import this module; it imports
none of them.

Pipelining: an executor that can keep several steps sent at once (one per pipeline stage)
says so with ``splits_steps`` and implements ``submit`` / ``collect`` (and their async forms);
``max_in_flight`` says how many steps the engine may keep sent.
"""
from __future__ import annotations

import abc
import asyncio
import concurrent.futures
from pagedserve.contracts.config import EngineConfig
from pagedserve.contracts.messages import StepInput, StepOutput
from pagedserve.gpu.heap_trim import HeapTrimmer


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

    # ---- pipelining: sending a step apart from collecting its reply -------------------------

    # True where submit / collect (and their async forms) are implemented: the engine then
    # keeps up to ``max_in_flight`` steps sent and collects their replies in order.
    splits_steps: bool = False

    @property
    def max_in_flight(self) -> int:
        """Steps the engine may keep sent at once (one per pipeline stage); 1 without stages."""
        return 1

    def submit(self, step: StepInput) -> None:
        """Send a step without waiting for its reply (``splits_steps`` executors)."""
        raise NotImplementedError(f"{type(self).__name__} runs a step only with execute()")

    def collect(self, step_id: int) -> StepOutput:
        """Wait for the reply to ``step_id``, the oldest step sent and not yet collected."""
        raise NotImplementedError(f"{type(self).__name__} runs a step only with execute()")

    async def submit_async(self, step: StepInput) -> None:
        """``submit`` for the event loop."""
        raise NotImplementedError(f"{type(self).__name__} runs a step only with execute_async()")

    async def collect_async(self, step_id: int) -> StepOutput:
        """``collect`` for the event loop."""
        raise NotImplementedError(f"{type(self).__name__} runs a step only with execute_async()")

    # ---- health -----------------------------------------------------------------------------

    def check_health(self) -> None:
        """Raise ExecutorError if a worker is gone."""

    async def check_health_async(self) -> None:
        """``check_health`` for the event loop: never blocks on a worker (reaping, pipes)."""
        self.check_health()


class InprocExecutor(Executor):
    def __init__(self, config: EngineConfig):
        from pagedserve.gpu.model_runner import ModelRunner

        set_inproc_threads(config.parallel.worker_threads)
        self.runner = ModelRunner(config)
        self.num_blocks = self.runner.initialize()
        self.num_swap_blocks = self.runner.num_swap_blocks
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pagedserve-step")
        self._heap = HeapTrimmer()  # this process's C heap: free pages back now and then (issue 35)

    def execute(self, step: StepInput) -> StepOutput:
        out = self.runner.execute(step)
        self._heap.after_step()
        return out

    async def execute_async(self, step: StepInput) -> StepOutput:
        return await asyncio.get_running_loop().run_in_executor(self._pool, self.execute, step)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)
        self.runner = None


def set_inproc_threads(requested: int | None) -> int:
    """This process's torch threads for an in-process model. A count the user chose
    (--worker-threads, $PAGEDSERVE_WORKER_THREADS) is set as given; else torch's current count is
    only capped at the CPUs this process may use (affinity mask and cgroup quota): torch's default
    counts the affinity mask alone, so under a CPU quota it runs more threads than can run at once,
    and a caller that lowered the count itself keeps its choice."""
    import torch

    from pagedserve.contracts import env
    from pagedserve.gpu.worker import _threads_for_rank

    threads = _threads_for_rank(1, requested)
    if not (requested or env.WORKER_THREADS.is_set()):
        threads = min(threads, torch.get_num_threads())
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return threads
