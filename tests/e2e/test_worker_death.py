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

from pagedserve.gpu.transport import pick_transport
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


def workers_of(pid: int) -> list[int]:
    """The server's worker processes, rank order (= start order = pid order)."""
    return sorted(p for p in children(pid) if "spawn_main" in cmdline(p) and not gone(p))


def start(tp: int, *extra: str) -> tuple[ServerProcess, list[int], list[int], set[str]]:
    """The server, its children, its workers (rank order = start order = pid order), its rings."""
    s = ServerProcess("--executor", "mp", "--tensor-parallel-size", str(tp), *extra)
    kids = children(s.proc.pid)
    workers = workers_of(s.proc.pid)
    assert len(workers) == tp, [cmdline(p) for p in kids]
    segments = mapped_segments(s.proc.pid)
    if pick_transport() == "shm":  # the server's choice too (same CPU, same environment)
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
        r = httpx.get(s.url + "/health", timeout=2)
        assert r.status_code == 503 and r.json()["status"] == "dead", r.text
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


@pytest.mark.slow
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
        # Within 100 ms; a loaded 2-core box may delay a rare probe a little (scheduling, not
        # the loop), so up to 2% may reach 300 ms. A loop that waits for the reap takes seconds.
        latencies = sorted(dt for _, _, dt in prober.samples)
        over = [round(dt, 3) for dt in latencies if dt > 0.1]
        assert latencies[-1] < 0.3 and len(over) <= 0.02 * len(latencies), (
            f"{len(over)} of {len(latencies)} probes over 100 ms: {over[-10:]}")
        print(f"{len(latencies)} probes while reaping for {reaped_after:.1f} s, slowest "
              f"{latencies[-1] * 1000:.1f} ms, median {latencies[len(latencies) // 2] * 1000:.1f} ms")
        assert_sigterm_exits_clean(s, kids, segments)
    finally:
        try:
            os.kill(stopped, signal.SIGKILL)
        except ProcessLookupError:
            pass
        s.stop()


STREAM_BODY = {"model": "tiny", "prompt": "Go", "max_tokens": 1900, "ignore_eos": True, "stream": True,
               "temperature": 0}


def stream_until_signal(s: ServerProcess, victim: int, sig: int = signal.SIGKILL) -> tuple[dict, list[str]]:
    """Stream a long completion, send ``sig`` to ``victim`` after 3 events, read to the end."""
    events: list[str] = []
    outcome: dict = {}
    with httpx.stream("POST", s.url + "/v1/completions", json=STREAM_BODY,
                      timeout=httpx.Timeout(10.0, read=30.0)) as r:
        outcome["status"] = r.status_code
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
            if len(events) == 3 and "sent_at" not in outcome:
                os.kill(victim, sig)
                outcome["sent_at"] = time.monotonic()
    outcome["end_at"] = time.monotonic()
    return outcome, events


def assert_error_then_done(events: list[str], *needles: str) -> None:
    assert events[-1] == "[DONE]", events[-3:]
    error = json.loads(events[-2])["error"]
    assert error["code"] == "engine_dead", error
    for needle in needles:
        assert needle in error["message"], error


def health(s: ServerProcess) -> tuple[int, dict, dict]:
    r = httpx.get(s.url + "/health", timeout=2)
    return r.status_code, r.json(), dict(r.headers)


def metric(s: ServerProcess, name: str) -> float | None:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(s.url + "/metrics", timeout=5).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    return None


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_restart_workers_after_kill9_twice(tp):
    """--restart-workers: each kill -9 fails the in-flight stream clearly, /health goes
    restarting (503 + Retry-After, new requests too) -> ok, and the new pool serves; after two
    rounds SIGTERM exits 0 and every ring segment the server ever mapped is gone."""
    s, kids, workers, segments = start(tp, "--restart-workers")
    all_kids, all_segments = set(kids), set(segments)
    try:
        for round_no in (1, 2):
            victim = workers[-1]
            outcome, events = stream_until_signal(s, victim)
            assert outcome["status"] == 200
            assert outcome["end_at"] - outcome["sent_at"] < 5, "the stream hung after the kill"
            assert_error_then_done(events, "killed by SIGKILL", "restarting")
            states: list[str] = []
            refused = None
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                code, body, headers = health(s)
                if not states or states[-1] != body["status"]:
                    states.append(body["status"])
                assert (code == 200) == (body["status"] == "ok"), (code, body)
                if body["status"] == "restarting":
                    assert headers.get("retry-after"), headers
                    if refused is None:
                        r = httpx.post(s.url + "/v1/completions", timeout=5,
                                       json={"model": "tiny", "prompt": "Hi", "max_tokens": 2})
                        refused = (r.status_code, r.headers.get("retry-after"), r.json()["error"])
                if body["status"] == "ok" and "restarting" in states:
                    break
                assert body["status"] != "dead", (body, s.output()[-3000:])
                time.sleep(0.05)
            assert states[-2:] == ["restarting", "ok"], (states, s.output()[-3000:])
            assert refused is not None and refused[0] == 503 and refused[1], refused
            assert "restarting" in refused[2]["message"], refused
            new_workers = workers_of(s.proc.pid)
            assert len(new_workers) == tp and not set(new_workers) & set(workers), (workers, new_workers)
            assert all(gone(p) for p in workers), "the old pool was not reaped"
            workers = new_workers
            all_kids |= set(children(s.proc.pid))
            all_segments |= mapped_segments(s.proc.pid)
            r = httpx.post(s.url + "/v1/completions", timeout=30,
                           json={"model": "tiny", "prompt": "Hi", "max_tokens": 5, "ignore_eos": True})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5, r.text
            assert metric(s, "pagedserve:worker_restarts_total") == round_no
            # the new core starts empty: nothing running, no KV block held
            assert metric(s, "pagedserve:num_requests_running") == 0
            assert metric(s, "pagedserve:kv_cache_usage_perc") == 0
        assert s.output().count("worker pool restarted") == 2
        assert_sigterm_exits_clean(s, sorted(all_kids), all_segments)
    finally:
        s.stop()


def test_hung_worker_is_declared_dead_after_the_step_timeout():
    """A worker stopped mid-stream (alive, never answering): after --step-timeout the stream gets
    an error naming the timeout, /health 503, new requests 503, and the stuck worker is reaped."""
    s, kids, workers, segments = start(1, "--step-timeout", "2")
    try:
        outcome, events = stream_until_signal(s, workers[0], signal.SIGSTOP)
        assert outcome["status"] == 200
        assert 1.5 < outcome["end_at"] - outcome["sent_at"] < 10
        assert_error_then_done(events, "no reply to step", "--step-timeout")
        assert health(s)[0] == 503
        r = httpx.post(s.url + "/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 2},
                       timeout=5)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead", r.text
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not gone(workers[0]):
            time.sleep(0.05)
        assert gone(workers[0]), "the hung worker was not reaped"
        assert_sigterm_exits_clean(s, kids, segments)
    finally:
        try:
            os.kill(workers[0], signal.SIGKILL)
        except ProcessLookupError:
            pass
        s.stop()
