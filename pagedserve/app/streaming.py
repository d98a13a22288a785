"""Server-sent events: OpenAI framing (``data: <json>\\n\\n`` … ``data: [DONE]\\n\\n``) through
sse-starlette, and the merge of several engine streams (n > 1, several prompts) into one.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import anyio
import orjson
from sse_starlette.sse import EventSourceResponse
from starlette.background import BackgroundTask

from pagedserve.app.errors import to_api_error

logger = logging.getLogger(__name__)

DONE = b"data: [DONE]\n\n"
DEFAULT_SSE_PING_INTERVAL = 0.0  # --sse-ping-interval's default (app/server_config.py): none
# No SSE comment pings unless asked (--sse-ping-interval): OpenAI and vLLM send none, and
# `vllm bench serve` strips each network read, so after a `: ping` comment it never sees the
# blank line that ends an event and loses every later one. "Off" is an interval no stream
# reaches (ping=0 busy-loops in some sse-starlette versions).
NO_PING_S = 365 * 24 * 3600.0


def sse_event(payload: Any) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


async def close_quietly(it: Any) -> None:
    """Close an engine stream (aborting its request if unfinished), even inside a cancelled scope."""
    aclose = getattr(it, "aclose", None)  # optional: an AsyncIterator need not be closable
    if aclose is None:
        return
    with anyio.CancelScope(shield=True):
        try:
            await aclose()
        except Exception:  # closing must never mask the real outcome
            logger.warning("closing an engine stream failed", exc_info=True)


_END = object()


async def merge_async_iterators(iterators: Sequence[AsyncIterator]) -> AsyncIterator[tuple[int, Any]]:
    """Yield ``(i, item)`` from several async iterators as items arrive.

    On any exit (exhausted, error, cancellation, consumer closing us), every iterator is closed,
    which aborts the engine requests that have not finished.
    """
    if len(iterators) == 1:
        it = iterators[0]
        try:
            async for item in it:
                yield 0, item
        finally:
            await close_quietly(it)
        return

    # Bounded: a pump waits while the consumer (the client) lags, so it stops pulling and the
    # engine merges that request's deltas (OutputCollector) instead of this queue growing.
    queue: asyncio.Queue = asyncio.Queue(maxsize=len(iterators))

    async def pump(i: int, it: AsyncIterator) -> None:
        try:
            async for item in it:
                await queue.put((i, item, None))
            await queue.put((i, _END, None))
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            await queue.put((i, None, e))

    tasks = [asyncio.ensure_future(pump(i, it)) for i, it in enumerate(iterators)]
    try:
        remaining = len(iterators)
        while remaining:
            i, item, error = await queue.get()
            if error is not None:
                raise error
            if item is _END:
                remaining -= 1
                continue
            yield i, item
    finally:
        with anyio.CancelScope(shield=True):
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        for it in iterators:
            await close_quietly(it)


def typed_sse_event(payload: dict[str, Any]) -> bytes:
    """An event of the Responses API: named by its ``type`` (``event: response.created``)."""
    return b"event: " + payload["type"].encode() + b"\n" + sse_event(payload)


async def sse_body(events: AsyncIterator[Any], frame: Callable[[Any], bytes] = sse_event,
                   done: bytes | None = DONE) -> AsyncIterator[bytes]:
    """Frame chunk dicts as SSE. The body always ends with ``done`` (``[DONE]``): after the last
    chunk, or after one error event if the stream fails midway (as vLLM does; its clients read until
    ``[DONE]``). The Responses API ends with its last event instead (``done`` None)."""
    try:
        async for payload in events:
            yield frame(payload)
    except Exception as e:  # noqa: BLE001 - reported to the client in the stream
        err = to_api_error(e)
        yield sse_event(err.body())
    finally:
        aclose = getattr(events, "aclose", None)  # optional: an AsyncIterator need not be closable
        if aclose is not None:
            with anyio.CancelScope(shield=True):
                await aclose()
    if done is not None:
        yield done


async def close_all(streams: Sequence[Any], on_close: Callable[[], None] | None = None) -> None:
    for it in streams:
        await close_quietly(it)
    if on_close is not None:
        on_close()


def sse_response(events: AsyncIterator[Any], streams: Sequence[Any] = (),
                 on_close: Callable[[], None] | None = None,
                 ping_interval: float = DEFAULT_SSE_PING_INTERVAL, frame: Callable[[Any], bytes] = sse_event,
                 done: bytes | None = DONE) -> EventSourceResponse:
    """The engine streams are closed again once the response ends: a client gone before the
    body started would otherwise leave its requests running unobserved. ``on_close`` then runs
    (the routes count what was left unfinished as aborted). ``ping_interval`` > 0 sends a
    comment every that many seconds (for proxies that cut idle connections); 0 = none.
    ``frame`` and ``done``: as ``sse_body``."""
    return EventSourceResponse(sse_body(events, frame, done), sep="\n",
                               ping=ping_interval if ping_interval > 0 else NO_PING_S,
                               background=BackgroundTask(close_all, list(streams), on_close))
