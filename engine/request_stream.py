"""The async iterator a caller of AsyncEngine.generate reads one request's deltas from."""
from __future__ import annotations

from typing import TYPE_CHECKING

from engine.output_collector import OutputCollector
from engine.outputs import RequestOutput

if TYPE_CHECKING:
    from engine.async_engine import AsyncEngine


class RequestStream:
    """Async iterator of one request's RequestOutput deltas; closing it early aborts the request.

    A consumer that lags gets the deltas produced meanwhile merged into one (OutputCollector):
    memory per request stays bounded however slowly the client reads."""

    def __init__(self, engine: "AsyncEngine", request_id: str, queue: OutputCollector):
        self._engine = engine
        self.request_id = request_id
        self._queue = queue
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
            self._finish()
            raise item
        if item.finished:
            self._finish()
        return item

    def _finish(self) -> None:
        self._done = True
        self._engine._queues.pop(self.request_id, None)

    async def aclose(self) -> None:
        """Stop listening; aborts the request if it has not finished (client went away)."""
        if not self._done:
            self._finish()
            self._engine._abort_now(self.request_id)

    def __del__(self):
        if not self._done and self._engine._queues.get(self.request_id) is self._queue:
            # Dropped without being closed: make sure the request does not run on unseen, and
            # that its queue goes too (the engine loop does both; nothing may await here).
            self._engine._pending_aborts.append((self.request_id, self._queue))
