"""uvicorn's httptools protocol with a request-head timeout (slowloris defence).

uvicorn arms no timer on a new connection, and the keep-alive timer is cancelled by the first
byte of the next request, so a client that opens connections and never finishes a request line
and headers holds each one (a file descriptor and a protocol object) for ever; enough of them
exhaust the process's descriptors and nobody else can connect. This subclass gives every request
head ``header_timeout`` seconds, counted from the connection (or from the first byte of the next
request on a kept-alive connection) to the end of the headers, like nginx's
client_header_timeout. A late client gets 408 and the connection is closed. Bodies are not
covered: a started request is the app's business (its body read and --max-body-bytes).
"""
from __future__ import annotations

import asyncio
import logging

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

logger = logging.getLogger(__name__)

RESPONSE_408 = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
                b"content-length: 39\r\nconnection: close\r\n\r\n"
                b"The request head did not arrive in time")


class HeaderTimeoutProtocol(HttpToolsProtocol):
    """Bind ``header_timeout`` with :func:`with_header_timeout`; uvicorn builds one per connection."""

    header_timeout: float = 30.0

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_bytes = False  # some of the current request head has arrived

    def _arm_head_timer(self) -> None:
        self._disarm_head_timer()
        self._head_timer = self.loop.call_later(self.header_timeout, self._head_timed_out)

    def _disarm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing():
            return
        logger.info("closing a connection from %s: no complete request head in %.0f s",
                    self.client, self.header_timeout)
        if self._head_bytes:
            self.transport.write(RESPONSE_408)
        self.transport.close()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_timer()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_bytes = True
        if self._head_timer is None:  # the next request on a kept-alive connection
            self._arm_head_timer()

    def on_headers_complete(self) -> None:
        self._disarm_head_timer()
        self._head_bytes = False
        super().on_headers_complete()


def with_header_timeout(seconds: float) -> type[HeaderTimeoutProtocol]:
    """A protocol class for ``uvicorn.Config(http=...)`` with this timeout (a subclass, so two
    servers in one process can differ)."""
    if seconds <= 0:
        raise ValueError(f"--header-timeout must be > 0 seconds, got {seconds}")
    return type("HeaderTimeoutProtocol", (HeaderTimeoutProtocol,), {"header_timeout": float(seconds)})
