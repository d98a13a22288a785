"""No C CPU kernel is handed tensors that live elsewhere (issue 24 fault 3): a device pointer
read by C on the host is a segfault. A CUDA tensor that reaches the CPU dispatch (no Triton, a CUDA
model) takes the torch path instead, and a model not on the CPU binds no C decode layer. No GPU
here: the ``meta`` device stands for CUDA, being not CPU as CUDA is not (its tensors have no
host memory either), and the C entry points are replaced by tripwires, so a wrong dispatch fails
the test instead of crashing it."""
from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import cpu_attention, fused
from pagedserve.kernels.attention import paged_attention
from pagedserve.kernels.metadata import AttentionMetadata
from tests.needs import require_library

H, HKV, D, BLOCK = 4, 2, 64, 16


def decode_meta() -> AttentionMetadata:
    return AttentionMetadata(
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32), seq_lens=torch.tensor([5], dtype=torch.int32),
        block_tables=torch.tensor([[1]], dtype=torch.int32), slot_mapping=torch.tensor([20]),
        num_decodes=1, max_query_len=1, max_seq_len=5, query_start_loc_host=[0, 1], seq_lens_host=[5])


@pytest.fixture
def tripwires(monkeypatch):
    """The C decode raises; the torch path answers with a marker."""
    require_library(cpu_attention.library(), "paged_attn", "the C attention kernel is not built here")

    def c_reached(*args, **kwargs):
        raise AssertionError("the C CPU attention kernel was called with non-CPU tensors")

    marker = object()
    monkeypatch.setattr(cpu_attention, "split_decode_prefill", c_reached)
    monkeypatch.setattr(cpu_attention, "paged_attention_torch", lambda *args: marker)
    return marker


@pytest.mark.parametrize("q_dev, cache_dev", [("meta", "meta"), ("cpu", "meta"), ("meta", "cpu")])
def test_attention_on_another_device_takes_the_torch_path(tripwires, q_dev, cache_dev):
    q = torch.empty(1, H, D, device=q_dev)
    k_cache = torch.empty(4, BLOCK, HKV, D, device=cache_dev)
    v_cache = torch.empty(4, BLOCK, HKV, D, device=cache_dev)
    assert paged_attention(q, k_cache, v_cache, decode_meta(), 0.125) is tripwires
    if cache_dev != "cpu":  # the fused decode stack's way to the kernel
        assert cpu_attention.decode_call_by_address(decode_meta(), torch.float32, H, k_cache, v_cache) is None


def test_cpu_tensors_still_take_the_c_kernel(tripwires):
    q = torch.zeros(1, H, D)
    k_cache = torch.zeros(4, BLOCK, HKV, D)
    with pytest.raises(AssertionError, match="C CPU attention kernel"):
        paged_attention(q, k_cache, k_cache.clone(), decode_meta(), 0.125)


def test_the_c_kv_write_refuses_a_cache_on_another_device():
    require_library(fused.available(), "fused_cpu", "the fused C ops are not built here")
    k = torch.zeros(3, HKV, D)
    slots = torch.arange(3)
    assert fused.can_write_kv(k, k.clone(), torch.zeros(4, BLOCK, HKV, D), slots)
    assert not fused.can_write_kv(k, k.clone(), torch.empty(4, BLOCK, HKV, D, device="meta"), slots)


def test_a_model_off_the_cpu_binds_no_c_decode_layer():
    from pagedserve.gpu.models.fast_decode import bind_fast_decode
    from pagedserve.gpu.models.loader import build_model

    require_library(fused.available(), "fused_cpu", "the fused C ops are not built here")
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256, "hidden_size": 64,
           "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 16, "max_position_embeddings": 64, "rms_norm_eps": 1e-5}
    assert bind_fast_decode(build_model(cfg, "cpu", torch.float32)) == 2  # the C layers bind on CPU
    off_cpu = build_model(cfg, "cpu", torch.float32).to("meta")
    assert bind_fast_decode(off_cpu) == 0
    assert not any(getattr(m, "fast_decode", None) is not None for m in off_cpu.modules())


def test_the_fused_rotary_refuses_a_table_on_another_device():
    from pagedserve.gpu.models.rotary import RotaryEmbedding

    require_library(fused.available(), "fused_cpu", "the fused C ops are not built here")
    rotary = RotaryEmbedding(16, 16, 64, 10000.0, None)
    positions = torch.arange(3)
    assert rotary.prepare(positions, torch.float32)[2] is not None  # host table: the C op
    rotary.to("meta")
    assert rotary.prepare(positions, torch.float32)[2] is None
