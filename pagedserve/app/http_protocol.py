"""uvicorn's httptools protocol with request-head and request-body timeouts (slowloris defence).

uvicorn arms no timer on a new connection, and the keep-alive timer is cancelled by the first
byte of the next request, so a client that opens connections and never finishes a request line
and headers holds each one (a file descriptor and a protocol object) for ever; enough of them
exhaust the process's descriptors and nobody else can connect. This subclass gives every request
head ``header_timeout`` seconds, counted from the connection (or from the first byte of the next
request on a kept-alive connection) to the end of the headers, like nginx's
client_header_timeout. The body then gets ``body_timeout`` seconds from the end of the headers
(a client that stalls mid-body would otherwise hold its connection and a handler task for ever).
A late client gets 408 (unless a response has started) and the connection is closed; the app
sees a client that left.
"""
from __future__ import annotations

import asyncio
import logging

import orjson
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

logger = logging.getLogger(__name__)

def _response_408(what: str, seconds: float) -> bytes:
    """OpenAI's error body, as every other status (and as /openapi.json documents it)."""
    flag = "--header-timeout" if what == "head" else "--body-timeout"
    body = orjson.dumps({"error": {
        "message": f"The request {what} did not arrive within {seconds:g} s ({flag}); the "
                   "connection is closed.",
        "type": "invalid_request_error", "param": None, "code": "request_timeout"}})
    return (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body))


class ReadTimeoutProtocol(HttpToolsProtocol):
    """Timeouts bound by :func:`with_read_timeouts`; uvicorn builds one per connection."""

    header_timeout: float = 30.0
    body_timeout: float = 60.0

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._read_timer: asyncio.TimerHandle | None = None
        self._reading: str | None = "head"  # the part of the request being waited for
        self._head_begun = False  # some bytes of the current request head have arrived

    def _arm(self, part: str) -> None:
        self._disarm()
        self._reading = part
        delay = self.header_timeout if part == "head" else self.body_timeout
        self._read_timer = self.loop.call_later(delay, self._timed_out, part, delay)

    def _disarm(self) -> None:
        self._reading = None
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _held_by_server(self, part: str) -> bool:
        """The server, not the client, holds this request up: reading is paused (flow control,
        or a pipelined request queued behind a response in progress), or an earlier response on
        the connection is still being sent, which a 408 or a close would cut."""
        if self.flow is not None and self.flow.read_paused:
            return True
        cycle = self.cycle  # for a head: the previous request's; for a body: this request's
        if cycle is None:
            return False
        if part == "head":
            return not cycle.response_complete
        return any(queued is cycle for queued, _ in self.pipeline)

    def _timed_out(self, part: str, delay: float) -> None:
        self._read_timer = None
        if self.transport.is_closing():
            return
        if self._held_by_server(part):
            self._arm(part)  # the clock starts again; the request is timed once it is its turn
            return
        logger.info("closing a connection from %s: no complete request %s in %.0f s",
                    self.client, part, delay)
        if part == "head":  # answer only a client that sent something, after any earlier response
            answer = self._head_begun and (self.cycle is None or self.cycle.response_complete)
        else:
            answer = self.cycle is not None and not self.cycle.response_started
        if answer:
            self.transport.write(_response_408(part, delay))
        self.transport.close()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm("head")

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_begun = True
        if self._reading is None:  # the next request on a kept-alive connection
            self._arm("head")

    def on_headers_complete(self) -> None:
        self._head_begun = False
        super().on_headers_complete()
        self._arm("body")  # on_message_complete disarms it, at once when there is no body

    def on_message_complete(self) -> None:
        self._disarm()
        super().on_message_complete()


def with_read_timeouts(header_timeout: float, body_timeout: float) -> type[ReadTimeoutProtocol]:
    """A protocol class for ``uvicorn.Config(http=...)`` with these timeouts (a subclass, so two
    servers in one process can differ)."""
    for flag, seconds in (("--header-timeout", header_timeout), ("--body-timeout", body_timeout)):
        if seconds <= 0:
            raise ValueError(f"{flag} must be > 0 seconds, got {seconds}")
    return type("ReadTimeoutProtocol", (ReadTimeoutProtocol,),
                {"header_timeout": float(header_timeout), "body_timeout": float(body_timeout)})
