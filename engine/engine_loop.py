"""AsyncEngine's engine loop (a mixin, to keep async_engine.py about one job): ``_run``, which
steps until the executor fails and then restarts the workers or dies (engine/worker_restarts.py),
the step loops (one step at a time, or pipelined for executors that split sending a step from
collecting its reply), the idle wait with its worker health checks, and handing each step's
outputs to the requests' queues; a fault in scheduling or processing fails the requests of that
step, and the loop goes on unless it keeps happening (``MAX_UNATTRIBUTED_FAULTS``).

Needs AsyncEngine's ``config``, ``parts``, ``restart_policy``, ``_restart_times``,
``_accepting``, ``_wake``, ``_queues``, ``_pending_aborts``, ``_unattributed_faults``,
``last_step_gap_s`` and ``_abort_now``, and WorkerRestarts' ``_die``, ``_next_restart_delay``,
``_fail_in_flight`` and ``_restart_workers``."""
from __future__ import annotations

import asyncio
import logging
import time

from engine.core import INTERNAL_REQUEST_ERROR
from engine.errors import EngineDeadError, EngineError
from engine.outputs import RequestOutput
from contracts.error_text import error_summary
from contracts.errors import ExecutorError
from contracts.messages import StepEncodeError

logger = logging.getLogger(__name__)

# How often an idle engine loop checks that its workers are alive.
IDLE_HEALTH_CHECK_S = 1.0
# Steps in a row that fail in the core for no request it can name before the loop gives up.
MAX_UNATTRIBUTED_FAULTS = 3


class EngineLoop:
    async def _run(self) -> None:
        while True:
            try:
                await self._step_loop(self.parts.core, self.parts.executor)
            except asyncio.CancelledError:
                raise
            except ExecutorError as e:
                if not self.config.parallel.restart_workers or not self._accepting:
                    self._die(e)
                    return
                delay = self._next_restart_delay()
                if delay is None:
                    p = self.restart_policy
                    self._die(ExecutorError(
                        f"{error_summary(str(e))}; the workers failed {len(self._restart_times) + 1} "
                        f"times within {p.window_s:g} s and --restart-workers allows at most "
                        f"{p.max_restarts} restarts in that time: not restarting them again; fix the "
                        "cause (see the log) and restart the server"))
                    return
                self._fail_in_flight(EngineDeadError(
                    f"the workers failed and the request was aborted: {error_summary(str(e))} (the server is restarting "
                    "its workers; retry shortly)"))
                try:
                    await self._restart_workers(e, delay)
                except asyncio.CancelledError:
                    raise
                except BaseException as restart_error:  # noqa: BLE001
                    self._die(ExecutorError(f"{e}; restarting the workers failed: {restart_error}"))
                    return
            except BaseException as e:  # noqa: BLE001 - any failure must reach every request
                self._die(e)
                return

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Hand a step's deltas to their requests, stamped with the time they were produced (so
        TTFT / inter-token latency measure the engine, not how fast a client reads)."""
        now = time.monotonic()
        for out in outputs:
            queue = self._queues.get(out.request_id)
            if queue is None:
                continue
            try:
                for comp in out.outputs if isinstance(out, RequestOutput) else ():  # not pooling's
                    if comp.token_ids and comp.token_times is None:
                        comp.token_times = [now] * len(comp.token_ids)
                queue.put_nowait(out)
            except Exception as e:  # noqa: BLE001 - this request's stream fails, not the loop
                logger.error("request %s: delivering its output failed", out.request_id, exc_info=e)
                self._queues.pop(out.request_id, None)
                queue.put_nowait(EngineError(INTERNAL_REQUEST_ERROR))
                self._abort_now(out.request_id)

    def _schedule(self, core):
        """``core.schedule()``; a fault there fails the requests it had (no one request can be
        named) and the loop goes on, unless it keeps happening."""
        try:
            return core.schedule() if core.has_unfinished() else None
        except Exception as e:  # noqa: BLE001
            self._deliver(self._fail_step(core, None, e))
            return None

    def _process(self, core, scheduled, output) -> list[RequestOutput]:
        """``core.process()``: a request whose own handling raises is failed inside it; a fault
        outside any one request fails the requests of the step."""
        try:
            outputs = core.process(scheduled, output)
        except Exception as e:  # noqa: BLE001
            return self._fail_step(core, scheduled, e)
        self._unattributed_faults = 0
        return outputs

    def _fail_step(self, core, scheduled, e: Exception) -> list[RequestOutput]:
        self._unattributed_faults += 1
        if self._unattributed_faults > MAX_UNATTRIBUTED_FAULTS:
            raise e  # the core is broken, not a request: the loop dies (every request is told)
        where = "processing a step" if scheduled is not None else "scheduling"
        logger.error("the engine failed while %s; failing its requests, the engine goes on", where, exc_info=e)
        ids = ({seq.request.request_id for seq in scheduled.seqs} if scheduled is not None
               else set(core.requests))
        outputs = []
        for request_id in ids:
            req = core.requests.get(request_id)
            if req is None:
                continue
            try:
                out = core.fail_request(req, None)
            except Exception:  # noqa: BLE001
                logger.exception("request %s: failing it failed", request_id)
                core.requests.pop(request_id, None)
                queue = self._queues.pop(request_id, None)
                if queue is not None:
                    queue.put_nowait(EngineError(INTERNAL_REQUEST_ERROR))
                continue
            if out is not None:
                outputs.append(out)
        return outputs

    async def _step_loop(self, core, executor) -> None:
        if executor.splits_steps:
            return await self._pipelined_step_loop(core, executor)
        reply_time = None  # when the previous step's output arrived (None after an idle wait)
        loop = asyncio.get_running_loop()
        wake = self._wake
        # A grammar compiled in its thread wakes the loop (set() runs on the loop, after any clear()).
        core.constraints.on_ready = lambda: loop.call_soon_threadsafe(wake.set)
        while True:
            self._apply_pending_aborts(core)
            scheduled = self._schedule(core)
            ready = core.take_outputs()  # requests whose grammar failed to compile
            if ready:
                self._deliver(ready)
            if scheduled is None:
                reply_time = None
                await self._idle_wait(executor)
                continue
            if reply_time is not None:
                # Output processing, stream flushes and scheduling between two steps.
                self.last_step_gap_s = time.perf_counter() - reply_time
            try:
                output = await executor.execute_async(scheduled.step_input)
            except StepEncodeError as e:  # one request's values: fail its step, not the engine
                self._deliver(core.fail_unsent(scheduled, e))
                reply_time = None
                continue
            reply_time = time.perf_counter()
            self._deliver(self._process(core, scheduled, output))
            await asyncio.sleep(0)  # let streams flush before the next step is sent

    def _apply_pending_aborts(self, core) -> None:
        """Abort, in the core, the requests whose streams ended since the last step."""
        while self._pending_aborts:
            request_id, queue = self._pending_aborts.pop()
            if self._queues.get(request_id) is queue:  # else already ended (or the id reused)
                del self._queues[request_id]
                core.abort_request(request_id)

    async def _idle_wait(self, executor) -> None:
        """Nothing to run: sleep until woken, checking the workers' health now and then."""
        self._wake.clear()
        try:
            # Not wait_for: on Python 3.11 it returns the inner result when a cancel arrives in
            # the tick the wake-up does (shutdown aborts, then cancels), and the loop would run
            # on; asyncio.timeout lets that cancel through.
            async with asyncio.timeout(IDLE_HEALTH_CHECK_S):
                await self._wake.wait()
        except TimeoutError:
            await executor.check_health_async()

    async def _pipelined_step_loop(self, core, executor) -> None:
        """Executors that split sending a step from collecting its reply (``submit_async`` /
        ``collect_async``): keep up to ``executor.max_in_flight`` steps sent (one per pipeline
        stage; the scheduler keeps their sequences disjoint) and process replies oldest first, so
        stages overlap. A reply's outputs reach the streams only after the next step is sent, so
        detokenized deltas, SSE writes and client wake-ups run while the workers compute."""
        import collections

        in_flight: collections.deque = collections.deque()
        loop = asyncio.get_running_loop()
        wake = self._wake
        core.constraints.on_ready = lambda: loop.call_soon_threadsafe(wake.set)
        undelivered = None  # the last reply's outputs, handed over once the next step is sent
        reply_time = None
        while True:
            self._apply_pending_aborts(core)
            try:
                while len(in_flight) < executor.max_in_flight and core.has_unfinished():
                    scheduled = self._schedule(core)
                    if scheduled is None:
                        break
                    try:
                        await executor.submit_async(scheduled.step_input)
                    except StepEncodeError as e:
                        self._deliver(core.fail_unsent(scheduled, e))
                        continue
                    if reply_time is not None:
                        self.last_step_gap_s = time.perf_counter() - reply_time
                        reply_time = None
                    in_flight.append(scheduled)
            finally:  # a send that fails (dead worker) must not lose the outputs already made
                if undelivered:
                    self._deliver(undelivered)
            if undelivered:
                undelivered = None
                await asyncio.sleep(0)  # the streams flush while the step computes
            ready = core.take_outputs()
            if ready:
                self._deliver(ready)
            if not in_flight:
                await self._idle_wait(executor)
                continue
            scheduled = in_flight.popleft()
            output = await executor.collect_async(scheduled.step_input.step_id)
            reply_time = time.perf_counter()
            undelivered = self._process(core, scheduled, output)
