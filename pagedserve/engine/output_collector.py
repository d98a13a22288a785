"""One request's pending output, merged while its consumer lags (as vLLM's RequestOutputCollector).

An unbounded queue of deltas grows by one entry per generated token for a client that stops
reading. Here a request holds at most one pending RequestOutput: a delta that arrives before the
previous one was taken is folded into it (text concatenated, token ids, logprobs and token
times extended, finish fields from the newer). An error is kept beside the pending data and
delivered after it, so a client still gets every token produced before the failure.
"""
from __future__ import annotations

import asyncio

from pagedserve.engine.outputs import RequestOutput, merge_delta


class OutputCollector:
    """The engine loop puts (never blocks); the request's stream gets (waits when empty)."""

    __slots__ = ("_output", "_error", "_ready", "num_merged")

    def __init__(self) -> None:
        self._output: RequestOutput | None = None
        self._error: BaseException | None = None
        self._ready = asyncio.Event()
        self.num_merged = 0  # deltas folded into a pending one (the consumer lagged)

    def put_nowait(self, item: RequestOutput | BaseException) -> None:
        """Same name as asyncio.Queue's, so the engine's fan-out code works with either."""
        if isinstance(item, BaseException):
            if self._error is None:  # the first failure is the cause; later ones are echoes
                self._error = item
        elif self._output is None:
            self._output = item
        else:
            merge_delta(self._output, item)
            self.num_merged += 1
        self._ready.set()

    def get_nowait(self) -> RequestOutput | BaseException | None:
        """The pending output, else the pending error, else None. Data always goes first."""
        if self._output is not None:
            out, self._output = self._output, None
            return out
        if self._error is not None:
            err, self._error = self._error, None
            return err
        return None

    async def get(self) -> RequestOutput | BaseException:
        while True:
            item = self.get_nowait()
            if item is not None:
                return item
            self._ready.clear()
            await self._ready.wait()

    def qsize(self) -> int:
        """Items waiting to be taken: at most 2 (one merged output and one error)."""
        return (self._output is not None) + (self._error is not None)
