"""The engine's step loop: one object given its output sink and wake-up event, driving a core and
an executor it is handed (``run(core, executor)``): one step at a time, or pipelined for executors
that split sending a step from collecting its reply; the idle wait with its worker health checks;
each step's outputs handed to the sink. A fault in scheduling or processing fails the requests of
that step, and the loop goes on unless it keeps happening (``MAX_UNATTRIBUTED_FAULTS``). An
executor failure (ExecutorError) leaves ``run``: AsyncEngine restarts the workers or dies
(engine/worker_restarts.py)."""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Protocol

from pagedserve.engine.core import INTERNAL_REQUEST_ERROR
from pagedserve.engine.errors import EngineError
from pagedserve.engine.outputs import RequestOutput
from pagedserve.contracts.messages import StepEncodeError

logger = logging.getLogger(__name__)

# How often an idle engine loop checks that its workers are alive.
IDLE_HEALTH_CHECK_S = 1.0
# Steps in a row that fail in the core for no request it can name before the loop gives up.
MAX_UNATTRIBUTED_FAULTS = 3


class OutputSink(Protocol):
    """Where the step loop's outputs go (AsyncEngine: one queue per request)."""

    def deliver(self, outputs: list[RequestOutput]) -> None:
        """Hand a step's deltas to their requests."""

    def fail_stream(self, request_id: str, error: BaseException) -> None:
        """End the request's stream with ``error`` (the core could not even fail it)."""

    def apply_pending_aborts(self, core) -> None:
        """Abort, in ``core``, the requests whose streams ended since the last step."""


class StepLoop:
    """Steps ``core`` on ``executor`` until cancelled or the executor fails; outputs go to ``sink``,
    and ``wake`` ends an idle wait (a new request, an abort, a compiled grammar)."""

    def __init__(self, sink: OutputSink, wake: asyncio.Event) -> None:
        self.sink = sink
        self.wake = wake
        self.last_step_gap_s = 0.0  # time between a step's reply and the next step's send
        self._unattributed_faults = 0  # steps in a row that failed in the core for no known request

    async def run(self, core, executor) -> None:
        if executor.splits_steps:
            return await self._pipelined_step_loop(core, executor)
        return await self._step_loop(core, executor)

    def _schedule(self, core):
        """``core.schedule()``; a fault there fails the requests it had (no one request can be
        named) and the loop goes on, unless it keeps happening."""
        try:
            return core.schedule() if core.has_unfinished() else None
        except Exception as e:  # noqa: BLE001
            self.sink.deliver(self._fail_step(core, None, e))
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
                self.sink.fail_stream(request_id, EngineError(INTERNAL_REQUEST_ERROR))
                continue
            if out is not None:
                outputs.append(out)
        return outputs

    async def _step_loop(self, core, executor) -> None:
        reply_time = None  # when the previous step's output arrived (None after an idle wait)
        loop = asyncio.get_running_loop()
        wake = self.wake
        # A grammar compiled in its thread wakes the loop (set() runs on the loop, after any clear()).
        core.constraints.on_ready = lambda: loop.call_soon_threadsafe(wake.set)
        while True:
            self.sink.apply_pending_aborts(core)
            scheduled = self._schedule(core)
            ready = core.take_outputs()  # requests whose grammar failed to compile
            if ready:
                self.sink.deliver(ready)
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
                self.sink.deliver(core.fail_unsent(scheduled, e))
                reply_time = None
                continue
            reply_time = time.perf_counter()
            self.sink.deliver(self._process(core, scheduled, output))
            await asyncio.sleep(0)  # let streams flush before the next step is sent

    async def _idle_wait(self, executor) -> None:
        """Nothing to run: sleep until woken, checking the workers' health now and then."""
        self.wake.clear()
        try:
            # Not wait_for: on Python 3.11 it returns the inner result when a cancel arrives in
            # the tick the wake-up does (shutdown aborts, then cancels), and the loop would run
            # on; asyncio.timeout lets that cancel through.
            async with asyncio.timeout(IDLE_HEALTH_CHECK_S):
                await self.wake.wait()
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
        wake = self.wake
        core.constraints.on_ready = lambda: loop.call_soon_threadsafe(wake.set)
        undelivered = None  # the last reply's outputs, handed over once the next step is sent
        reply_time = None
        while True:
            self.sink.apply_pending_aborts(core)
            try:
                while len(in_flight) < executor.max_in_flight and core.has_unfinished():
                    scheduled = self._schedule(core)
                    if scheduled is None:
                        break
                    try:
                        await executor.submit_async(scheduled.step_input)
                    except StepEncodeError as e:
                        self.sink.deliver(core.fail_unsent(scheduled, e))
                        continue
                    if reply_time is not None:
                        self.last_step_gap_s = time.perf_counter() - reply_time
                        reply_time = None
                    in_flight.append(scheduled)
            finally:  # a send that fails (dead worker) must not lose the outputs already made
                if undelivered:
                    self.sink.deliver(undelivered)
            if undelivered:
                undelivered = None
                await asyncio.sleep(0)  # the streams flush while the step computes
            ready = core.take_outputs()
            if ready:
                self.sink.deliver(ready)
            if not in_flight:
                await self._idle_wait(executor)
                continue
            scheduled = in_flight.popleft()
            output = await executor.collect_async(scheduled.step_input.step_id)
            reply_time = time.perf_counter()
            undelivered = self._process(core, scheduled, output)
