"""Drive one request through an ASGI app by hand, seeing each message the app sends as it sends
it (httpx's ASGITransport only hands over the finished body), and read SSE bodies the way
vLLM's benchmark client does."""
from __future__ import annotations

import asyncio
import json
from typing import Any

import orjson


class AsgiRun:
    """One request in flight: ``messages`` grows as the app calls ``send``."""

    def __init__(self, app: Any, method: str, path: str, body: Any = None,
                 headers: dict[str, str] | None = None) -> None:
        raw = orjson.dumps(body) if body is not None else b""
        hdrs = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
        hdrs += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
        self.scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
                      "method": method, "scheme": "http", "path": path, "raw_path": path.encode(),
                      "query_string": b"", "root_path": "", "headers": hdrs,
                      "client": ("127.0.0.1", 1234), "server": ("127.0.0.1", 80)}
        self.messages: list[dict] = []
        self._body_sent = False
        self._raw = raw
        self._disconnect = asyncio.Event()
        self.task = asyncio.ensure_future(app(self.scope, self._receive, self._send))

    async def _receive(self) -> dict:
        if not self._body_sent:
            self._body_sent = True
            return {"type": "http.request", "body": self._raw, "more_body": False}
        await self._disconnect.wait()
        return {"type": "http.disconnect"}

    async def _send(self, message: dict) -> None:
        self.messages.append(message)
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            self._disconnect.set()

    async def finish(self) -> None:
        await asyncio.wait_for(self.task, 30)

    @property
    def status(self) -> int:
        return self.messages[0]["status"]

    @property
    def headers(self) -> dict[str, str]:
        return {k.decode().lower(): v.decode() for k, v in self.messages[0]["headers"]}

    @property
    def chunks(self) -> list[bytes]:
        """The body as the app wrote it: one entry per send, like one network read each."""
        return [m["body"] for m in self.messages if m["type"] == "http.response.body" and m.get("body")]


def read_like_vllm_bench(chunks: list[bytes]) -> list[str]:
    """The SSE messages a client sees that strips each network read before buffering it and
    splits on blank lines, taking a lone ``data:`` line as complete once it parses (how
    ``vllm bench serve`` reads streams). A comment event leaves its text in the buffer without
    its blank line, and every later event is then lost."""
    buffer = ""
    out: list[str] = []
    for raw in chunks:
        piece = raw.strip()
        if not piece:
            continue
        buffer += piece.decode("utf-8")
        while "\n\n" in buffer:
            message, buffer = buffer.split("\n\n", 1)
            if message.strip():
                out.append(message.strip())
        if buffer.startswith("data: "):
            content = buffer[len("data: "):].strip()
            try:
                if content != "[DONE]":
                    json.loads(content)
            except json.JSONDecodeError:
                continue
            out.append(buffer.strip())
            buffer = ""
    return [m[len("data: "):] for m in out if not m.startswith(":")]


async def until(predicate, spins: int = 1000) -> None:
    """Let the loop run until ``predicate()`` holds (no wall-clock waiting)."""
    for _ in range(spins):
        if predicate():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition never held")
