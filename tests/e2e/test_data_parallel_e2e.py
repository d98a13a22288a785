"""`serve --data-parallel-size 2` on the tiny random model: greedy outputs equal one replica's,
requests reach both replicas, and after kill -9 of one replica's worker the other keeps serving
(/health stays 200 and says which replica is dead), then SIGTERM exits clean."""
from __future__ import annotations

import concurrent.futures
import os
import signal
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.test_server_e2e import ServerProcess
from tests.e2e.test_worker_death import assert_sigterm_exits_clean, children, mapped_segments, workers_of

PROMPTS = [f"{i} little {word} went to the market and" for i, word in
           enumerate(["pigs", "cats", "dogs", "birds", "mice", "cows", "bees", "ants"])]


def complete(url: str, prompt: str) -> str:
    r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 12,
                                                  "temperature": 0, "ignore_eos": True}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def complete_all(url: str) -> list[str]:
    """All prompts at once, so the router has more than one in flight to spread."""
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(lambda p: complete(url, p), PROMPTS))


def replica_metric(url: str, name: str) -> dict[str, float]:
    out = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for s in fam.samples:
            if s.name == "pagedserve:replica_" + name:
                out[s.labels["replica"]] = s.value
    return out


def test_two_replicas_match_one_and_survive_a_dead_replica():
    one = ServerProcess("--executor", "mp")
    try:
        expected = complete_all(one.url)
    finally:
        assert one.stop() == 0, one.output()

    s = ServerProcess("--executor", "mp", "--data-parallel-size", "2")
    try:
        kids = children(s.proc.pid)
        workers = workers_of(s.proc.pid)
        segments = mapped_segments(s.proc.pid)
        assert len(workers) == 2, s.output()
        assert "2 data-parallel replicas ready" in s.output()
        assert complete_all(s.url) == expected
        routed = replica_metric(s.url, "requests_routed_total")
        assert sum(routed.values()) == len(PROMPTS) and min(routed.values()) >= 1, routed
        health = httpx.get(s.url + "/health", timeout=5)
        assert health.status_code == 200 and health.json()["replicas"] == ["ok", "ok"]

        os.kill(workers[0], signal.SIGKILL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            health = httpx.get(s.url + "/health", timeout=5)
            if "dead" in health.json().get("replicas", []):
                break
            time.sleep(0.1)
        assert health.status_code == 200 and sorted(health.json()["replicas"]) == ["dead", "ok"], health.text
        assert complete_all(s.url) == expected  # every request now on the live replica
        assert sorted(replica_metric(s.url, "up").values()) == [0.0, 1.0]
        assert httpx.post(s.url + "/tokenize", json={"prompt": "hi"}, timeout=5).status_code == 200
        assert_sigterm_exits_clean(s, kids, segments)
    finally:
        s.stop()
