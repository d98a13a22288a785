"""Bounded thread pools, one per kind of per-request preparation, each with a deadline.

Tokenizing, rendering a chat template and compiling a grammar scale with what a request sends.
Run in one shared pool, a few slow requests of one kind stall every tenant's new requests of
every kind; run with no deadline, one stuck request holds a thread for ever. Here each kind has
its own ``DeadlinePool``:

- at most ``workers`` tasks run at once and at most ``max_queued`` wait; past that a request is
  refused at once (``PrepBusyError``: 503 + Retry-After) instead of queueing without bound;
- a task that has not *started* within its deadline is cancelled (``PrepBusyError``: the pool is
  busy with others' work, retry), one that has *run* past it fails its request
  (``PrepDeadlineError``: a 400 naming the limit and its flag);
- a thread that neither Python nor the library can interrupt (a grammar compile in C++, a jinja
  loop) runs on, but is *abandoned*: it no longer counts against ``workers`` and a fresh thread
  takes its place, so one stuck task never starves the others. At most ``max_abandoned`` such
  threads exist at once; past that the pool runs short-handed until one of them ends (and then
  rejoins the pool), which bounds the threads a hostile client can pin.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from pagedserve.engine.errors import EngineOverloadedError, RequestRejectedError

logger = logging.getLogger(__name__)


class PrepDeadlineError(RequestRejectedError):
    """A request's preparation ran past its limit (HTTP 400 naming the limit). ``code``: the
    error code the client sees, the limit's flag as a name (``grammar_compile_timeout``)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code


class PrepBusyError(EngineOverloadedError):
    """The pool for this kind of work is full of other requests' work (HTTP 503 + Retry-After)."""


class _Task:
    __slots__ = ("fn", "args", "future", "started", "abandoned")

    def __init__(self, fn: Callable, args: tuple):
        self.fn = fn
        self.args = args
        self.future: concurrent.futures.Future = concurrent.futures.Future()
        self.started: float | None = None  # monotonic time a thread took it
        self.abandoned = False


class DeadlinePool:
    """``what``: the work in words ("tokenizing the prompt"); ``flag``: the option that sets the
    deadline (named in the 400)."""

    def __init__(self, name: str, workers: int, timeout_s: float | None, *, what: str, flag: str,
                 max_queued: int = 256, max_abandoned: int | None = None):
        self.name = name
        self.workers = max(1, int(workers))
        self.timeout_s = timeout_s or None  # 0 / None = no deadline
        self.what = what
        self.flag = flag
        self.max_queued = max_queued
        self.max_abandoned = self.workers * 4 if max_abandoned is None else max_abandoned
        self._cond = threading.Condition()
        self._queue: collections.deque[_Task] = collections.deque()
        self._live = 0  # threads that count as the pool's workers
        self._idle = 0  # of those, waiting for a task
        self._abandoned = 0  # threads still running a task past its deadline
        self._closed = False
        self.num_timeouts = 0  # tasks failed past their deadline (started)
        self.num_busy = 0  # tasks refused or cancelled unstarted

    # ---- threads -----------------------------------------------------------------------------

    def _spawn_locked(self) -> None:
        """Start a worker when work waits and no live worker is idle."""
        if self._queue and self._idle == 0 and self._live < self.workers and not self._closed:
            self._live += 1
            threading.Thread(target=self._worker, name=f"pagedserve-{self.name}", daemon=True).start()

    def _worker(self) -> None:
        while True:
            with self._cond:
                self._idle += 1
                while not self._queue and not self._closed:
                    self._cond.wait()
                self._idle -= 1
                if not self._queue:  # closed
                    self._live -= 1
                    return
                task = self._queue.popleft()
                if not task.future.set_running_or_notify_cancel():
                    continue  # cancelled while queued
                task.started = time.monotonic()
            try:
                result = task.fn(*task.args)
            except BaseException as e:  # noqa: BLE001 - handed to the waiting request
                task.future.set_exception(e)
            else:
                task.future.set_result(result)
            with self._cond:
                if task.abandoned:  # a replacement took this thread's place meanwhile
                    self._abandoned -= 1
                    if self._live >= self.workers or self._closed:
                        return
                    self._live += 1  # rejoin: the pool was running short-handed
                task.fn = task.args = None

    def abandon(self, task: _Task) -> None:
        with self._cond:
            if task.abandoned or task.future.done():
                return
            task.abandoned = True
            self._abandoned += 1
            self._live -= 1
            logger.warning("%s: a task is still running past its deadline (%s); %d such threads",
                           self.name, self.flag, self._abandoned)
            if self._abandoned <= self.max_abandoned:
                self._spawn_locked()
            else:
                logger.error("%s: %d threads are stuck past their deadline; the pool runs short-handed "
                             "until one ends", self.name, self._abandoned)

    # ---- requests ----------------------------------------------------------------------------

    def submit(self, fn: Callable, *args: Any) -> _Task:
        with self._cond:
            if self._closed:
                raise PrepBusyError(f"the server is shutting down ({self.name})")
            if len(self._queue) >= self.max_queued:
                self.num_busy += 1
                raise PrepBusyError(f"{len(self._queue)} requests are already waiting for {self.what}; "
                                    "retry shortly")
            task = _Task(fn, args)
            self._queue.append(task)
            self._spawn_locked()
            self._cond.notify()
        return task

    def submit_future(self, fn: Callable, *args: Any) -> concurrent.futures.Future:
        """For synchronous callers (the engine core): the task's future, no deadline applied."""
        return self.submit(fn, *args).future

    def overdue(self, fut: concurrent.futures.Future, since: float, timeout_s: float | None = None) -> bool:
        """Whether work started by ``submit_future`` at ``since`` is past the deadline."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        return bool(timeout) and not fut.done() and time.monotonic() - since > timeout

    def deadline_error(self, timeout_s: float | None = None, param: str | None = None) -> PrepDeadlineError:
        timeout = self.timeout_s if timeout_s is None else timeout_s
        return PrepDeadlineError(f"{self.what} took longer than the limit of {timeout:g} s ({self.flag}); "
                                 "simplify the request or ask the operator to raise the limit", param,
                                 self.flag.lstrip("-").replace("-", "_"))

    async def run(self, fn: Callable, *args: Any, timeout_s: float | None = None,
                  param: str | None = None) -> Any:
        """Run ``fn(*args)`` on the pool; its result, or PrepBusyError / PrepDeadlineError."""
        timeout = self.timeout_s if timeout_s is None else (timeout_s or None)
        task = self.submit(fn, *args)
        waiter = asyncio.wrap_future(task.future)
        # A task given up on may still fail later: retrieve that, so nothing logs it as lost.
        waiter.add_done_callback(lambda f: f.cancelled() or f.exception())
        if timeout is None:
            return await waiter
        queued_until = time.monotonic() + timeout
        try:
            while True:
                now = time.monotonic()
                limit = queued_until if task.started is None else task.started + timeout
                if now >= limit:
                    if task.started is None and task.future.cancel():
                        self.num_busy += 1
                        raise PrepBusyError(f"no thread was free for {self.what} within {timeout:g} s "
                                            f"(the server is busy with other requests); retry shortly")
                    if task.started is not None:
                        self.num_timeouts += 1
                        self.abandon(task)
                        raise self.deadline_error(timeout, param)
                    continue  # it started just now
                done, _ = await asyncio.wait({waiter}, timeout=limit - now)
                if done:
                    return waiter.result()
        except asyncio.CancelledError:
            task.future.cancel()  # still queued: never runs; running: runs to its end unobserved
            raise

    @property
    def num_abandoned(self) -> int:
        return self._abandoned

    def shutdown(self) -> None:
        with self._cond:
            self._closed = True
            for task in self._queue:
                task.future.cancel()
            self._queue.clear()
            self._cond.notify_all()
