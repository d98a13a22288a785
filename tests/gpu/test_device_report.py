"""What the server says about its device at start (issue 24 fault 5): a torch that cannot use
CUDA (a CPU build, a driver older than its CUDA) is named as the reason --device cuda is refused,
before any worker starts, and the start-up log names the device and torch's version."""
from __future__ import annotations

import logging

import pytest
import torch

from pagedserve.contracts.config import ConfigError, EngineConfig
from pagedserve.gpu.device import describe_device, resolve_device, why_no_cuda


def test_a_cpu_build_of_torch_is_named():
    assert "torch 2.13.0+cpu is a CPU build" in why_no_cuda("2.13.0+cpu", None, "580.65.06", "13.0")


def test_a_driver_older_than_torchs_cuda_is_named():
    text = why_no_cuda("2.11.0+cu130", "13.0", "535.104.05", "12.2")
    assert "built for CUDA 13.0, but the NVIDIA driver 535.104.05 supports CUDA 12.2 at most" in text


def test_no_driver_and_no_gpu_are_named():
    assert "no NVIDIA driver was found" in why_no_cuda("2.11.0+cu130", "13.0", None, None)
    assert "CUDA_VISIBLE_DEVICES" in why_no_cuda("2.11.0+cu130", "13.0", "580.65.06", "13.0")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a box where torch has no CUDA")
def test_device_cuda_is_refused_saying_why():
    with pytest.raises(ConfigError, match=r"--device cuda: CUDA is not available: torch .*(CPU build|driver|GPU)"):
        resolve_device("cuda")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a box where torch has no CUDA")
def test_the_engine_refuses_device_cuda_before_a_worker_starts(monkeypatch):
    from pagedserve.engine.bootstrap import resolve_config
    from tests.tiny import TINY_CONFIG

    config = EngineConfig.from_options(load_format="dummy", hf_config=TINY_CONFIG, device="cuda", executor="mp")
    with pytest.raises(ConfigError, match="CUDA is not available: torch"):
        resolve_config(config)


def test_the_runner_logs_its_device(caplog):
    from pagedserve.gpu.model_runner import ModelRunner

    with caplog.at_level(logging.INFO, logger="pagedserve.gpu.model_runner"):
        ModelRunner(EngineConfig.from_options(device="cpu"))
    assert f"device cpu (torch {torch.__version__})" in caplog.text
    assert describe_device(torch.device("cpu")) == f"device cpu (torch {torch.__version__})"
