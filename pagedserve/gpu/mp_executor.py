"""Multi-process executor: ``tensor_parallel_size x pipeline_parallel_size`` spawned workers fed
over shared-memory rings.

The engine writes each StepInput to the step ring (read by every rank); rank 0 answers on the
reply ring (with pipeline stages the last stage's first rank answers, and the sampled tokens of
each reply go back to the earlier stages ahead of the next step: gpu/pipeline.py). ``execute_async`` waits for the reply with ``loop.add_reader`` on the reply ring's
eventfd and on every worker's sentinel, so the event loop never blocks on a worker and a worker
that dies fails the pending step at once. After a death the executor tears everything down on a
reaper thread (joins, terminate, kill take seconds with a stuck rank; nothing on the event loop
waits for a process) and every later call raises ``ExecutorError`` with the same message.

Replies are matched to steps by id: a reply to a step whose caller was cancelled is dropped by
its id, any other mismatch is a worker fault that fails the executor (never a silent shift of
every later step). A step with no reply within ``step_timeout_s`` (workers alive but stuck)
fails the executor the same way, and so does, with tensor parallelism, a step that failed on
rank 0 alone (the ranks' collectives are out of step); with one rank a step error only fails
that step's requests.

Everything the executor owns (processes, rings, pipes) sits in a ``WorkerGroup``
(gpu/worker_group.py), released by ``shutdown()``, by the garbage collector or at interpreter
exit; the rings' creator is this process, so its resource tracker also unlinks them if this process is killed, and the workers
exit when they see this process's sentinel close.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import multiprocessing
import socket
import threading
import time
import types
import weakref
from multiprocessing.connection import wait

import msgspec

from pagedserve.contracts import env
from pagedserve.contracts.config import EngineConfig
from pagedserve.contracts.errors import ExecutorError
from pagedserve.contracts.log_format import current_format
from pagedserve.gpu.executor import Executor
from pagedserve.contracts.messages import STEP_OUTPUT_DECODER, StepInput, StepOutput
from pagedserve.gpu.pipeline_tokens import SampledTokenRelay
from pagedserve.gpu.shm_ring import RingPeerDied, RingTimeout
from pagedserve.gpu.transport import create_channel
from pagedserve.gpu.worker import WorkerArgs, encode_step, worker_main
from pagedserve.gpu.worker_group import WorkerGroup, describe_exit

logger = logging.getLogger(__name__)

# The first steps after start may compile kernels or touch fresh memory: they get the startup
# timeout instead of the step timeout.
WARMUP_STEPS = 3
# How often a start that can be cancelled looks at its cancel event while the workers load.
CANCEL_POLL_S = 0.1
RING_SLOTS = 64
RING_SLOT_SIZE = 16384


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]



def next_step_timeout(step_timeout: float | None, startup_timeout: float, steps_sent: int) -> float | None:
    """Seconds the next step may take (None = no limit); the first WARMUP_STEPS get the startup's.
    One rule for every executor that times its workers' steps."""
    if step_timeout is None:
        return None
    if steps_sent < WARMUP_STEPS:
        return max(step_timeout, startup_timeout)
    return step_timeout

class MultiprocExecutor(Executor):
    splits_steps = True  # submit / collect: up to max_in_flight steps sent (pipeline stages)

    def __init__(self, config: EngineConfig, *, runner_factory: str | None = None,
                 startup_timeout: float | None = None, num_threads: int | None = None,
                 cancel: threading.Event | None = None):
        """Spawn the workers and wait until each reports its KV block count (or an error).
        ``cancel`` set meanwhile (a shutdown during a restart) ends the wait at once: the workers
        are killed mid-load and ExecutorError is raised."""
        self.config = config
        p = config.parallel
        self.world_size = p.world_size
        self._pipelined = p.pipeline_parallel_size > 1
        # Sampled tokens of replies the stages before the last have not been sent yet; they go
        # out ahead of the next step.
        self._sampled = SampledTokenRelay()
        self._res = WorkerGroup()
        self._error: ExecutorError | None = None
        # Ids of sent steps whose caller gave up (cancelled, interrupted), in send order: their
        # replies still come and are dropped by id.
        self._abandoned: collections.deque[int] = collections.deque()
        self._lock: asyncio.Lock | None = None
        self._reaper: threading.Thread | None = None
        self._lock_loop = None
        self._sentinels: list[int] = []
        self._startup_timeout = startup_timeout or env.WORKER_STARTUP_TIMEOUT.get()
        self._step_timeout = config.parallel.step_timeout_s or None  # checked by ParallelConfig
        self._steps_sent = 0
        self._cancel = cancel
        try:
            self._check_cancelled()
            self._start(runner_factory, self._startup_timeout, num_threads)
        except BaseException:
            self._res.close(graceful=False)
            raise

    def _start(self, runner_factory: str | None, timeout: float, num_threads: int | None) -> None:
        ctx = multiprocessing.get_context("spawn")
        res = self._res
        # The shm ring on x86, pipes elsewhere (gpu/transport.py says why).
        kind = self.config.parallel.step_transport
        res.step_ring = create_channel(self.world_size, RING_SLOTS, RING_SLOT_SIZE, role="writer", kind=kind)
        res.reply_ring = create_channel(1, RING_SLOTS, RING_SLOT_SIZE, role=0, kind=kind)
        # Created after the rings: at interpreter exit finalizers run newest first, so the
        # workers get their stop message before the rings are unlinked.
        self._finalizer = weakref.finalize(self, res.close)
        init_method = f"tcp://127.0.0.1:{_free_port()}" if self.world_size > 1 else None
        t0 = time.monotonic()
        for rank in range(self.world_size):
            recv_conn, send_conn = ctx.Pipe(duplex=False)
            args = WorkerArgs(self.config, rank, self.world_size, res.step_ring.spec, res.reply_ring.spec,
                              send_conn, init_method, runner_factory,
                              logging.getLogger().getEffectiveLevel(), num_threads, log_format=current_format())
            proc = ctx.Process(target=worker_main, args=(args,), name=f"pagedserve-worker-{rank}",
                               daemon=True)
            proc.start()
            send_conn.close()
            res.procs.append(proc)
            res.conns.append(recv_conn)
        self._sentinels = [p.sentinel for p in res.procs]
        res.step_ring.peer_fds = list(self._sentinels)
        res.reply_ring.peer_fds = list(self._sentinels)
        self.num_blocks = self._wait_ready(timeout)
        logger.info("%d worker process(es) ready in %.1f s, %d KV blocks each", self.world_size,
                    time.monotonic() - t0, self.num_blocks)

    def _check_cancelled(self) -> None:
        if self._cancel is not None and self._cancel.is_set():
            raise ExecutorError("the worker start was cancelled (the server is shutting down)")

    def _wait_ready(self, timeout: float) -> int:
        res = self._res
        pending = dict(enumerate(res.conns))
        blocks: dict[int, int] = {}
        swap_blocks: dict[int, int] = {}
        deadline = time.monotonic() + timeout
        while pending:
            self._check_cancelled()
            left = deadline - time.monotonic()
            if left <= 0:
                raise ExecutorError(
                    f"worker(s) {sorted(pending)} did not report ready within {timeout:.0f} s; "
                    "raise PAGEDSERVE_WORKER_STARTUP_TIMEOUT if the model is slow to load")
            waitables = list(pending.values()) + [res.procs[r].sentinel for r in pending]
            ready = wait(waitables, left if self._cancel is None else min(left, CANCEL_POLL_S))
            for rank, conn in list(pending.items()):
                proc = res.procs[rank]
                if conn in ready or proc.sentinel in ready:
                    try:
                        kind, value, *rest = conn.recv()
                    except (EOFError, OSError):
                        proc.join(1.0)
                        raise ExecutorError(
                            f"worker {rank} {describe_exit(proc)} while starting, without reporting why; "
                            "see its output above (out of memory? a script that starts the engine "
                            "needs an `if __name__ == '__main__':` guard, workers are spawned)") from None
                    if kind == "error":
                        raise ExecutorError(f"worker {rank} failed to start:\n{value}")
                    blocks[rank] = int(value)
                    swap_blocks[rank] = int(rest[0]) if rest else 0
                    del pending[rank]
        if len(set(blocks.values())) > 1:
            logger.warning("ranks allocated different KV block counts %s; using the smallest", blocks)
        self.num_swap_blocks = min(swap_blocks.values())
        return min(blocks.values())

    # ------------------------------------------------------------------ health

    def _dead_message(self) -> str | None:
        """Why the group is unusable, or None when every worker is alive."""
        for rank, proc in enumerate(self._res.procs):
            if proc.exitcode is None:
                continue
            text = f"worker {rank} (pid {proc.pid}) {describe_exit(proc)}"
            conn = self._res.conns[rank]
            try:
                if conn.poll(0):
                    kind, value = conn.recv()
                    if kind == "error":
                        text += f":\n{value}"
            except (EOFError, OSError):
                pass
            return text + "; in-flight requests cannot finish"
        return None

    def _fail(self, message: str) -> ExecutorError:
        """Remember the error and return it; the group is torn down on a reaper thread.

        Never blocks: reaping (join, terminate, wait, kill; seconds with a stuck rank) must not
        hold the caller, which may be the event loop. ``shutdown()`` waits for the reaper."""
        if self._error is None:
            self._error = ExecutorError(message)
            logger.error("%s", message)
            self._reaper = threading.Thread(target=self._res.close, kwargs={"graceful": False},
                                            name="pagedserve-reaper", daemon=True)
            self._reaper.start()
        return self._error

    def _fail_from_death(self) -> ExecutorError:
        """Blocks up to 0.2 s (the exit status lags the sentinel): call off the event loop."""
        for _ in range(20):  # the sentinel fires as the process ends; exitcode needs the reap
            msg = self._dead_message()
            if msg is not None:
                return self._fail(msg)
            time.sleep(0.01)
        return self._fail("a worker process exited; in-flight requests cannot finish")

    async def _fail_from_death_async(self) -> ExecutorError:
        return await asyncio.get_running_loop().run_in_executor(None, self._fail_from_death)

    def _any_worker_gone(self) -> bool:
        """Non-blocking: a sentinel is readable once its process has ended."""
        return bool(self._sentinels) and bool(wait(self._sentinels, 0))

    def _check_usable(self) -> None:
        if self._error is not None:
            raise self._error
        if self._res.closed:
            raise ExecutorError("the executor was shut down")
        if self._any_worker_gone():
            raise self._fail_from_death()

    async def _check_usable_async(self) -> None:
        if self._error is not None:
            raise self._error
        if self._res.closed:
            raise ExecutorError("the executor was shut down")
        if self._any_worker_gone():
            raise await self._fail_from_death_async()

    def check_health(self) -> None:
        self._check_usable()

    async def check_health_async(self) -> None:
        await self._check_usable_async()

    # ------------------------------------------------------------------ steps

    def _timeout_for_next_step(self) -> float | None:
        return next_step_timeout(self._step_timeout, self._startup_timeout, self._steps_sent)

    def _hung_message(self, step: StepInput, timeout: float) -> str:
        return (f"no reply to step {step.step_id} within {timeout:g} s (--step-timeout): worker(s) "
                f"{self.worker_pids} are alive but stuck (a deadlock or a stuck collective?) and are "
                "being stopped; in-flight requests cannot finish. Raise --step-timeout if a step "
                "can legitimately take that long")

    def _send(self, step: StepInput, timeout: float | None) -> None:
        """Raises RingPeerDied for the caller to turn into the death error (sync or async)."""
        payload = encode_step(step)
        try:
            sampled = self._sampled.take()
            if sampled is not None:
                self._res.step_ring.send(sampled, timeout=timeout)
            self._res.step_ring.send(payload, timeout=timeout)
        except RingTimeout:
            raise self._fail(self._hung_message(step, timeout)) from None
        self._steps_sent += 1

    def _take_reply(self, expected: int) -> StepOutput | None:
        """The reply to step ``expected`` if it has arrived, else None.

        Rank 0 answers every step once, in the order sent. Replies of abandoned steps (their
        caller was cancelled) are due first and are dropped by id; any other id (a lost, repeated
        or foreign reply) is a worker fault: the executor fails rather than hand the engine
        another step's tokens."""
        ring = self._res.reply_ring
        while True:
            msg = ring.try_recv()
            if msg is None:
                return None
            try:
                out = STEP_OUTPUT_DECODER.decode(msg)
            except msgspec.DecodeError as e:
                raise self._fail(f"worker 0 sent a reply that cannot be decoded ({e}) while step "
                                 f"{expected} was running; in-flight requests cannot finish") from None
            want = self._abandoned[0] if self._abandoned else expected
            if out.step_id != want:
                why = " (abandoned: its caller was cancelled)" if self._abandoned else ""
                detail = f"; the reply carries this error:\n{out.error}" if out.error else ""
                raise self._fail(
                    f"replies out of order: expected the reply to step {want}{why}, got step "
                    f"{out.step_id} (a lost, repeated or foreign reply from worker 0); in-flight "
                    f"requests cannot finish{detail}")
            if self._pipelined:
                self._sampled.record(out)  # also abandoned ones
            if self._abandoned:
                self._abandoned.popleft()
                continue
            return out

    # With tensor parallelism every rank runs the whole step, so an error every rank hits kills
    # the ranks > 0 (worker.py) and arrives here as a death: rank 0's error reply may be the echo
    # of it (the collective lost its peer). Wait a moment for a sentinel, so the error names the
    # rank that really failed. An error on rank 0 alone (a lone OOM, a collective that timed out)
    # leaves the other ranks inside the step's collectives, where the next step's would pair with
    # the wrong peers: the group cannot go on either.
    _PEER_FAILURE_GRACE_S = 2.0

    def _error_from_peer(self, out: StepOutput) -> bool:
        return out.error is not None and self.world_size > 1

    def _lone_rank0_failure(self, step: StepInput, out: StepOutput) -> ExecutorError:
        return self._fail(
            f"step {step.step_id} failed on worker 0 while the other {self.world_size - 1} rank(s) "
            "went on: with tensor parallelism the ranks' collectives are out of step, so the "
            "worker group cannot go on; in-flight requests cannot finish. Worker 0's error:\n"
            f"{out.error}")

    def execute(self, step: StepInput) -> StepOutput:
        self.submit(step)
        return self.collect(step.step_id)

    def submit(self, step: StepInput) -> None:
        """Send a step without waiting for its reply (with pipeline stages up to
        ``max_in_flight`` are sent before the oldest reply is collected; replies come in order)."""
        self._check_usable()
        try:
            self._send(step, self._timeout_for_next_step())
        except RingPeerDied:
            raise self._fail_from_death() from None

    def collect(self, step_id: int) -> StepOutput:
        """Wait for the reply to ``step_id``, the oldest step sent and not yet collected."""
        timeout = self._step_timeout
        if timeout is not None and self._steps_sent <= WARMUP_STEPS:  # as when this step was sent
            timeout = max(timeout, self._startup_timeout)
        step = types.SimpleNamespace(step_id=step_id)  # what the error messages name
        deadline = None if timeout is None else time.monotonic() + timeout
        ring = self._res.reply_ring
        try:
            while True:
                out = self._take_reply(step_id)
                if out is not None:
                    if self._error_from_peer(out):
                        if wait(self._sentinels, self._PEER_FAILURE_GRACE_S):
                            raise RingPeerDied("a worker exited")
                        raise self._lone_rank0_failure(step, out)
                    return out
                ring.wait(deadline)
        except RingPeerDied:
            raise self._fail_from_death() from None
        except RingTimeout:
            raise self._fail(self._hung_message(step, timeout)) from None
        except ExecutorError:
            raise
        except BaseException:
            self._abandoned.append(step_id)  # e.g. KeyboardInterrupt: the reply still comes
            raise

    @property
    def max_in_flight(self) -> int:
        """Steps the engine may keep sent at once: one per pipeline stage."""
        return self.config.parallel.pipeline_parallel_size

    async def execute_async(self, step: StepInput) -> StepOutput:
        loop = asyncio.get_running_loop()
        if self._lock is None or self._lock_loop is not loop:
            self._lock, self._lock_loop = asyncio.Lock(), loop
        async with self._lock:  # one step in flight; replies come back in order
            await self._check_usable_async()
            timeout = self._timeout_for_next_step()
            try:
                self._send(step, timeout)
            except RingPeerDied:
                raise await self._fail_from_death_async() from None
            return await self._await_reply(step, timeout)

    async def submit_async(self, step: StepInput) -> None:
        """``submit`` for the event loop (pipeline stages: the engine collects replies in order
        with ``collect_async``; it is the only caller then, so no lock)."""
        await self._check_usable_async()
        try:
            self._send(step, self._timeout_for_next_step())
        except RingPeerDied:
            raise await self._fail_from_death_async() from None

    async def collect_async(self, step_id: int) -> StepOutput:
        timeout = self._step_timeout
        if timeout is not None and self._steps_sent <= WARMUP_STEPS:
            timeout = max(timeout, self._startup_timeout)
        return await self._await_reply(types.SimpleNamespace(step_id=step_id), timeout)

    async def _await_reply(self, step, timeout: float | None) -> StepOutput:
        """Wait on the reply ring's eventfd and every worker's sentinel, never blocking the loop."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        death: asyncio.Future = loop.create_future()
        ring = self._res.reply_ring
        reply_fd = ring.fileno()

        def on_reply() -> None:
            if fut.done():
                return
            ring.clear_wakeup()
            try:
                result = self._take_reply(step.step_id)
            except Exception as e:  # a corrupt or foreign reply: surface it rather than hang
                fut.set_exception(e)
                return
            if result is not None:
                fut.set_result(result)

        def on_death() -> None:
            if not death.done():
                death.set_result(None)
            if not fut.done():
                fut.set_exception(RingPeerDied("worker exited"))

        def on_timeout() -> None:
            if not fut.done():
                fut.set_exception(RingTimeout("no reply in time"))

        timer = loop.call_later(timeout, on_timeout) if timeout is not None else None
        loop.add_reader(reply_fd, on_reply)
        for s in self._sentinels:
            loop.add_reader(s, on_death)
        # With steps in flight, this reply may already be in the ring, its wake-up consumed while
        # an earlier reply was taken: look once without waiting for the eventfd.
        loop.call_soon(on_reply)
        try:
            out = await fut
            if self._error_from_peer(out):
                await asyncio.wait([death], timeout=self._PEER_FAILURE_GRACE_S)
                if death.done():
                    raise RingPeerDied("a worker exited")
                raise self._lone_rank0_failure(step, out)
            return out
        except RingPeerDied:
            pass
        except RingTimeout:
            raise self._fail(self._hung_message(step, timeout)) from None
        except asyncio.CancelledError:
            if not fut.done() or fut.cancelled():  # the reply is still to come: drop it then
                self._abandoned.append(step.step_id)
            raise
        finally:
            if timer is not None:
                timer.cancel()
            loop.remove_reader(reply_fd)
            for s in self._sentinels:
                loop.remove_reader(s)
        raise await self._fail_from_death_async()

    # ------------------------------------------------------------------ shutdown

    def shutdown(self) -> None:
        """Stop message, join with a timeout, kill leftovers, unlink the rings. Idempotent."""
        self._res.close(graceful=self._error is None)

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self._res.procs]
