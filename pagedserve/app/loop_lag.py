"""The event loop's lag: how late a task that sleeps ``interval_s`` wakes up.

The HTTP routes, the SSE streams and the engine loop share one event loop, so anything
synchronous and long on it (a route handler, a step's output processing) stops every stream and
/health at once. This measures it from inside: ``pagedserve:event_loop_lag_seconds`` is the worst
lateness in the last ``window_s`` (a block still in progress counts: the scrape waited for it
too), ``pagedserve:event_loop_lag_max_seconds`` the worst since the server started.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import time

logger = logging.getLogger(__name__)

INTERVAL_S = 0.05
WINDOW_S = 10.0
WARN_S = 1.0  # a stall this long is logged


class LoopLagMonitor:
    def __init__(self, interval_s: float = INTERVAL_S, window_s: float = WINDOW_S) -> None:
        self.interval_s = interval_s
        self.window_s = window_s
        self.max_lag_s = 0.0  # since start
        self._recent: collections.deque[tuple[float, float]] = collections.deque()  # (time, lag)
        self._due: float | None = None  # when the sleeping tick should wake (monotonic)
        self._task: asyncio.Task | None = None

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def start(self) -> None:
        """Start on the running loop (no-op when already running)."""
        if not self.running:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="pagedserve-loop-lag")

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
        self._due = None

    async def _run(self) -> None:
        while True:
            self._due = time.monotonic() + self.interval_s
            await asyncio.sleep(self.interval_s)
            now = time.monotonic()
            self.record(now - self._due, now)

    def record(self, lag: float, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        lag = max(0.0, lag)
        if lag >= WARN_S:
            logger.warning("the event loop was blocked for %.2f s (every stream and /health waited)", lag)
        self.max_lag_s = max(self.max_lag_s, lag)
        recent = self._recent
        # Keep only values that can still be the window's maximum (a monotonic deque).
        while recent and recent[-1][1] <= lag:
            recent.pop()
        recent.append((now, lag))
        while recent and now - recent[0][0] > self.window_s:
            recent.popleft()

    def current(self) -> float:
        """The worst lag in the last window, including how overdue the pending wake-up is now."""
        now = time.monotonic()
        while self._recent and now - self._recent[0][0] > self.window_s:
            self._recent.popleft()
        worst = self._recent[0][1] if self._recent else 0.0
        if self._due is not None and self.running:
            worst = max(worst, now - self._due)
        return max(0.0, worst)

    def max_since_start(self) -> float:
        pending = time.monotonic() - self._due if self._due is not None and self.running else 0.0
        return max(self.max_lag_s, pending)
