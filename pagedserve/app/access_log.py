"""The access log: one INFO line per HTTP request on the ``pagedserve.access`` logger (method, path,
status, duration, request id, client), written when the response has been sent in full (a stream
when it ends), through the process's formatter (--log-format). On by default, as uvicorn's; off
with --disable-access-log (vLLM's --disable-uvicorn-access-log). The path is logged without its
query string, and never a header or a body: no API key or prompt reaches the log."""
from __future__ import annotations

import logging
import time
from typing import Any

logger = logging.getLogger("pagedserve.access")


class AccessLogMiddleware:
    """Outside RequestIdMiddleware: it reads the id that one put in the request's state."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        status: list[int] = []

        async def send_and_watch(message: dict) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_and_watch)
        except BaseException:
            if not status:
                status.append(500)  # what Starlette's error middleware outside this one answers
            raise
        finally:
            _log(scope, status[0] if status else None, (time.perf_counter() - t0) * 1000.0)


def _log(scope: dict, status: int | None, duration_ms: float) -> None:
    if not logger.isEnabledFor(logging.INFO):
        return
    client = scope.get("client")
    who = f"{client[0]}:{client[1]}" if client else "-"
    rid = scope.get("state", {}).get("request_id")
    method, path = scope.get("method", "-"), scope.get("path", "-")
    logger.info('%s "%s %s" %s %.1f ms request_id=%s', who, method, path, status if status is not None else "-",
                duration_ms, rid or "-",
                extra={"method": method, "path": path, "status": status, "duration_ms": round(duration_ms, 3),
                       "client": who, "request_id": rid})
