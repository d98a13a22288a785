"""kill -9 of the worker under a real `pagedserve serve --executor mp` while a completion streams:
the client gets an error (not a hang), /health turns 503 within 5 s and new requests get 503,
the server keeps answering and then exits 0 on SIGTERM, leaving no shared-memory segment and no
child process behind."""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from tests.e2e.test_server_e2e import ServerProcess


def children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return out
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(c) for c in f.read().split()]
        except FileNotFoundError:
            pass
    return out


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except FileNotFoundError:
        return ""


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def mapped_segments(pid: int) -> set[str]:
    """The server's ring segments, read from its memory maps (other tests may own others)."""
    with open(f"/proc/{pid}/maps") as f:
        return {line.split()[-1] for line in f if "/dev/shm/pagedserve-" in line}


def start(tp: int) -> tuple[ServerProcess, list[int], list[int], set[str]]:
    """The server, its children, its workers (rank order = start order = pid order), its rings."""
    s = ServerProcess("--executor", "mp", "--tensor-parallel-size", str(tp))
    kids = children(s.proc.pid)
    workers = sorted(p for p in kids if "spawn_main" in cmdline(p))
    assert len(workers) == tp, [cmdline(p) for p in kids]
    segments = mapped_segments(s.proc.pid)
    assert len(segments) == 2 and all(os.path.exists(n) for n in segments)
    assert f"{tp} worker process(es) ready" in s.output()
    return s, kids, workers, segments


def assert_dead_but_answering(s: ServerProcess) -> None:
    """New requests are refused with 503 and a reason; the server keeps answering."""
    r = httpx.post(s.url + "/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 2},
                   timeout=5)
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead", r.text
    assert "killed by SIGKILL" in r.json()["error"]["message"]
    for _ in range(3):
        assert httpx.get(s.url + "/health", timeout=2).status_code == 503
        assert httpx.get(s.url + "/v1/models", timeout=2).status_code == 200


def wait_health_503(s: ServerProcess, since: float, within: float = 5.0) -> None:
    health = None
    while time.monotonic() - since < within:
        health = httpx.get(s.url + "/health", timeout=2).status_code
        if health == 503:
            return
        time.sleep(0.1)
    raise AssertionError(f"/health still {health} {within} s after the kill:\n{s.output()}")


def assert_sigterm_exits_clean(s: ServerProcess, kids: list[int], segments: set[str]) -> None:
    t0 = time.monotonic()
    s.proc.send_signal(signal.SIGTERM)
    assert s.proc.wait(10) == 0, s.output()
    assert time.monotonic() - t0 < 5
    assert "shutdown complete" in s.output()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not all(gone(p) for p in kids):
        time.sleep(0.05)
    assert all(gone(p) for p in kids), [(p, cmdline(p)) for p in kids if not gone(p)]
    assert not [n for n in segments if os.path.exists(n)]


@pytest.mark.parametrize("tp", [1, 2])
def test_kill9_worker_during_a_stream(tp):
    """With tp=2 the last rank dies while rank 0 waits for it in a collective."""
    s, kids, workers, segments = start(tp)
    victim = workers[-1]
    try:
        body = {"model": "tiny", "prompt": "Go", "max_tokens": 1900, "ignore_eos": True, "stream": True,
                "temperature": 0}
        events: list[str] = []
        outcome: dict = {}
        killed = threading.Event()

        def stream() -> None:
            try:
                timeout = httpx.Timeout(10.0, read=10.0)
                with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=timeout) as r:
                    outcome["status"] = r.status_code
                    for line in r.iter_lines():
                        if line.startswith("data: "):
                            events.append(line[6:])
                        if len(events) == 3 and not killed.is_set():
                            os.kill(victim, signal.SIGKILL)
                            outcome["killed_at"] = time.monotonic()
                            killed.set()
                outcome["ended"] = "eof"
            except httpx.HTTPError as e:
                outcome["ended"] = f"{type(e).__name__}: {e}"
            outcome["end_at"] = time.monotonic()

        reader = threading.Thread(target=stream, daemon=True)
        reader.start()
        assert killed.wait(30), s.output()
        wait_health_503(s, outcome["killed_at"])
        reader.join(15)
        assert not reader.is_alive(), "the stream hung after the worker died"
        assert outcome["status"] == 200
        assert outcome["end_at"] - outcome["killed_at"] < 5
        # An SSE error event that says what happened, then [DONE] as vLLM (the stream may also
        # just break).
        if outcome["ended"] == "eof":
            assert events[-1] == "[DONE]", events[-3:]
            error = json.loads(events[-2])["error"]
            assert error["code"] == "engine_dead" and "killed by SIGKILL" in error["message"], error
        assert f"worker {tp - 1} (pid {victim}) was killed by SIGKILL" in s.output()
        assert_dead_but_answering(s)
        assert_sigterm_exits_clean(s, kids, segments)
    finally:
        s.stop()


def test_kill9_idle_worker_turns_health_503():
    """No request running: the engine loop's idle health check notices the death."""
    s, kids, workers, segments = start(1)
    try:
        r = httpx.post(s.url + "/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 3},
                       timeout=10)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        assert httpx.get(s.url + "/health", timeout=2).status_code == 200
        os.kill(workers[0], signal.SIGKILL)
        wait_health_503(s, time.monotonic())
        assert_dead_but_answering(s)
        assert_sigterm_exits_clean(s, kids, segments)
    finally:
        s.stop()


class Prober:
    """Hits /health and /metrics back to back from another connection and records latencies."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.samples: list[tuple[str, int, float]] = []  # (path, status, seconds)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=10) as client:
            while not self._stop.is_set():
                for path in ("/health", "/metrics"):
                    t0 = time.monotonic()
                    status = client.get(self.url + path).status_code
                    self.samples.append((path, status, time.monotonic() - t0))
                time.sleep(0.02)

    def __enter__(self) -> "Prober":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(15)


def test_event_loop_answers_while_workers_are_reaped():
    """tp 2, idle: worker 0 is stopped (SIGSTOP: SIGTERM stays pending, so reaping must wait and
    then kill it: seconds), worker 1 is killed. While the server reaps them, other connections
    get /health and /metrics within 100 ms: nothing on the event loop waits for a process."""
    s, kids, workers, segments = start(2)
    stopped, killed = workers
    try:
        with Prober(s.url) as prober:
            time.sleep(0.3)
            os.kill(stopped, signal.SIGSTOP)
            os.kill(killed, signal.SIGKILL)
            t_kill = time.monotonic()
            deadline = t_kill + 20
            while time.monotonic() < deadline and not gone(stopped):
                time.sleep(0.02)
            reaped_after = time.monotonic() - t_kill
            time.sleep(0.3)
        assert gone(stopped), "the stopped worker was never reaped"
        assert reaped_after > 1.0, f"reaping took only {reaped_after:.2f} s: the test proves nothing"
        statuses = [st for path, st, _ in prober.samples if path == "/health"]
        assert statuses[0] == 200 and statuses[-1] == 503, statuses
        slow = [(path, round(dt, 3)) for path, _, dt in prober.samples if dt > 0.1]
        assert not slow, f"{len(slow)} of {len(prober.samples)} probes over 100 ms: {slow[:10]}"
        assert_sigterm_exits_clean(s, kids, segments)
    finally:
        try:
            os.kill(stopped, signal.SIGKILL)
        except ProcessLookupError:
            pass
        s.stop()
