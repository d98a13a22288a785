"""The async iterator a caller of AsyncEngine.generate reads one request's deltas from."""
from __future__ import annotations

import enum
from collections.abc import Callable

from pagedserve.engine.output_collector import OutputCollector
from pagedserve.engine.outputs import RequestOutput


class StreamEnd(enum.Enum):
    """How a stream ended, as its ``on_close`` callback is told."""

    FINISHED = "finished"  # read to its end (the final output, or an error): forget its queue
    CLOSED = "closed"  # closed by its reader before the end: abort the request now
    DROPPED = "dropped"  # garbage-collected unclosed: abort at the loop's next turn (nothing may await)


OnClose = Callable[[str, OutputCollector, StreamEnd], None]


class RequestStream:
    """Async iterator of one request's RequestOutput deltas; closing it early aborts the request.

    A consumer that lags gets the deltas produced meanwhile merged into one (OutputCollector):
    memory per request stays bounded however slowly the client reads. The engine learns how
    the stream ended through ``on_close(request_id, queue, how)``, called once."""

    def __init__(self, request_id: str, queue: OutputCollector, on_close: OnClose):
        self.request_id = request_id
        self._queue = queue
        self._on_close = on_close
        self._done = False

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        try:
            item = await self._queue.get()
        except BaseException:
            await self.aclose()
            raise
        if isinstance(item, BaseException):
            self._end(StreamEnd.FINISHED)
            raise item
        if item.finished:
            self._end(StreamEnd.FINISHED)
        return item

    def _end(self, how: StreamEnd) -> None:
        self._done = True
        self._on_close(self.request_id, self._queue, how)

    async def aclose(self) -> None:
        """Stop listening; aborts the request if it has not finished (client went away)."""
        if not self._done:
            self._end(StreamEnd.CLOSED)

    def __del__(self):
        if not self._done:
            # Dropped without being closed: make sure the request does not run on unseen, and
            # that its queue goes too (the engine loop does both; nothing may await here).
            self._end(StreamEnd.DROPPED)
