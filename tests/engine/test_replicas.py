"""ReplicatedEngine: N real AsyncEngines (over fake executors) behind one router."""
from __future__ import annotations

import pytest

from pagedserve.engine.errors import EngineDeadError
from pagedserve.engine.replicas import ReplicatedEngine
from pagedserve.engine.sampling_params import SamplingParams
from tests.engine.fake_async import patch_build_engine
from tests.engine.fakes import FakeTokenizer, make_config

pytestmark = pytest.mark.asyncio

TOK = FakeTokenizer()


async def started(monkeypatch, n=2, **policy):
    built = patch_build_engine(monkeypatch)
    engine = ReplicatedEngine(make_config(num_blocks=128), n, **policy)
    await engine.start()
    return engine, built


async def drain(stream):
    outs = [o async for o in stream]
    return outs


def ids(text):
    return TOK.encode(text)


def greedy(max_tokens=4):
    return SamplingParams(max_tokens=max_tokens, temperature=0.0)


async def test_unrelated_requests_go_to_the_least_loaded_replica(monkeypatch):
    engine, _ = await started(monkeypatch)
    try:
        streams = [engine.generate(ids(f"{i}: a prompt of its own"), greedy(), f"r{i}") for i in range(4)]
        assert [engine.owner_of(f"r{i}") for i in range(4)] == [0, 1, 0, 1]
        for s in streams:
            assert (await drain(s))[-1].finished
        assert engine.num_routed == [2, 2]
    finally:
        await engine.shutdown()


async def test_a_cached_prefix_draws_its_request_despite_more_load(monkeypatch):
    engine, _ = await started(monkeypatch)
    system = "You are a helpful assistant. Answer briefly and to the point, please. " * 2
    try:
        await drain(engine.generate(ids(system + "first"), greedy(), "warm"))  # replica 0 caches it
        busy = engine.generate(ids("something unrelated"), greedy(), "busy")  # both idle: replica 0
        assert engine.owner_of("busy") == 0
        hit = engine.generate(ids(system + "second"), greedy(), "hit")
        assert engine.owner_of("hit") == 0  # one request more than replica 1, but its prefix is there
        other = engine.generate(ids("another unrelated prompt"), greedy(), "other")
        assert engine.owner_of("other") == 1
        outs = await drain(hit)
        assert outs[0].num_cached_tokens >= 4 * 4 * 4  # many blocks of 4 tokens came from the cache
        await drain(busy), await drain(other)
        assert engine.num_prefix_routed[0] == 1
    finally:
        await engine.shutdown()


async def test_prefix_of_a_request_still_computing_counts(monkeypatch):
    """A burst sharing a prompt prefix stays together before any block is computed."""
    engine, _ = await started(monkeypatch)
    system = "Shared system prompt that is long enough for several blocks. " * 2
    try:
        streams = [engine.generate(ids("unrelated"), greedy(), "u")]  # replica 0
        streams.append(engine.generate(ids(system + "a"), greedy(), "a"))  # replica 1
        streams.append(engine.generate(ids(system + "b"), greedy(), "b"))  # tie on load: prefix
        assert [engine.owner_of(r) for r in ("u", "a", "b")] == [0, 1, 1]
        for s in streams:
            await drain(s)
    finally:
        await engine.shutdown()


async def test_an_overloaded_replica_gives_up_its_prefix_affinity(monkeypatch):
    engine, _ = await started(monkeypatch, max_imbalance=2)
    system = "A long shared prefix for every request of this burst, many blocks. " * 2
    try:
        streams = [engine.generate(ids(system + str(i)), greedy(), f"p{i}") for i in range(5)]
        owners = [engine.owner_of(f"p{i}") for i in range(5)]
        # two on replica 0 by affinity, then it is 2 ahead: replica 1 takes one and holds the
        # prefix too; from then on load decides between two replicas with the prefix
        assert owners[:3] == [0, 0, 1]
        assert sorted(owners).count(1) >= 2
        for s in streams:
            await drain(s)
    finally:
        await engine.shutdown()


async def test_a_dead_replica_fails_only_its_own_requests(monkeypatch):
    engine, _ = await started(monkeypatch)
    try:
        # the replica's own executor: replicas start concurrently, so the build order (``built``)
        # need not be the replica order (CI once patched replica 1's and saw d0 finish)
        gate = engine.replicas[0].parts.executor

        async def broken(step):
            raise RuntimeError("worker of replica 0 died (test)")

        gate.execute_async = broken
        s0 = engine.generate(ids("zero: first"), greedy(8), "d0")
        s1 = engine.generate(ids("one: second"), greedy(8), "d1")
        assert (engine.owner_of("d0"), engine.owner_of("d1")) == (0, 1)
        with pytest.raises(EngineDeadError):
            await drain(s0)
        outs = await drain(s1)
        assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "length"
        assert engine.replica_states() == ["dead", "ok"]
        assert engine.health_status() == "ok" and engine.num_deaths == 1
        # new requests all go to the live replica, and finish
        for i in range(3):
            outs = await drain(engine.generate(ids(f"{i} after"), greedy(), f"n{i}"))
            assert outs[-1].outputs[0].finish_reason == "length"
        assert engine.num_routed == [1, 4]
        assert engine.stats().num_running == 0  # the live replica's stats still read
        engine.replicas[1].parts.executor.execute_async = broken
        with pytest.raises(EngineDeadError):
            await drain(engine.generate(ids("last one"), greedy(), "last"))
        assert engine.health_status() == "dead"
        with pytest.raises(EngineDeadError):
            engine.generate(ids("nobody left"), greedy(), "none")
    finally:
        await engine.shutdown()


async def test_abort_and_duplicate_ids_through_the_router(monkeypatch):
    engine, _ = await started(monkeypatch)
    try:
        engine.generate(ids("one"), greedy(50), "x")
        s = engine.generate(ids("two"), greedy(50), "y")
        assert engine.owner_of("y") == 1
        with pytest.raises(ValueError, match="already running"):
            engine.generate(ids("three"), greedy(), "y")  # the id lives on replica 1, not 0
        await engine.abort("y")
        with pytest.raises(EngineDeadError, match="aborted"):
            await drain(s)
        assert engine.owner_of("y") is None
        await engine.abort("x")
        await engine.abort("never-seen")  # no error
    finally:
        await engine.shutdown()


async def test_stats_add_up_and_routing_time_is_kept(monkeypatch):
    engine, _ = await started(monkeypatch)
    try:
        streams = [engine.generate(ids(f"{i} req"), greedy(20), f"s{i}") for i in range(3)]
        per = engine.replica_stats()
        total = engine.stats()
        assert total.num_running + total.num_waiting == 3
        assert total.num_blocks == sum(s.num_blocks for s in per)
        assert engine.num_blocks == 2 * per[0].num_blocks + 2  # usable + the null block each
        assert engine.num_decisions == 3 and engine.decision_ns > 0
        for s in streams:
            await drain(s)
    finally:
        await engine.shutdown()


async def test_load_only_routing_ignores_the_cached_prefix(monkeypatch):
    engine, _ = await started(monkeypatch, prefix_aware=False)
    system = "You are a helpful assistant. Answer briefly and to the point, please. " * 2
    try:
        await drain(engine.generate(ids(system + "first"), greedy(), "warm"))
        busy = engine.generate(ids("something unrelated"), greedy(), "busy")
        hit = engine.generate(ids(system + "second"), greedy(), "hit")
        assert (engine.owner_of("busy"), engine.owner_of("hit")) == (0, 1)
        await drain(busy), await drain(hit)
    finally:
        await engine.shutdown()


async def test_a_pooling_request_is_routed_as_a_generation_is():
    """ReplicatedEngine.pool (engine.client.EngineClient): AsyncEngine.pool is its generate with
    pooling params, so the router sends it through the same choice of replica."""
    from pagedserve.engine.pooling_params import PoolingParams

    engine = ReplicatedEngine(make_config(), 2)
    calls = []
    engine.generate = lambda *a, **k: calls.append((a, k)) or "the stream"
    params = PoolingParams()
    assert engine.pool([5, 6], params, "e-0", prompt="hi", priority=2, cache_salt="s") == "the stream"
    assert calls == [(([5, 6], params, "e-0"), {"prompt": "hi", "priority": 2, "cache_salt": "s"})]
