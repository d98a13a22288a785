"""Threads per worker: the caller's count (--worker-threads, ParallelConfig.worker_threads), else
$PAGEDSERVE_WORKER_THREADS, else this process's CPUs shared by the world. Data-parallel replicas
split the CPUs through their configs, never by writing the environment (issue 26 item 1)."""
from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from contracts import env
from gpu.worker import _threads_for_rank


@pytest.fixture
def eight_cpus(monkeypatch):
    monkeypatch.delenv(env.WORKER_THREADS.name, raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))


def test_the_count_comes_from_the_caller_then_the_variable_then_the_cpus(eight_cpus, monkeypatch):
    assert _threads_for_rank(2, None) == 4
    assert _threads_for_rank(16, None) == 1
    monkeypatch.setenv(env.WORKER_THREADS.name, "3")
    assert _threads_for_rank(2, None) == 3
    assert _threads_for_rank(2, 5) == 5


@pytest.mark.asyncio
async def test_replicas_split_the_cpus_through_their_configs(eight_cpus):
    from engine.replicas import ReplicatedEngine
    from tests.engine.fakes import make_config

    config = make_config()
    config.parallel.executor = "mp"
    engine = ReplicatedEngine(config, 2, engine_factory=lambda cfg, policy: _Replica(cfg))
    await engine.start()
    assert [r.config.parallel.worker_threads for r in engine.replicas] == [4, 4]
    assert not env.WORKER_THREADS.is_set()  # the environment is no channel between rooms


@pytest.mark.asyncio
@pytest.mark.parametrize("user", ["flag", "variable"])
async def test_replicas_keep_a_count_the_user_chose(eight_cpus, monkeypatch, user):
    from engine.replicas import ReplicatedEngine
    from tests.engine.fakes import make_config

    config = make_config()
    config.parallel.executor = "mp"
    if user == "flag":
        config.parallel.worker_threads = 3
    else:
        monkeypatch.setenv(env.WORKER_THREADS.name, "3")
    engine = ReplicatedEngine(config, 2, engine_factory=lambda cfg, policy: _Replica(cfg))
    await engine.start()
    expected = 3 if user == "flag" else None  # None: the workers read the variable
    assert [r.config.parallel.worker_threads for r in engine.replicas] == [expected, expected]


class _Replica:
    """What ReplicatedEngine.start needs of a replica: its config, start() and its core's block
    manager (whether prefix caching is on: here off, so no prefix index is built)."""

    def __init__(self, config):
        self.config = config
        self.core = SimpleNamespace(block_manager=SimpleNamespace(enable_prefix_caching=False))

    async def start(self) -> None:
        pass
