"""Steps over Ray actor calls: the Ray executor's transport when the ranks span nodes.

Each step is one ``execute`` call per rank carrying the encoded StepInput (msgpack bytes, the
ring's message); rank 0 answers with the encoded StepOutput. An actor runs its calls one at a
time in the order sent, and the executor keeps one step in flight, so replies cannot mix up.

Failures, as the mp executor's: a dead actor (or node) fails its pending call with
``RayActorError``; an error on a rank > 0, a step with no answer within ``--step-timeout``, or an
error on rank 0 alone with tensor parallelism (the ranks' collectives are out of step) fail the
executor: every later call raises the same ``ExecutorError`` and the actors are killed and the
placement group removed (on a thread: nothing on the event loop waits for Ray). An error on
rank 0 of a single-rank group only fails that step's requests. While idle, ``check_health_async``
pings every actor: a dead one fails the executor.
"""
from __future__ import annotations

import asyncio
import logging
import threading

import msgspec

from gpu.config import EngineConfig
from gpu.executor import Executor, ExecutorError
from gpu.messages import STEP_OUTPUT_DECODER, StepInput, StepOutput
from gpu.mp_executor import DEFAULT_STARTUP_TIMEOUT_S, WARMUP_STEPS
from gpu.ray_cluster import PlacedWorkers, import_ray
from gpu.worker import encode_step

logger = logging.getLogger(__name__)

HEALTH_PING_TIMEOUT_S = 5.0


class RayCallExecutor(Executor):
    def __init__(self, config: EngineConfig, placed: PlacedWorkers, *, runner_factory: str | None = None,
                 startup_timeout: float | None = None, num_threads: int | None = None):
        from gpu.ray_executor import start_ranks

        self.config = config
        self._placed = placed
        self.world_size = len(placed.actors)
        self._error: ExecutorError | None = None
        self._closed = False
        self._lock: asyncio.Lock | None = None
        self._lock_loop = None
        self._reaper: threading.Thread | None = None
        self._startup_timeout = startup_timeout or DEFAULT_STARTUP_TIMEOUT_S
        step_timeout = config.parallel.step_timeout_s
        if step_timeout is not None and not step_timeout >= 0:
            raise ExecutorError(f"--step-timeout must be >= 0 seconds (0 = no limit), got {step_timeout}")
        self._step_timeout = step_timeout or None
        self._steps_sent = 0
        self.num_blocks = start_ranks(placed, config, runner_factory, num_threads, self._startup_timeout)

    # ------------------------------------------------------------------ failures

    def _fail(self, message: str) -> ExecutorError:
        """Remember the error; kill the actors and drop the placement group on a reaper thread."""
        if self._error is None:
            self._error = ExecutorError(message)
            logger.error("%s", message)
            self._reaper = threading.Thread(target=self._placed.release, name="pagedserve-ray-reaper",
                                            daemon=True)
            self._reaper.start()
        return self._error

    def _check_usable(self) -> None:
        if self._error is not None:
            raise self._error
        if self._closed:
            raise ExecutorError("the executor was shut down")

    def _error_from(self, exc: BaseException, step: StepInput, timeout: float | None) -> ExecutorError:
        """The executor's failure for what a step's calls raised."""
        from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

        rank = getattr(exc, "_pagedserve_rank", "?")
        if isinstance(exc, (GetTimeoutError, TimeoutError)):
            return self._fail(
                f"no reply to step {step.step_id} within {timeout:g} s (--step-timeout): the Ray "
                "workers are alive but stuck (a deadlock or a stuck collective?) and are being "
                "stopped; in-flight requests cannot finish. Raise --step-timeout if a step can "
                "legitimately take that long")
        if isinstance(exc, RayActorError):
            return self._fail(f"worker {rank} (Ray actor) died: {exc}; in-flight requests cannot finish")
        if isinstance(exc, RayTaskError):
            return self._fail(f"step {step.step_id} failed on worker {rank}; the worker group cannot "
                              f"go on and in-flight requests cannot finish:\n{exc}")
        return self._fail(f"step {step.step_id} failed in the Ray transport: {exc!r}")

    def _output(self, step: StepInput, reply: bytes) -> StepOutput:
        try:
            out = STEP_OUTPUT_DECODER.decode(reply)
        except msgspec.DecodeError as e:
            raise self._fail(f"worker 0 sent a reply that cannot be decoded ({e}); in-flight "
                             "requests cannot finish") from None
        if out.step_id != step.step_id:
            raise self._fail(f"worker 0 answered step {step.step_id} with step {out.step_id}; "
                             "in-flight requests cannot finish")
        if out.error is not None and self.world_size > 1:
            raise self._fail(
                f"step {step.step_id} failed on worker 0 while the other {self.world_size - 1} "
                "rank(s) went on: with tensor parallelism the ranks' collectives are out of step, "
                f"so the worker group cannot go on; in-flight requests cannot finish. Worker 0's "
                f"error:\n{out.error}")
        return out

    # ------------------------------------------------------------------ steps

    def _timeout_for_next_step(self) -> float | None:
        if self._step_timeout is None:
            return None
        if self._steps_sent < WARMUP_STEPS:
            return max(self._step_timeout, self._startup_timeout)
        return self._step_timeout

    def _send(self, step: StepInput) -> list:
        msg = bytes(encode_step(step))  # StepEncodeError: nothing sent, the engine goes on
        refs = [a.execute.remote(msg) for a in self._placed.actors]
        self._steps_sent += 1
        return refs

    def execute(self, step: StepInput) -> StepOutput:
        self._check_usable()
        ray = import_ray()
        timeout = self._timeout_for_next_step()
        refs = self._send(step)
        pending, rank_of = list(refs), {ref: r for r, ref in enumerate(refs)}
        try:
            while pending:  # one at a time, so the first failure names its rank
                ready, pending = ray.wait(pending, num_returns=1, timeout=timeout)
                if not ready:
                    raise TimeoutError
                try:
                    ray.get(ready[0])
                except Exception as e:
                    e._pagedserve_rank = rank_of[ready[0]]
                    raise
            reply = ray.get(refs[0])
        except Exception as e:
            raise self._error_from(e, step, timeout) from None
        return self._output(step, reply)

    async def execute_async(self, step: StepInput) -> StepOutput:
        loop = asyncio.get_running_loop()
        if self._lock is None or self._lock_loop is not loop:
            self._lock, self._lock_loop = asyncio.Lock(), loop
        async with self._lock:
            self._check_usable()
            timeout = self._timeout_for_next_step()
            refs = self._send(step)
            futures = [asyncio.wrap_future(ref.future()) for ref in refs]
            try:
                done, pending = await asyncio.wait(futures, timeout=timeout,
                                                   return_when=asyncio.FIRST_EXCEPTION)
                for rank, fut in enumerate(futures):
                    if fut in done and fut.exception() is not None:
                        exc = fut.exception()
                        exc._pagedserve_rank = rank
                        raise exc
                if pending:
                    raise TimeoutError
            except asyncio.CancelledError:
                raise  # the calls still run; the actors answer them in order, nobody waits
            except Exception as e:
                raise self._error_from(e, step, timeout) from None
            return self._output(step, futures[0].result())

    # ------------------------------------------------------------------ health

    def check_health(self) -> None:
        self._check_usable()
        ray = import_ray()
        from ray.exceptions import RayActorError

        pings = [a.ping.remote() for a in self._placed.actors]
        ready, _ = ray.wait(pings, num_returns=len(pings), timeout=HEALTH_PING_TIMEOUT_S)
        for rank, ref in enumerate(pings):
            if ref in ready:
                try:
                    ray.get(ref)
                except RayActorError as e:
                    raise self._fail(f"worker {rank} (Ray actor) died: {e}; in-flight requests "
                                     "cannot finish") from None

    async def check_health_async(self) -> None:
        self._check_usable()
        from ray.exceptions import RayActorError

        pings = [asyncio.wrap_future(a.ping.remote().future()) for a in self._placed.actors]
        done, _ = await asyncio.wait(pings, timeout=HEALTH_PING_TIMEOUT_S)
        for rank, fut in enumerate(pings):  # a busy actor answers later: only death counts
            if fut in done and isinstance(fut.exception(), RayActorError):
                raise self._fail(f"worker {rank} (Ray actor) died: {fut.exception()}; in-flight "
                                 "requests cannot finish")

    # ------------------------------------------------------------------ shutdown

    def shutdown(self) -> None:
        """Leave the process group, kill the actors, remove the placement group. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._error is None and self._placed.actors:
                ray = import_ray()
                try:
                    ray.get([a.stop.remote() for a in self._placed.actors], timeout=10)
                except Exception:  # a dead or stuck actor: the kill settles it
                    pass
            if self._reaper is not None:
                self._reaper.join()
        finally:
            self._placed.release()
            self._placed.leave_ray()

    @property
    def worker_pids(self) -> list[int]:
        return list(self._placed.pids)
