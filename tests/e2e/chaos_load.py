"""Background HTTP load for chaos tests: clients in threads whose outcome (status, events, [DONE],
error) is recorded, so a test can break the server mid-load and then check that every client got
an answer or a clean error, and none hangs."""
from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field

import httpx


@dataclass
class ClientResult:
    stream: bool
    status: int | None = None
    events: int = 0
    done: bool = False  # a stream's [DONE] came
    finish: str | None = None
    error_event: dict | None = None  # an SSE {"error": ...} event
    body: dict | None = None  # a non-streamed answer
    transport_error: str = ""
    ended_at: float | None = None
    first_event: threading.Event = field(default_factory=threading.Event)

    @property
    def ended(self) -> bool:
        return self.ended_at is not None


def _stream(url: str, body: dict, r: ClientResult, timeout: httpx.Timeout) -> None:
    with httpx.stream("POST", url, json=body, timeout=timeout) as resp:
        r.status = resp.status_code
        if resp.status_code != 200:
            r.body = json.loads(resp.read() or b"null")
            return
        for line in resp.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                r.done = True
                continue
            event = json.loads(line[6:])
            if "error" in event:
                r.error_event = event["error"]
                continue
            r.events += 1
            r.first_event.set()
            for c in event.get("choices") or []:
                r.finish = c.get("finish_reason") or r.finish


def _full(url: str, body: dict, r: ClientResult, timeout: httpx.Timeout) -> None:
    r.first_event.set()  # nothing to wait for: the answer comes whole
    resp = httpx.post(url, json=body, timeout=timeout)
    r.status = resp.status_code
    r.body = resp.json()


class Load:
    """``streams`` streamed and ``full`` non-streamed requests, one thread each."""

    def __init__(self, base_url: str, body: dict, *, streams: int, full: int,
                 path: str = "/v1/completions", read_timeout: float = 30.0) -> None:
        self.results = [ClientResult(stream=True) for _ in range(streams)] + \
            [ClientResult(stream=False) for _ in range(full)]
        timeout = httpx.Timeout(10.0, read=read_timeout)
        self.threads = []
        for r in self.results:
            b = {**body, "stream": r.stream}
            target = _stream if r.stream else _full
            t = threading.Thread(target=self._run, args=(target, base_url + path, b, r, timeout),
                                 daemon=True)
            self.threads.append(t)
            t.start()

    @staticmethod
    def _run(target, url: str, body: dict, r: ClientResult, timeout: httpx.Timeout) -> None:
        try:
            target(url, body, r, timeout)
        except (httpx.HTTPError, ValueError) as e:
            r.transport_error = f"{type(e).__name__}: {e}"
        finally:
            r.ended_at = time.monotonic()

    def wait_streaming(self, timeout: float) -> bool:
        """Every stream has had a first token (so all are in flight)."""
        deadline = time.monotonic() + timeout
        return all(r.first_event.wait(max(0.0, deadline - time.monotonic())) for r in self.results)

    def join(self, timeout: float) -> list[ClientResult]:
        """The clients still running after ``timeout`` seconds (hung)."""
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return [r for r, t in zip(self.results, self.threads) if t.is_alive()]
