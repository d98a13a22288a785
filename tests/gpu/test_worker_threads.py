"""Threads per worker: the caller's count (--worker-threads, ParallelConfig.worker_threads), else
$PAGEDSERVE_WORKER_THREADS, else this process's CPUs shared by the world: its affinity mask capped
by its cgroup CPU quota (issue 36 item 5). Data-parallel replicas split the CPUs through their
configs, never by writing the environment (issue 26 item 1)."""
from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from pagedserve.contracts import cpu_threads, env
from pagedserve.gpu.worker import _threads_for_rank


@pytest.fixture
def eight_cpus(monkeypatch):
    monkeypatch.delenv(env.WORKER_THREADS.name, raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.setattr(cpu_threads, "cgroup_cpu_limit", lambda *a: None)  # whatever this machine has


def test_a_cgroup_quota_caps_the_share(eight_cpus, monkeypatch):
    monkeypatch.setattr(cpu_threads, "cgroup_cpu_limit", lambda *a: 3.5)  # docker --cpus 3.5
    assert _threads_for_rank(1, None) == 3
    assert _threads_for_rank(2, None) == 1
    assert _threads_for_rank(1, 6) == 6  # the user's count stands


def test_an_affinity_mask_is_the_machine(monkeypatch):
    monkeypatch.delenv(env.WORKER_THREADS.name, raising=False)
    monkeypatch.setattr(cpu_threads, "cgroup_cpu_limit", lambda *a: None)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {2, 5, 7})  # taskset -c 2,5,7
    assert _threads_for_rank(1, None) == 3


class _FakeTorch:
    def __init__(self, threads: int):
        self.threads = threads

    def get_num_threads(self) -> int:
        return self.threads

    def set_num_threads(self, n: int) -> None:
        self.threads = n


@pytest.mark.parametrize("torch_threads, quota, requested, variable, expected", [
    (8, None, None, None, 8),   # nothing to change: torch's default is this process's mask
    (8, 2.0, None, None, 2),    # a quota torch does not see caps it
    (1, None, None, None, 1),   # a caller that lowered it keeps its count
    (1, None, 4, None, 4),      # --worker-threads is set as given
    (8, 2.0, None, "3", 3),     # so is $PAGEDSERVE_WORKER_THREADS
])
def test_in_process_threads(eight_cpus, monkeypatch, torch_threads, quota, requested, variable, expected):
    import torch

    from pagedserve.gpu.executor import set_inproc_threads

    fake = _FakeTorch(torch_threads)
    monkeypatch.setattr(torch, "get_num_threads", fake.get_num_threads)
    monkeypatch.setattr(torch, "set_num_threads", fake.set_num_threads)
    monkeypatch.setattr(cpu_threads, "cgroup_cpu_limit", lambda *a: quota)
    if variable:
        monkeypatch.setenv(env.WORKER_THREADS.name, variable)
    assert set_inproc_threads(requested) == expected
    assert fake.threads == expected


def test_the_count_comes_from_the_caller_then_the_variable_then_the_cpus(eight_cpus, monkeypatch):
    assert _threads_for_rank(2, None) == 4
    assert _threads_for_rank(16, None) == 1
    monkeypatch.setenv(env.WORKER_THREADS.name, "3")
    assert _threads_for_rank(2, None) == 3
    assert _threads_for_rank(2, 5) == 5


@pytest.mark.asyncio
async def test_replicas_split_the_cpus_through_their_configs(eight_cpus):
    from pagedserve.engine.replicas import ReplicatedEngine
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
    from pagedserve.engine.replicas import ReplicatedEngine
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
