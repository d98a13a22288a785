"""Gemma 2, Gemma 3 and Phi-3 from GGUF files written as llama.cpp writes them (tests/gpu/tiny_gguf.py):
the config read from the file's keys, and the logits of the transformers model the file was
written from (F32 tensors: 1e-4; Q8_0 weights, kept packed: the top token at most positions, and
within 1 % of the same file dequantized)."""
from __future__ import annotations

import pytest
import torch
from gguf.constants import GGMLQuantizationType as T

from pagedserve.contracts.config import ModelConfig
from pagedserve.gpu.forward_context import forward_context
from tests.gpu.test_model_families import FAMILIES
from tests.gpu.test_models import assert_close, save_hf_model
from tests.gpu.tiny_gguf import write_gguf

# What a GGUF can say: the query scale is head_dim's, Gemma 3's layer pattern is every sixth layer
# global and its local rope base 10000 (llama.cpp's assumptions, contracts/gguf_arch.py).
GGUF_FAMILIES = {
    "gemma2": ("gemma2", dict(FAMILIES["gemma2"], query_pre_attn_scalar=16)),
    "gemma3": ("gemma3", {**{k: v for k, v in FAMILIES["gemma3"].items() if k != "layer_types"},
                          "query_pre_attn_scalar": 16, "num_hidden_layers": 6}),
    "phi3": ("phi3", FAMILIES["phi3"]),
    "phi4-mini": ("phi3", FAMILIES["phi4-mini"]),
}


@pytest.fixture(scope="module", params=list(GGUF_FAMILIES))
def written(request, tmp_path_factory):
    arch, cfg = GGUF_FAMILIES[request.param]
    path = tmp_path_factory.mktemp(request.param)
    ref = save_hf_model(cfg, path)
    write_gguf(ref, arch, path / "model.gguf")
    write_gguf(ref, arch, path / "model-q8_0.gguf", T.Q8_0)
    return request.param, ref, path


def _logits(path, quantization="none"):
    from pagedserve.gpu.models.loader import load_model

    ours = load_model(ModelConfig(model=str(path), quantization=quantization), "cpu", torch.float32)
    ids = torch.randint(0, 97, (23,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode(), forward_context(None, []):
        return ids, ours.compute_logits(ours(ids, torch.arange(23))), ours


def test_config_from_gguf_keys_matches_the_checkpoint(written):
    from pagedserve.contracts.hf_config import load_hf_config

    name, ref, path = written
    got, want = load_hf_config(str(path / "model.gguf")), ref.config
    assert got["architectures"] == want.architectures
    assert got.get("sliding_window") == want.sliding_window
    if name.startswith("gemma"):
        assert got["layer_types"] == list(want.layer_types)
        assert got["query_pre_attn_scalar"] == want.query_pre_attn_scalar
        assert got["final_logit_softcapping"] == want.final_logit_softcapping
    else:
        assert got["rope_scaling"]["long_factor"] == pytest.approx(want.rope_parameters["long_factor"])
        assert got.get("partial_rotary_factor", 1.0) == want.rope_parameters.get("partial_rotary_factor", 1.0)


def test_f32_gguf_logits_match_transformers(written):
    name, ref, path = written
    ids, got, _ = _logits(path / "model.gguf")
    with torch.inference_mode():
        want = ref(ids[None]).logits[0]
    assert_close(got, want, f"{name} gguf")


def test_q8_0_gguf_stays_packed_and_close(written):
    name, ref, path = written
    ids, got, ours = _logits(path / "model-q8_0.gguf", quantization="auto")
    with torch.inference_mode():
        want = ref(ids[None]).logits[0]
    layer = ours.model.layers[0]
    packed = {n for n, m in layer.named_modules() if getattr(m, "qweight", None) is not None}
    # Phi-3's fused attn_qkv / ffn_up are cut by rows into q/k/v and gate/up after packing.
    assert packed == {"self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"}, packed
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.8, name
    # Packed (and, for Phi-3, cut after packing) computes what the file's dequantized weights do.
    _, dequantized, _ = _logits(path / "model-q8_0.gguf", quantization="none")
    assert (got - dequantized).abs().max() < 0.01 * dequantized.abs().max(), name
