"""The engine core's side of token constraints: which requests wait for their grammar, when they
may be scheduled, and the bitmask of each step's constrained rows.

A request with a grammar that is not compiled yet is held here, outside the scheduler: the
scheduler never sees it, so other requests' steps go on as if it did not exist. Once its compile
is done (``on_ready`` wakes the engine loop from the compile thread), the core admits it, with
one matcher per sequence. Matchers advance only on tokens the engine accepts; a preempted
sequence keeps its generated tokens and so its matcher state stays right through recompute.
"""
from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable

from pagedserve.engine.request import Request
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.engine.structured_output.manager import DEFAULT_COMPILE_TIMEOUT_S, StructuredOutputManager
from pagedserve.contracts.messages import pack_ints

logger = logging.getLogger(__name__)


class ConstraintTracker:
    def __init__(self, tokenizer, vocab_size: int, compile_timeout_s: float | None = DEFAULT_COMPILE_TIMEOUT_S):
        self.manager = StructuredOutputManager(tokenizer, vocab_size, compile_timeout_s=compile_timeout_s)
        self._since: dict[str, float] = {}  # request id -> when it began waiting for its grammar
        self.compiling: dict[str, Request] = {}
        # Called from the compile thread when a grammar is ready (AsyncEngine: wake the loop).
        self.on_ready: Callable[[], None] | None = None

    def check(self, params: SamplingParams) -> None:
        """Raises GrammarError (a ValueError) for a constraint that can never be honoured."""
        self.manager.check(params)

    def prepare(self, req: Request) -> bool:
        """Give the request's sequences their constraints; True when they can be scheduled now,
        False when the request waits for its grammar (held here)."""
        params = req.params
        first = None  # built once per request (bad words tokenized and indexed once), shared
        for seq in req.seqs:
            seq.constraint = first = self.manager.new_constraint(params) if first is None else first.sibling()
        spec = params.structured_outputs
        if spec is None:
            return True
        fut = self.manager.compiled(spec)
        if fut.done() and fut.exception() is None:
            self._attach(req, fut.result())
            return True
        req.grammar_future = fut
        req.compiling = True
        self.compiling[req.request_id] = req
        self._since[req.request_id] = time.monotonic()
        fut.add_done_callback(self._done)
        return False

    def _done(self, _fut: concurrent.futures.Future) -> None:
        if self.on_ready is not None:
            try:
                self.on_ready()
            except RuntimeError:  # the loop is closed (shutting down)
                pass

    def _attach(self, req: Request, compiled) -> None:
        for seq in req.seqs:
            self.manager.attach_matcher(seq.constraint, compiled)

    def take_ready(self) -> tuple[list[Request], list[tuple[Request, str, str | None]]]:
        """Requests whose compile finished: (ready to schedule, failed with a reason and an error
        code: ``grammar_compile_timeout`` past the deadline, else None)."""
        ready: list[Request] = []
        failed: list[tuple[Request, str, str | None]] = []
        timeout = self.manager.compile_timeout_s
        now = time.monotonic()
        if timeout:
            self.manager.release_overdue()
        for rid in [r for r, req in self.compiling.items()
                    if req.grammar_future.done() or (timeout and now - self._since.get(r, now) > timeout)]:
            req = self.compiling.pop(rid)
            self._since.pop(rid, None)
            fut, req.grammar_future = req.grammar_future, None
            if not fut.done():  # waited past --grammar-compile-timeout (the compile runs on)
                late = self.manager.deadline_error()
                failed.append((req, str(late), late.code))
                continue
            exc = fut.exception()
            if exc is not None:  # stays "compiling" (outside the scheduler) until it is finished
                # optional: whatever the compile raised; only the deadline / refusal errors carry a code
                failed.append((req, str(exc), getattr(exc, "code", None)))
            else:
                req.compiling = False
                self._attach(req, fut.result())
                ready.append(req)
        return ready, failed

    def forget(self, req: Request) -> None:
        self.compiling.pop(req.request_id, None)
        self._since.pop(req.request_id, None)

    def next_deadline(self) -> float | None:
        """Seconds until the first waiting request's compile deadline (the loop wakes by then)."""
        timeout = self.manager.compile_timeout_s
        if not timeout or not self._since:
            return None
        return max(0.0, min(self._since.values()) + timeout - time.monotonic())

    def wait(self, timeout: float) -> None:
        """Block until a pending compile is done (offline engine with nothing else to run)."""
        futures = [req.grammar_future for req in self.compiling.values()]
        if futures:
            nearest = self.next_deadline()
            if nearest is not None:
                timeout = min(timeout, nearest + 0.01)
            concurrent.futures.wait(futures, timeout=timeout,
                                    return_when=concurrent.futures.FIRST_COMPLETED)

    def attach_masks(self, scheduled) -> None:
        """Put the bitmask of the step's constrained sampling rows into its StepInput."""
        rows: list[int] = []
        cons = []
        seqs = []
        for i, (seq, samples) in enumerate(zip(scheduled.seqs, scheduled.samples)):
            if samples and seq.constraint is not None:
                rows.append(i)
                cons.append(seq.constraint)
                seqs.append(seq)
        if not rows:
            return
        step = scheduled.step_input
        step.token_mask_rows_buf = pack_ints(rows)
        step.token_mask_buf = self.manager.step_masks(cons, seqs)
