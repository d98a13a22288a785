"""Which GPU a worker uses and how much of it the KV cache gets (issue 24 fault 2), as pure
functions checked with numbers on CPU, and the worker start-up that calls them with a mocked
torch.cuda (no GPU here): every rank selects its device, one alone too, and data-parallel
replicas each get their own GPUs."""
from __future__ import annotations

import argparse

import pytest
import torch

from pagedserve.contracts.config import ConfigError, EngineConfig
from pagedserve.gpu.device import cuda_device_index, kv_cache_budget

GiB = 1 << 30


@pytest.mark.parametrize("rank, world, dp, count, want", [
    (0, 1, 0, 1, 0),  # one GPU, one worker
    (0, 1, 1, 2, 1),  # -dp 2: the second replica on the second GPU, not cuda:0
    (1, 2, 0, 4, 1),  # -tp 2, replica 0: GPUs 0 and 1
    (0, 2, 1, 4, 2),  # -tp 2, replica 1: GPUs 2 and 3
    (1, 2, 1, 4, 3),
    (3, 4, 1, 8, 7),  # tp 2 x pp 2, replica 1: GPUs 4..7
])
def test_each_rank_of_each_replica_gets_its_own_gpu(rank, world, dp, count, want):
    assert cuda_device_index(rank, world, dp, count) == want


def test_too_few_gpus_is_refused_naming_the_flags():
    with pytest.raises(ConfigError, match="needs GPU 2, but 2 GPU.*--data-parallel-size"):
        cuda_device_index(0, 2, 1, 2)
    with pytest.raises(ValueError):
        cuda_device_index(2, 2, 0, 8)


def test_the_budget_is_the_share_less_weights_and_peak_activations():
    # 80 GiB GPU, all free, 0.9 of it: 72 GiB less 16 GiB of weights and 2 GiB of activations.
    assert kv_cache_budget(80 * GiB, 80 * GiB, 0.9, 16 * GiB, 2 * GiB) == int(80 * GiB * 0.9) - 18 * GiB
    assert kv_cache_budget(40 * GiB, 80 * GiB, 0.5, 1 * GiB, 1 * GiB) == 38 * GiB


def test_a_share_larger_than_the_free_memory_is_refused():
    """A second process on the GPU: its share must fit in what the first left free."""
    with pytest.raises(ConfigError, match=r"0.9 asks for 72.00 GiB .* only 30.00 GiB were free .* 0.37 or less"):
        kv_cache_budget(30 * GiB, 80 * GiB, 0.9, 1 * GiB, 1 * GiB)


def test_weights_and_activations_filling_the_share_are_refused():
    with pytest.raises(ConfigError, match="leaving none for the KV cache: raise --gpu-memory-utilization"):
        kv_cache_budget(80 * GiB, 80 * GiB, 0.2, 15 * GiB, 1 * GiB)


@pytest.mark.parametrize("bad", [0.0, 1.5, float("nan")])
def test_the_utilization_is_a_fraction(bad):
    with pytest.raises(ConfigError, match="--gpu-memory-utilization must be in"):
        EngineConfig.from_options(gpu_memory_utilization=bad)


def test_the_flag_sets_the_cache_field():
    from pagedserve.app.engine_args import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    config = engine_config_from_args(parser.parse_args(["--gpu-memory-utilization", "0.5"]))
    assert config.cache.gpu_memory_utilization == 0.5


class FakeCuda:
    """torch.cuda as a worker's start-up sees it on a box with ``count`` GPUs."""

    def __init__(self, count: int):
        self.count = count
        self.selected: list[int] = []

    def install(self, monkeypatch):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: self.count)
        monkeypatch.setattr(torch.cuda, "set_device", self.selected.append)


@pytest.mark.parametrize("dp_rank, want", [(0, 0), (1, 1)])
def test_a_lone_worker_selects_its_replicas_gpu(monkeypatch, dp_rank, want):
    """world_size 1 selected no device before: every -dp replica ran on cuda:0."""
    from pagedserve.gpu.worker import WorkerArgs, setup_torch

    cuda = FakeCuda(2)
    cuda.install(monkeypatch)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    config = EngineConfig.from_options(device="cuda", data_parallel_rank=dp_rank)
    setup_torch(WorkerArgs(config, 0, 1, None, None, None, num_threads=1))
    assert cuda.selected == [want]


def test_replicas_get_their_index():
    from pagedserve.engine.replicas import ReplicatedEngine

    class Stub:
        def __init__(self, config, restart_policy):
            self.config = config

    engine = ReplicatedEngine(EngineConfig(), 3, engine_factory=Stub)
    assert [r.config.parallel.data_parallel_rank for r in engine.replicas] == [0, 1, 2]


def test_the_cuda_error_names_the_cuda_flag(monkeypatch):
    """The budget's error on CUDA named the CPU-only --kv-cache-memory."""
    from pagedserve.gpu.model_runner import ModelRunner

    runner = ModelRunner(EngineConfig.from_options(device="cpu"))
    runner.device = torch.device("cuda", 0)  # only its type is read on this path
    monkeypatch.setattr(runner, "kv_bytes_per_block", lambda: 1 << 20)
    monkeypatch.setattr(runner, "_cuda_kv_budget", lambda utilization: 1 << 20)
    with pytest.raises(MemoryError, match="raise --gpu-memory-utilization"):
        runner._num_blocks()
