"""Reading an OpenAI-style SSE stream line by line; shared by bench.py and the locustfile so both
fail a request for the same reasons (malformed line or JSON, data after [DONE])."""
from __future__ import annotations

import json


class StreamError(Exception):
    """The stream broke the OpenAI SSE contract; the message says how."""


class SSEDecoder:
    """Feed it each line of one stream; it returns the JSON event of a data line (None for
    comments, blank lines, other SSE fields and [DONE]) and remembers whether [DONE] came."""

    def __init__(self) -> None:
        self.done = False

    def feed(self, line: str) -> dict | None:
        line = line.strip()
        if not line or line.startswith(":") or line.split(":", 1)[0] in ("event", "id", "retry"):
            return None
        if not line.startswith("data:"):
            raise StreamError(f"malformed SSE line: {line[:200]}")
        data = line[5:].strip()
        if self.done:
            raise StreamError("data after [DONE]")
        if data == "[DONE]":
            self.done = True
            return None
        try:
            event = json.loads(data)
        except json.JSONDecodeError:
            raise StreamError(f"malformed event (not JSON): {data[:200]}") from None
        if not isinstance(event, dict):
            raise StreamError(f"malformed event: {data[:200]}")
        return event

    def finish(self) -> None:
        if not self.done:
            raise StreamError("stream ended without [DONE]")
