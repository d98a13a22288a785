"""--dtype auto (issue 24 item 6): on CUDA the checkpoint's own dtype, as vLLM does (fp16 stays
fp16, bf16 stays bf16; an fp32 or unlabelled checkpoint is served in bf16, fp16 on a GPU without
bf16); on the CPU bf16 where the CPU has it natively, else fp32, whatever the checkpoint says."""
from __future__ import annotations

import pytest
import torch

from pagedserve.gpu.device import auto_dtype, checkpoint_dtype, resolve_dtype


@pytest.mark.parametrize("ckpt,want", [
    ("float16", torch.float16), ("bfloat16", torch.bfloat16), ("float32", torch.bfloat16),
    (None, torch.bfloat16), ("fp16", torch.float16), ("half", torch.float16)])
def test_cuda_keeps_the_checkpoints_half_type(ckpt, want):
    assert auto_dtype(ckpt, "cuda", cpu_bf16=False) == want


@pytest.mark.parametrize("ckpt,want", [
    ("float16", torch.float16), ("bfloat16", torch.float16), ("float32", torch.float16), (None, torch.float16)])
def test_a_gpu_without_bf16_gets_fp16(ckpt, want):
    assert auto_dtype(ckpt, "cuda", cpu_bf16=False, cuda_bf16=False) == want


@pytest.mark.parametrize("ckpt", ["float16", "bfloat16", "float32", None])
@pytest.mark.parametrize("cpu_bf16,want", [(True, torch.bfloat16), (False, torch.float32)])
def test_the_cpu_choice_ignores_the_checkpoint(ckpt, cpu_bf16, want):
    assert auto_dtype(ckpt, "cpu", cpu_bf16=cpu_bf16) == want


def test_the_checkpoint_dtype_is_read_from_either_key():
    assert checkpoint_dtype({"torch_dtype": "float16"}) == "float16"
    assert checkpoint_dtype({"dtype": "bfloat16", "torch_dtype": "float16"}) == "bfloat16"  # newer transformers
    assert checkpoint_dtype({"text_config": {"torch_dtype": "float16"}}) == "float16"
    assert checkpoint_dtype({}) is None and checkpoint_dtype(None) is None


def test_an_explicit_dtype_wins():
    assert resolve_dtype("float32", torch.device("cpu"), "float16") == torch.float32
    assert resolve_dtype("fp16", torch.device("cpu"), "bfloat16") == torch.float16


def test_the_runner_passes_the_checkpoints_dtype(monkeypatch):
    """The worker's auto choice sees the model's config.json dtype (the CPU ignores it, so a spy)."""
    import pagedserve.gpu.model_runner as mr
    from pagedserve.contracts.config import EngineConfig
    from tests.tiny import TINY_CONFIG

    seen = []
    real = mr.resolve_dtype
    monkeypatch.setattr(mr, "resolve_dtype", lambda name, device, ckpt=None: seen.append(ckpt) or real(name, device, ckpt))
    config = EngineConfig.from_options(load_format="dummy", hf_config={**TINY_CONFIG, "torch_dtype": "float16"},
                                       device="cpu")
    mr.ModelRunner(config)
    assert seen == ["float16"]
