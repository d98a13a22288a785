"""Failures show in a real server's /metrics (issue 10, fault 9): 4xx by status code, a client
that disconnects mid-stream as finished_reason="abort", and a worker killed with -9 as an
engine death plus the 503s that follow."""
from __future__ import annotations

import os
import signal
import time

import httpx

from tests.e2e.test_server_e2e import ServerProcess, metrics
from tests.e2e.test_worker_death import children, cmdline

ABORT = "pagedserve:request_success_total|finished_reason=abort"
LENGTH = "pagedserve:request_success_total|finished_reason=length"


def http_errors(m: dict, status: int) -> float:
    return m.get(f"pagedserve:http_error_responses_total|status_code={status}", 0.0)


def wait_for(url: str, pred, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(url)
        if pred(m) or time.monotonic() > deadline:
            return m
        time.sleep(0.1)


def test_failures_are_counted_by_a_real_server():
    s = ServerProcess("--executor", "mp")
    try:
        url = s.url
        before = metrics(url)
        assert before[ABORT] == 0 and before["pagedserve:engine_deaths_total"] == 0

        # 4xx, by code
        assert httpx.post(url + "/v1/completions", content=b"{bad", timeout=30,
                          headers={"content-type": "application/json"}).status_code == 400
        assert httpx.post(url + "/v1/completions", json={"model": "nope", "prompt": "x"},
                          timeout=30).status_code == 404
        m = metrics(url)
        assert http_errors(m, 400) == 1 and http_errors(m, 404) == 1

        # a client gone mid-stream is an abort, not a success
        body = {"model": "tiny", "prompt": "A long story:", "max_tokens": 400, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
            seen = 0
            for line in r.iter_lines():
                seen += line.startswith("data: ")
                if seen >= 3:
                    break
        m = wait_for(url, lambda m: m[ABORT] == 1)
        assert m[ABORT] == 1 and m[LENGTH] == before[LENGTH]

        # a worker killed with -9: one engine death; requests after it are 503s, also counted
        workers = [p for p in children(s.proc.pid) if "spawn_main" in cmdline(p)]
        assert workers, "no worker process found"
        os.kill(workers[0], signal.SIGKILL)
        deadline = time.monotonic() + 15
        while httpx.get(url + "/health", timeout=5).status_code == 200:
            assert time.monotonic() < deadline, "the engine did not notice the dead worker"
            time.sleep(0.1)
        r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2},
                       timeout=30)
        assert r.status_code == 503
        m = metrics(url)
        assert m["pagedserve:engine_deaths_total"] == 1
        assert http_errors(m, 503) >= 2  # the /health probe that saw it, and the completion
        assert m["pagedserve:request_overloaded_total"] == 0
    finally:
        assert s.stop() == 0, s.output()


def test_worker_restart_is_counted_not_a_death():
    """With --restart-workers a killed worker is replaced: /metrics counts one restart and no
    engine death, and the server serves again."""
    s = ServerProcess("--executor", "mp", "--restart-workers")
    try:
        url = s.url
        assert metrics(url)["pagedserve:worker_restarts_total"] == 0
        workers = [p for p in children(s.proc.pid) if "spawn_main" in cmdline(p)]
        assert workers, "no worker process found"
        os.kill(workers[0], signal.SIGKILL)
        m = wait_for(url, lambda m: m["pagedserve:worker_restarts_total"] >= 1, timeout=60)
        assert m["pagedserve:worker_restarts_total"] == 1
        assert m["pagedserve:engine_deaths_total"] == 0
        deadline = time.monotonic() + 60
        while httpx.get(url + "/health", timeout=5).status_code != 200:
            assert time.monotonic() < deadline, "the server did not come back after the restart"
            time.sleep(0.2)
        r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2},
                       timeout=30)
        assert r.status_code == 200
    finally:
        assert s.stop() == 0, s.output()
