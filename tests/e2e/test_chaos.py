"""Chaos against a real `pagedserve serve` (tiny random weights): a worker killed under load
(tp 1 and 3), SIGTERM under load, 200 half-open slow-header connections, disconnect storms and
overload past --max-waiting-requests. Nothing may hang, every client gets an answer or a clean
error, and the server exits 0 leaving no child process and none of its shared-memory segments.

Checks on processes and /dev/shm are scoped to this test's own server (its pid tree and the
segments it mapped): other tests run servers on the same machine at the same time."""
from __future__ import annotations

import asyncio
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time

import httpx
import pytest

from pagedserve.gpu.transport import pick_transport
from pagedserve.loadtest import proctree
from pagedserve.loadtest.local_server import LocalServer, tiny_args
from pagedserve.loadtest.soak import wait_idle
from pagedserve.loadtest.tiny_model import TINY_CONFIG
from tests.e2e.chaos_load import Load

MODEL = "tiny"
# heads, kv heads and the MLP split three ways
TP3_CONFIG = {**TINY_CONFIG, "hidden_size": 96, "intermediate_size": 192,
              "num_attention_heads": 6, "num_key_value_heads": 3}
LONG = {"model": MODEL, "prompt": "Go", "max_tokens": 1900, "ignore_eos": True, "temperature": 0}


def serve(*extra: str, config: dict | None = None) -> LocalServer:
    return LocalServer([*tiny_args(config=config), "--served-model-name", MODEL, *extra])


def workers(s: LocalServer) -> list[int]:
    return sorted(p for p in proctree.tree(s.pid)[1:] if "spawn_main" in proctree.cmdline(p))


def restart_workers_supported() -> bool:
    out = subprocess.run([sys.executable, "-m", "pagedserve.app.cli", "serve", "--help"], capture_output=True,
                         text=True, timeout=60).stdout
    return "--restart-workers" in out


def assert_stops_clean(s: LocalServer, kids: list[int], within: float = 15.0) -> None:
    """SIGTERM: exit 0 in time, no child left, none of the server's segments left."""
    t0 = time.monotonic()
    code = s.stop(timeout=within + 15)
    assert code == 0, s.output()[-3000:]
    assert time.monotonic() - t0 < within, f"SIGTERM took {time.monotonic() - t0:.1f} s"
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not all(proctree.gone(p) for p in kids):
        time.sleep(0.05)
    assert all(proctree.gone(p) for p in kids), [(p, proctree.cmdline(p)) for p in kids
                                                 if not proctree.gone(p)]
    assert s.leftover_segments() == [], s.output()[-3000:]


def poll_status(url: str, want: int, within: float) -> int | None:
    deadline, status = time.monotonic() + within, None
    while time.monotonic() < deadline:
        try:
            status = httpx.get(url, timeout=2).status_code
        except httpx.HTTPError as e:
            status = None
            last = e  # noqa: F841 - the loop retries
        if status == want:
            return status
        time.sleep(0.1)
    return status


@pytest.fixture(scope="module")
def shared_server():
    """One default server (mp executor) for the tests that leave it healthy (saves a start);
    it must still exit 0 and clean up afterwards."""
    s = serve("--header-timeout", "8", "--body-timeout", "5")
    try:
        yield s
        assert_stops_clean(s, proctree.tree(s.pid)[1:])
    finally:
        s.stop()


# --------------------------------------------------------------------------- kill -9 under load


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 3])
def test_kill9_worker_under_load(tp):
    """Streams and non-streamed requests in flight when the last rank is killed: each client gets
    an error within seconds (an SSE error event, a 503 or a closed connection), never a hang;
    /health turns 503, new requests get 503, SIGTERM exits 0 and cleans up."""
    s = serve("--executor", "mp", "--tensor-parallel-size", str(tp), "--shutdown-timeout", "20",
              config=TP3_CONFIG if tp == 3 else None)
    try:
        kids = proctree.tree(s.pid)[1:]
        ranks = workers(s)
        assert len(ranks) == tp, ranks
        if pick_transport() == "shm":  # the server's choice too (same CPU, same environment)
            assert len(s.segments) == 2 and all(os.path.exists(n) for n in s.segments), s.segments
        load = Load(s.url, LONG, streams=6, full=3, read_timeout=30)
        assert load.wait_streaming(60), s.output()[-3000:]
        time.sleep(0.3)
        os.kill(ranks[-1], signal.SIGKILL)
        killed_at = time.monotonic()
        assert poll_status(s.url + "/health", 503, 5) == 503, s.output()[-3000:]
        hung = load.join(20)
        assert not hung, f"{len(hung)} client(s) hung after the worker died: {hung}"
        for r in load.results:
            assert r.ended_at - killed_at < 10, r
            assert not r.transport_error, r
            if r.stream:
                # an SSE error event that says why, then [DONE]; never a normal finish
                assert r.status == 200 and r.finish is None, r
                assert r.error_event and r.error_event["code"] == "engine_dead" and r.done, r
            else:
                assert r.status == 503 and r.body["error"]["code"] == "engine_dead", r
        r = httpx.post(s.url + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2},
                       timeout=5)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead", r.text
        assert httpx.get(s.url + "/v1/models", timeout=2).status_code == 200
        assert_stops_clean(s, kids)
    finally:
        s.stop()


@pytest.mark.slow
def test_kill9_twice_with_restart_workers():
    """--restart-workers: after each kill -9 the pool is rebuilt and requests are served again
    within seconds, /health back to 200; in-flight requests fail cleanly."""
    if not restart_workers_supported():
        pytest.skip("`serve --restart-workers` is not on main yet (issue 10, H2)")
    s = serve("--executor", "mp", "--restart-workers", "--shutdown-timeout", "20")
    try:
        for round_ in range(2):
            ranks = workers(s)
            assert len(ranks) == 1, (round_, ranks)
            load = Load(s.url, LONG, streams=3, full=1, read_timeout=30)
            assert load.wait_streaming(60), s.output()[-3000:]
            os.kill(ranks[0], signal.SIGKILL)
            killed_at = time.monotonic()
            assert not load.join(20), s.output()[-3000:]
            for r in load.results:
                assert r.finish != "length" and (r.error_event or r.transport_error or r.status == 503), r
            assert poll_status(s.url + "/health", 200, 30) == 200, s.output()[-3000:]
            r = httpx.post(s.url + "/v1/completions",
                           json={"model": MODEL, "prompt": "Hi", "max_tokens": 3}, timeout=30)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
            assert time.monotonic() - killed_at < 30
            assert workers(s) and workers(s) != ranks
        assert_stops_clean(s, proctree.tree(s.pid)[1:])
    finally:
        s.stop()


# --------------------------------------------------------------------------- SIGTERM under load


@pytest.mark.slow
def test_sigterm_under_load_lets_requests_finish():
    """SIGTERM while 8 requests generate: the listener closes, every in-flight request runs to
    its normal end, then the server exits 0 and cleans up."""
    tokens = 150
    s = serve("--executor", "mp", "--shutdown-timeout", "60")
    try:
        kids = proctree.tree(s.pid)[1:]
        body = {"model": MODEL, "prompt": "Count:", "max_tokens": tokens, "ignore_eos": True}
        load = Load(s.url, body, streams=6, full=2, read_timeout=60)
        assert load.wait_streaming(60), s.output()[-3000:]
        at_signal = [r.events for r in load.results if r.stream]
        s.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        with pytest.raises(httpx.TransportError):  # the listener is closed: new clients are refused
            httpx.post(s.url + "/v1/completions", json={"model": MODEL, "prompt": "x"}, timeout=3)
        assert not load.join(60), s.output()[-3000:]
        assert any(n < tokens for n in at_signal), "every stream had finished before SIGTERM"
        for r in load.results:
            assert r.status == 200 and not r.transport_error, (r, s.output()[-3000:])
            if r.stream:
                assert r.done and r.finish == "length" and r.events >= tokens and not r.error_event, r
            else:
                assert r.body["usage"]["completion_tokens"] == tokens, r.body
        assert s.proc.wait(30) == 0, s.output()[-3000:]
        assert "shutdown complete" in s.output()
        assert_stops_clean(s, kids)
    finally:
        s.stop()


# --------------------------------------------------------------------------- slow headers


def _latencies(url: str, n: int) -> list[float]:
    out = []
    with httpx.Client(base_url=url, timeout=30) as c:
        for i in range(n):
            t0 = time.monotonic()
            r = c.post("/v1/completions", json={"model": MODEL, "prompt": f"Hello {i}", "max_tokens": 4})
            assert r.status_code == 200, r.text
            out.append(time.monotonic() - t0)
    return out


def wait_fds(pid: int, ok, within: float) -> bool:
    """``ok(fd count of the server tree)`` becomes true within ``within`` seconds."""
    deadline = time.monotonic() + within
    while not ok(proctree.snapshot(pid).fds):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def _half_open(port: int, count: int) -> list[socket.socket]:
    """Half of them send part of a request head and stop, half connect and send nothing."""
    socks = []
    for i in range(count):
        sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        if i % 2 == 0:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Ty")
        socks.append(sock)
    return socks


def _trickle(socks: list[socket.socket], stop: threading.Event) -> None:
    """Slowloris: one more header byte every 0.5 s, never the blank line that ends the head."""
    while not stop.wait(0.5):
        for sock in socks:
            try:
                sock.sendall(b"x")
            except OSError:
                pass


def _until_closed(sock: socket.socket, within: float) -> bytes | None:
    """What the server sent before it closed the connection; None if it is still open."""
    sock.settimeout(within)
    got = b""
    try:
        while data := sock.recv(4096):
            got += data
    except (ConnectionResetError, BrokenPipeError):
        pass
    except TimeoutError:
        return None
    return got


def _closed_by_server(sock: socket.socket, within: float) -> bool:
    """Closed, at most after a 408 answer."""
    got = _until_closed(sock, within)
    return got is not None and (not got or got.startswith(b"HTTP/1.1 408"))


@pytest.mark.slow
def test_slow_header_connections_do_not_starve_others(shared_server):
    """200 connections that never finish their request head: normal requests keep their latency
    (within a generous factor of a baseline from this same server), /health stays 200, and the
    server closes the half-open connections after --header-timeout, so they cannot pile up until
    file descriptors run out."""
    s = shared_server
    socks: list[socket.socket] = []
    stop = threading.Event()
    try:
        _latencies(s.url, 3)  # warm-up
        baseline = statistics.median(_latencies(s.url, 8))
        fds_before = proctree.snapshot(s.pid).fds
        socks = _half_open(s.port, 199)
        # and one kept-alive connection whose second request head never ends
        kept = socket.create_connection(("127.0.0.1", s.port), timeout=5)
        kept.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert kept.recv(4096).startswith(b"HTTP/1.1 200")
        kept.sendall(b"GET /hea")
        socks.append(kept)
        trickler = threading.Thread(target=_trickle, args=(socks[:40:2], stop), daemon=True)
        trickler.start()
        assert wait_fds(s.pid, lambda n: n >= fds_before + 190, 3)  # the server holds them
        under_attack = statistics.median(_latencies(s.url, 8))
        assert under_attack < max(5 * baseline, baseline + 1.0), (baseline, under_attack)
        for path in ("/health", "/metrics", "/v1/models"):
            t0 = time.monotonic()
            assert httpx.get(s.url + path, timeout=5).status_code == 200
            assert time.monotonic() - t0 < 2.0, path
        assert proctree.snapshot(s.pid).fds >= fds_before + 190  # still held: it was under attack
        # the header timeout closes every half-open connection, trickling or silent; a client
        # that sent part of a head is told why (except a trickling one: the bytes it sends while
        # the server closes turn the close into a reset that can discard the 408)
        answers = [_until_closed(sock, 15) for sock in socks]
        assert all(a is not None for a in answers), s.output()[-3000:]
        untold = [i for i in range(40, 199, 2) if not answers[i].startswith(b"HTTP/1.1 408")]
        assert not untold, [(i, answers[i][:20]) for i in untold]
        assert all(a == b"" for a in answers[1:199:2]), [a[:20] for a in answers[1:199:2]]
        stop.set()
        assert wait_fds(s.pid, lambda n: n <= fds_before + 4, 5)
        assert httpx.get(s.url + "/health", timeout=5).status_code == 200
    finally:
        stop.set()
        for sock in socks:
            sock.close()


def _counters(url: str) -> dict:
    from pagedserve.loadtest.soak import failure_counters

    return failure_counters(httpx.get(url + "/metrics", timeout=5).text)


def _body_started(port: int) -> socket.socket:
    """A request whose head is complete and whose body has only begun."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                 b"Content-Type: application/json\r\nContent-Length: 200\r\n\r\n"
                 b'{"model": "tiny", "prompt": "Hello, this body is never fini')
    return sock


@pytest.mark.slow
def test_abandoned_and_stalled_request_bodies(shared_server):
    """A client that leaves in the middle of its request body is a client gone (499), not a
    server error: no 500, no error log. A client that stalls in its body gets 408 after
    --body-timeout and its connection is closed."""
    s = shared_server
    before, logged = _counters(s.url), s.output().count("unexpected error")
    fds_before = proctree.snapshot(s.pid).fds
    for sock in [_body_started(s.port) for _ in range(20)]:
        sock.close()
    stalled = [_body_started(s.port) for _ in range(20)]
    try:
        answers = [_until_closed(sock, 20) for sock in stalled]
        assert all(a is not None and a.startswith(b"HTTP/1.1 408") for a in answers), answers
        time.sleep(0.5)
        after = _counters(s.url)
        assert s.output().count("unexpected error") == logged, s.output()[-3000:]
        errors = after.get("request_errors_total", {})
        assert errors.get("internal_error", 0) == before.get("request_errors_total", {}).get("internal_error", 0)
        http = after.get("http_error_responses_total", {})
        assert http.get("500", 0) == before.get("http_error_responses_total", {}).get("500", 0), http
        assert wait_fds(s.pid, lambda n: n <= fds_before + 4, 5)
        assert httpx.get(s.url + "/health", timeout=5).status_code == 200
    finally:
        for sock in stalled:
            sock.close()


# --------------------------------------------------------------------------- disconnect storm


async def _storm(url: str, rounds: int, size: int, seed: int) -> int:
    """Streams dropped after 0-5 events and non-streamed requests dropped by a short client
    timeout; returns how many were opened."""
    rng = random.Random(seed)
    body = {"model": MODEL, "max_tokens": 500, "ignore_eos": True}

    async def stream_and_drop(client: httpx.AsyncClient, drop_after: int, i: int) -> None:
        async with client.stream("POST", "/v1/completions",
                                 json={**body, "prompt": f"Storm {i}", "stream": True}) as r:
            assert r.status_code == 200
            seen = 0
            async for line in r.aiter_lines():
                if seen >= drop_after:
                    break
                seen += line.startswith("data: ")

    async def full_and_drop(client: httpx.AsyncClient, i: int) -> None:
        try:
            await client.post("/v1/completions", json={**body, "prompt": f"Storm {i}"}, timeout=0.3)
        except httpx.TimeoutException:
            pass

    opened = 0
    for _ in range(rounds):
        async with httpx.AsyncClient(base_url=url, timeout=30,
                                     limits=httpx.Limits(max_connections=size)) as client:
            jobs = []
            for i in range(size):
                if rng.random() < 0.25:
                    jobs.append(full_and_drop(client, opened + i))
                else:
                    jobs.append(stream_and_drop(client, rng.randint(0, 5), opened + i))
            await asyncio.gather(*jobs)
        opened += size
    return opened


@pytest.mark.slow
def test_disconnect_storm_frees_everything(shared_server):
    s = shared_server
    asyncio.run(wait_idle(s.url, 10))
    fds_before = proctree.snapshot(s.pid).fds
    assert asyncio.run(_storm(s.url, rounds=3, size=48, seed=1)) == 144
    idle = asyncio.run(wait_idle(s.url, 20))
    assert idle == {"kv_cache_usage_perc": 0.0, "num_requests_running": 0.0,
                    "num_requests_waiting": 0.0}, idle
    assert wait_fds(s.pid, lambda n: n <= fds_before + 4, 5)
    r = httpx.post(s.url + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 3},
                   timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


# --------------------------------------------------------------------------- overload


async def _flood(url: str, count: int) -> list[httpx.Response]:
    body = {"model": MODEL, "prompt": "Flood", "max_tokens": 16, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=url, timeout=60,
                                 limits=httpx.Limits(max_connections=count)) as client:
        async def one(i: int) -> httpx.Response:
            if i % 3 == 0:  # streams too: a refusal is a real status, before any event
                async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                    await r.aread()
                    return r
            return await client.post("/v1/completions", json=body)

        return await asyncio.gather(*(one(i) for i in range(count)))


@pytest.mark.slow
def test_overload_past_max_waiting_gives_only_200_and_503():
    s = serve("--max-waiting-requests", "4", "--max-num-seqs", "2")
    try:
        responses = asyncio.run(_flood(s.url, 40))
        statuses = sorted({r.status_code for r in responses})
        assert set(statuses) <= {200, 503}, [(r.status_code, r.text[:200]) for r in responses
                                            if r.status_code not in (200, 503)]
        refused = [r for r in responses if r.status_code == 503]
        assert refused and len(refused) < len(responses), statuses
        for r in refused:
            assert r.headers.get("retry-after", "").isdigit(), r.headers
            assert r.json()["error"]["code"] == "overloaded", r.text
        for r in responses:
            if r.status_code == 200 and not r.text.startswith("data:"):
                assert r.json()["usage"]["completion_tokens"] == 16
            elif r.status_code == 200:
                assert r.text.rstrip().endswith("data: [DONE]")
        idle = asyncio.run(wait_idle(s.url, 20))
        assert idle["num_requests_running"] == 0 and idle["kv_cache_usage_perc"] == 0, idle
        assert httpx.get(s.url + "/health", timeout=5).status_code == 200
        assert_stops_clean(s, proctree.tree(s.pid)[1:])
    finally:
        s.stop()
