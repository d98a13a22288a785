"""Steps over Ray actor calls: the Ray executor's transport when the ranks span nodes.

Each step is one ``execute`` call per rank carrying the encoded StepInput (msgpack bytes, the
ring's message); the output rank (rank 0; with pipeline stages the last stage's first rank)
answers with the encoded StepOutput. An actor runs its calls one at a time in the order one
caller sent them, and replies are collected in that order, so they cannot mix up.

Pipeline stages: as on the mp executor, the engine keeps up to ``max_in_flight`` (= pp) steps
sent (``submit``) before it ``collect``s the oldest, so the stages work on different steps at
once; the sampled tokens of each collected reply ride along with the next step's calls
(gpu/pipeline_tokens.py, the same relay as the ring's) for the stages before the last.

Failures, as the mp executor's: a dead actor (or node) fails its pending call with
``RayActorError``; an error on a rank that does not answer, a step with no answer within
``--step-timeout``, or an error on the output rank alone with more than one rank (the ranks'
collectives or stage hand-offs are out of step) fail the executor: every later call raises the
same ``ExecutorError`` and the actors are killed and the placement group removed (on a thread:
nothing on the event loop waits for Ray). An error on the only rank of a single-rank group only
fails that step's requests. While idle, ``check_health_async`` pings every actor: a dead one
fails the executor.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import threading
from dataclasses import dataclass

import msgspec

from pagedserve.contracts.config import EngineConfig
from pagedserve.contracts.errors import ExecutorError
from pagedserve.gpu.executor import Executor
from pagedserve.contracts.messages import STEP_OUTPUT_DECODER, StepInput, StepOutput
from pagedserve.contracts import env
from pagedserve.gpu.mp_executor import next_step_timeout
from pagedserve.gpu.pipeline_tokens import SampledTokenRelay
from pagedserve.gpu.ray_cluster import PlacedWorkers, import_ray
from pagedserve.gpu.ray_executor import start_ranks
from pagedserve.gpu.worker import encode_step, output_rank

logger = logging.getLogger(__name__)

HEALTH_PING_TIMEOUT_S = 5.0
# How long a rank's error waits for a peer's death to surface (its likely cause).
PEER_FAILURE_GRACE_S = 2.0


@dataclass(slots=True)
class SentStep:
    """A step whose calls went out and whose reply is not collected yet."""

    step_id: int
    refs: list  # one ObjectRef per rank
    timeout: float | None  # how long its reply may take (None = no limit)
    abandoned: bool = False  # its caller gave up; the reply is still waited for, then dropped


class RayCallExecutor(Executor):
    splits_steps = True

    def __init__(self, config: EngineConfig, placed: PlacedWorkers, *, runner_factory: str | None = None,
                 startup_timeout: float | None = None, num_threads: int | None = None):
        self.config = config
        self._placed = placed
        self.world_size = len(placed.actors)
        self._answering = output_rank(config)
        self._pipelined = config.parallel.pipeline_parallel_size > 1
        self._sampled = SampledTokenRelay()  # tokens the stages before the last have not had yet
        self._in_flight: collections.deque[SentStep] = collections.deque()  # in send order
        self._error: ExecutorError | None = None
        self._closed = False
        self._lock: asyncio.Lock | None = None
        self._lock_loop = None
        self._reaper: threading.Thread | None = None
        self._startup_timeout = startup_timeout or env.WORKER_STARTUP_TIMEOUT.get()
        self._step_timeout = config.parallel.step_timeout_s or None  # checked by ParallelConfig
        self._steps_sent = 0
        self.num_blocks = start_ranks(placed, config, runner_factory, num_threads, self._startup_timeout)

    @property
    def max_in_flight(self) -> int:
        """Steps the engine may keep sent at once: one per pipeline stage."""
        return self.config.parallel.pipeline_parallel_size

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

    def _error_from(self, exc: BaseException, sent: SentStep) -> ExecutorError:
        """The executor's failure for what a step's calls raised."""
        from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

        rank = getattr(exc, "_pagedserve_rank", "?")  # optional: set where the failing call's rank is known
        if isinstance(exc, (GetTimeoutError, TimeoutError)):
            return self._fail(
                f"no reply to step {sent.step_id} within {sent.timeout:g} s (--step-timeout): the Ray "
                "workers are alive but stuck (a deadlock or a stuck collective?) and are being "
                "stopped; in-flight requests cannot finish. Raise --step-timeout if a step can "
                "legitimately take that long")
        if isinstance(exc, RayActorError):
            return self._fail(f"worker {rank} (Ray actor) died: {exc}; in-flight requests cannot finish")
        if isinstance(exc, RayTaskError):
            return self._fail(f"step {sent.step_id} failed on worker {rank}; the worker group cannot "
                              f"go on and in-flight requests cannot finish:\n{exc}")
        return self._fail(f"step {sent.step_id} failed in the Ray transport: {exc!r}")

    def _output(self, sent: SentStep, reply: bytes) -> StepOutput:
        who = f"worker {self._answering}"
        try:
            out = STEP_OUTPUT_DECODER.decode(reply)
        except msgspec.DecodeError as e:
            raise self._fail(f"{who} sent a reply that cannot be decoded ({e}); in-flight "
                             "requests cannot finish") from None
        if out.step_id != sent.step_id:
            raise self._fail(f"{who} answered step {sent.step_id} with step {out.step_id}; "
                             "in-flight requests cannot finish")
        if out.error is not None and self.world_size > 1:
            raise self._fail(
                f"step {sent.step_id} failed on {who} while the other {self.world_size - 1} "
                "rank(s) went on: with tensor or pipeline parallelism the ranks are out of step, "
                f"so the worker group cannot go on; in-flight requests cannot finish. {who}'s "
                f"error:\n{out.error}")
        if self._pipelined:
            self._sampled.record(out)  # abandoned steps' too: the first stage needs them
        return out

    # ------------------------------------------------------------------ steps

    def _timeout_for_next_step(self) -> float | None:
        return next_step_timeout(self._step_timeout, self._startup_timeout, self._steps_sent)

    def _send(self, step: StepInput) -> None:
        msg = bytes(encode_step(step))  # StepEncodeError: nothing sent, the engine goes on
        sampled = self._sampled.take()
        timeout = self._timeout_for_next_step()
        refs = [a.execute.remote(msg, sampled) for a in self._placed.actors]
        self._steps_sent += 1
        self._in_flight.append(SentStep(step.step_id, refs, timeout))

    def _oldest(self, step_id: int) -> SentStep:
        """The step to wait for next: the oldest sent (an abandoned one before ``step_id``)."""
        if not self._in_flight:
            raise self._fail(f"step {step_id} was collected, but no step is in flight")
        sent = self._in_flight[0]
        if not sent.abandoned and sent.step_id != step_id:
            raise self._fail(f"step {step_id} was collected while step {sent.step_id} is the oldest "
                             "in flight (replies are collected in the order sent)")
        return sent

    def _wait(self, sent: SentStep) -> bytes:
        ray = import_ray()
        pending, rank_of = list(sent.refs), {ref: r for r, ref in enumerate(sent.refs)}
        try:
            while pending:  # one at a time, so the first failure names its rank
                ready, pending = ray.wait(pending, num_returns=1, timeout=sent.timeout)
                if not ready:
                    raise TimeoutError
                try:
                    ray.get(ready[0])
                except Exception as e:
                    e._pagedserve_rank = rank_of[ready[0]]
                    raise self._death_behind(e, pending, rank_of) from None
            return ray.get(sent.refs[self._answering])
        except Exception as e:
            raise self._error_from(e, sent) from None

    def _death_behind(self, exc: Exception, pending: list, rank_of: dict) -> Exception:
        """With more than one rank, a rank's error is often the echo of a peer's death (its
        collective or stage hand-off lost the peer): wait a moment for the other calls and
        name the dead actor if there is one."""
        from ray.exceptions import RayActorError, RayTaskError

        if not isinstance(exc, RayTaskError) or not pending:
            return exc
        ready, _ = import_ray().wait(pending, num_returns=len(pending), timeout=PEER_FAILURE_GRACE_S)
        for ref in ready:
            try:
                import_ray().get(ref)
            except RayActorError as death:
                death._pagedserve_rank = rank_of[ref]
                return death
            except Exception:  # another echo
                pass
        return exc

    async def _wait_async(self, sent: SentStep) -> bytes:
        from ray.exceptions import RayActorError

        futures = [asyncio.wrap_future(ref.future()) for ref in sent.refs]
        try:
            done, pending = await asyncio.wait(futures, timeout=sent.timeout,
                                               return_when=asyncio.FIRST_EXCEPTION)
            failed = [(rank, f.exception()) for rank, f in enumerate(futures)
                      if f in done and f.exception() is not None]
            if failed and pending and not any(isinstance(e, RayActorError) for _, e in failed):
                # Maybe the echo of a peer's death: give the other calls a moment (_death_behind).
                more, pending = await asyncio.wait(pending, timeout=PEER_FAILURE_GRACE_S)
                done |= more
                failed = [(rank, f.exception()) for rank, f in enumerate(futures)
                          if f in done and f.exception() is not None]
            if failed:
                rank, exc = next(((r, e) for r, e in failed if isinstance(e, RayActorError)), failed[0])
                exc._pagedserve_rank = rank
                raise exc
            if pending:
                raise TimeoutError
        except asyncio.CancelledError:
            raise
        except Exception as e:
            raise self._error_from(e, sent) from None
        return futures[self._answering].result()

    def submit(self, step: StepInput) -> None:
        """Send a step without waiting for its reply (pipeline stages: up to ``max_in_flight``)."""
        self._check_usable()
        self._send(step)

    async def submit_async(self, step: StepInput) -> None:
        self.submit(step)  # a Ray call is queued, never waited for

    def collect(self, step_id: int) -> StepOutput:
        """Wait for the reply to ``step_id``, the oldest step sent and not yet collected."""
        while True:
            self._check_usable()
            sent = self._oldest(step_id)
            try:
                reply = self._wait(sent)
            except ExecutorError:
                raise
            except BaseException:  # e.g. KeyboardInterrupt: the reply still comes
                sent.abandoned = True
                raise
            self._in_flight.popleft()
            out = self._output(sent, reply)
            if not sent.abandoned:
                return out

    async def collect_async(self, step_id: int) -> StepOutput:
        while True:
            self._check_usable()
            sent = self._oldest(step_id)
            try:
                reply = await self._wait_async(sent)
            except asyncio.CancelledError:  # the calls still run; their reply is waited for later
                sent.abandoned = True
                raise
            self._in_flight.popleft()
            out = self._output(sent, reply)
            if not sent.abandoned:
                return out

    def execute(self, step: StepInput) -> StepOutput:
        self.submit(step)
        return self.collect(step.step_id)

    async def execute_async(self, step: StepInput) -> StepOutput:
        loop = asyncio.get_running_loop()
        if self._lock is None or self._lock_loop is not loop:
            self._lock, self._lock_loop = asyncio.Lock(), loop
        async with self._lock:  # one step in flight
            self.submit(step)
            return await self.collect_async(step.step_id)

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
