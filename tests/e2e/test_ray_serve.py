"""`pagedserve serve --distributed-executor-backend ray` with no cluster around: the server starts
a local Ray instance on demand (its processes are the server's children), places the worker
actor, serves, and on SIGTERM removes the placement group, stops that instance and exits 0 with
no process left behind. (Joining an existing cluster is tests/gpu/test_ray_multinode.py.)"""
from __future__ import annotations

import signal
import time

import httpx
import pytest

from tests.needs import require

require("ray")

from tests.e2e.test_server_e2e import ServerProcess  # noqa: E402
from tests.e2e.test_worker_death import children, cmdline, gone  # noqa: E402


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        kids = children(todo.pop())
        out += kids
        todo += kids
    return out


def test_serve_on_a_local_ray_instance_started_on_demand(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    s = ServerProcess("--distributed-executor-backend", "ray")
    try:
        log = s.output()
        assert "started a local Ray" in log and "steps over the shared-memory ring" in log, log
        kids = descendants(s.proc.pid)
        assert any("raylet" in cmdline(p) for p in kids), [cmdline(p) for p in kids]
        r = httpx.post(s.url + "/v1/completions", timeout=30,
                       json={"model": "tiny", "prompt": "Hello", "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(60) == 0, s.output()
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and not all(gone(p) for p in kids):
            time.sleep(0.1)
        assert all(gone(p) for p in kids), [cmdline(p) for p in kids if not gone(p)]
    finally:
        s.stop()
