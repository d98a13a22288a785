"""The HTTP side over data-parallel replicas (engine.replicas.ReplicatedEngine over real
AsyncEngines on fake executors): routes, /health while one replica is dead, /metrics per replica."""
from __future__ import annotations

import asyncio

import httpx
import pytest

from pagedserve.app.server import build_app
from pagedserve.engine.replicas import ReplicatedEngine
from pagedserve.engine.sampling_params import SamplingParams
from tests.app.test_failure_metrics import scrape
from tests.engine.fake_async import patch_build_engine
from tests.engine.fakes import make_config

pytestmark = pytest.mark.asyncio


@pytest.fixture
async def replicated(monkeypatch):
    patch_build_engine(monkeypatch)
    engine = ReplicatedEngine(make_config(num_blocks=128), 2)
    await engine.start()
    app = build_app(engine, served_model_name="m")
    # Each replica's own parts, in replica order: the replicas start concurrently, so the build order
    # need not be theirs (a test that broke "replica 1" through the build list broke replica 0 in about
    # one run of ten, and then waited forever on the replica it had meant to hold).
    parts = [r.parts for r in engine.replicas]
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        yield engine, parts, c
    await engine.shutdown()


def replica(m: dict, name: str, i: int) -> float:
    return m[("pagedserve:replica_" + name, (("replica", str(i)),))]


async def complete(c, prompt: str, max_tokens: int = 3):
    return await c.post("/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": max_tokens,
                                                 "temperature": 0})


async def test_routes_work_through_the_router(replicated):
    engine, _, c = replicated
    r = await complete(c, "hello there")
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    assert (await c.get("/v1/models")).json()["data"][0]["id"] == "m"
    tok = (await c.post("/tokenize", json={"prompt": "abc"})).json()
    assert tok["count"] == 4
    assert (await c.post("/detokenize", json={"tokens": tok["tokens"]})).json()["prompt"].endswith("abc")
    health = await c.get("/health")
    assert health.status_code == 200 and health.json() == {"status": "ok", "replicas": ["ok", "ok"]}


async def test_metrics_per_replica_and_in_total(replicated):
    engine, _, c = replicated
    streams = [engine.generate([1, 3 + i, 50, 60], SamplingParams(max_tokens=30), f"m{i}") for i in range(3)]
    m = await scrape(c)
    assert replica(m, "num_requests_waiting", 0) + replica(m, "num_requests_running", 0) == 2
    assert replica(m, "num_requests_waiting", 1) + replica(m, "num_requests_running", 1) == 1
    assert m[("pagedserve:num_requests_waiting", ())] + m[("pagedserve:num_requests_running", ())] == 3
    assert replica(m, "requests_routed_total", 0) == 2 and replica(m, "requests_routed_total", 1) == 1
    assert replica(m, "up", 0) == 1 and replica(m, "up", 1) == 1
    assert m[("pagedserve:router_decisions_total", ())] == 3
    assert m[("pagedserve:router_decision_seconds_total", ())] > 0
    for s in streams:
        async for _ in s:
            pass


async def test_one_dead_replica_leaves_the_server_serving(replicated):
    engine, built, c = replicated

    async def broken(step):
        raise RuntimeError("replica 1's worker died (test)")

    built[1].executor.execute_async = broken
    gate = asyncio.Event()
    run = built[0].executor.execute_async

    async def held(step):
        await gate.wait()
        return await run(step)

    built[0].executor.execute_async = held
    first = engine.generate([1, 40, 41, 42], SamplingParams(max_tokens=5), "keep")  # replica 0 is busier now
    r = await complete(c, "this one lands on replica 1")
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
    health = await c.get("/health")
    assert health.status_code == 200 and health.json()["replicas"] == ["ok", "dead"]
    gate.set()
    for i in range(3):
        r = await complete(c, f"{i} later")
        assert r.status_code == 200, r.text
    async for _ in first:
        pass
    m = await scrape(c)
    assert replica(m, "up", 1) == 0 and replica(m, "engine_deaths_total", 1) == 1
    assert m[("pagedserve:engine_deaths_total", ())] == 1
    assert replica(m, "requests_routed_total", 0) == 4

    built[0].executor.execute_async = broken
    r = await complete(c, "the last replica dies under this one")
    assert r.status_code == 503
    health = await c.get("/health")
    assert health.status_code == 503 and health.json()["status"] == "dead"
    assert health.json()["replicas"] == ["dead", "dead"]
