"""--quantization fp8 (gpu/models/fp8.py): refused by name where there are no FP8 matmuls; the
model path (quantize at load, an FP8 checkpoint's weight_scale) run on the CPU with the device
check stood in for, through the same torch._scaled_mm call the GPU makes."""
from __future__ import annotations

import json

import pytest
import torch

import pagedserve.gpu.models.loader as loader
from pagedserve.contracts.config import ConfigError, ModelConfig
from pagedserve.gpu.models.fp8 import Fp8Weight
from pagedserve.gpu.models.layers import ColumnParallelLinear, ParallelLMHead, RowParallelLinear
from pagedserve.gpu.models.quantization import check_mode, quantize_model
from pagedserve.kernels import fp8_linear
from tests.tiny import TINY_CONFIG, tiny_llm


@pytest.fixture
def fp8_here(monkeypatch):
    """The CPU stands in for an FP8 GPU: torch._scaled_mm runs on it too (oneDNN)."""
    monkeypatch.setattr(fp8_linear, "check_device", lambda device, capability=None: None)


def _tiny(dtype="bfloat16", quantization="none"):
    return loader.load_model(ModelConfig(load_format="dummy", hf_config=TINY_CONFIG, quantization=quantization),
                             dtype=dtype)


def test_refused_by_name_on_cpu_and_on_gpus_without_fp8():
    with pytest.raises(ConfigError, match=r"--quantization fp8 needs .*compute capability >= 8\.9.*runs on cpu"):
        loader.resolve_quantization("fp8", "cpu")
    with pytest.raises(ConfigError, match=r"--quantization fp8 .*compute capability 8\.0"):
        check_mode("fp8", "cuda", capability=(8, 0))
    check_mode("fp8", "cuda", capability=(9, 0))  # H100 / H200: allowed
    with pytest.raises(ConfigError, match="--quantization fp8"):
        quantize_model(_tiny(), "fp8", device="cpu")


def test_llm_refuses_fp8_on_cpu():
    with pytest.raises(ConfigError, match="--quantization fp8"):
        with tiny_llm(quantization="fp8"):
            pass


def test_cli_accepts_fp8():
    import argparse

    from pagedserve.app.engine_args import add_engine_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert parser.parse_args(["--quantization", "fp8"]).quantization == "fp8"


def test_decoder_linears_become_fp8_and_the_head_stays(fp8_here):
    model = _tiny()
    dense = {n: m.weight.detach().float().clone() for n, m in model.named_modules()
             if isinstance(m, (ColumnParallelLinear, RowParallelLinear))}
    quantize_model(model, "fp8", device="cpu")
    for name, m in model.named_modules():
        if isinstance(m, ParallelLMHead):
            assert m.qweight is None and m.weight.numel() > 0  # vLLM keeps the LM head too
        elif isinstance(m, (ColumnParallelLinear, RowParallelLinear)):
            assert isinstance(m.qweight, Fp8Weight) and m.weight.numel() == 0
            assert m.qweight.weight.dtype == torch.float8_e4m3fn
            w = dense[name]
            err = (m.qweight.dequantize() - w).norm() / w.norm()
            assert err < 0.04, (name, err)
    assert len(dense) == 2 * 4


FP8_RANDOM_FLOOR = 0.4  # measured 0.51: a random tiny model's logits are nearly flat, e4m3 has 3 mantissa bits


def test_fp8_model_greedy_agrees_with_bf16(fp8_here):
    """The whole path through the engine (the CPU runs the same torch._scaled_mm); the agreement
    on a real-sized model is the GPU check's to report."""
    from pagedserve.loadtest.micro.quant_accuracy import PROMPTS, agreement, greedy_tokens

    def run(**options):
        with tiny_llm(dtype="bfloat16", **options) as llm:
            return greedy_tokens(llm, PROMPTS[:8], 12)

    same, _ = agreement(run(), run(quantization="fp8"))
    assert same >= FP8_RANDOM_FLOOR, same


def _hf_name(layer: int, proj: str) -> str:
    part = "self_attn" if proj in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
    return f"model.layers.{layer}.{part}.{proj}"


def _write_fp8_checkpoint(path) -> dict[str, torch.Tensor]:
    """A TINY_CONFIG Llama as AutoFP8 writes it: e4m3 weights, a per-tensor weight_scale for the
    attention projections, a per-channel one ([N, 1]) for the MLP, static input_scale beside them.
    Returns the float32 weights each linear layer holds (values x scales)."""
    from safetensors.torch import save_file

    c = TINY_CONFIG
    h, kv = c["hidden_size"], c["num_key_value_heads"] * c["head_dim"]
    shapes = {"q_proj": (h, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, h),
              "gate_proj": (c["intermediate_size"], h), "up_proj": (c["intermediate_size"], h),
              "down_proj": (h, c["intermediate_size"])}
    g = torch.Generator().manual_seed(3)
    tensors, expected = {}, {}
    for layer in range(c["num_hidden_layers"]):
        for proj, shape in shapes.items():
            name = _hf_name(layer, proj)
            q = (torch.randn(shape, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
            if proj.endswith(("q_proj", "k_proj", "v_proj", "o_proj")):
                scale = torch.tensor(0.0002 * (1 + layer + len(proj)))  # per tensor, a 0-d tensor
                expected[name] = q.float() * scale
            else:
                scale = torch.rand(shape[0], 1, generator=g) * 1e-3 + 1e-4  # per channel
                expected[name] = q.float() * scale
            tensors[f"{name}.weight"] = q
            tensors[f"{name}.weight_scale"] = scale.float()
            tensors[f"{name}.input_scale"] = torch.tensor(0.01)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            tensors[f"model.layers.{layer}.{norm}.weight"] = torch.ones(h)
    tensors["model.embed_tokens.weight"] = torch.randn(c["vocab_size"], h, generator=g) * 0.02
    tensors["lm_head.weight"] = torch.randn(c["vocab_size"], h, generator=g) * 0.02
    tensors["model.norm.weight"] = torch.ones(h)
    save_file(tensors, str(path / "model.safetensors"))
    config = {**c, "torch_dtype": "bfloat16",
              "quantization_config": {"quant_method": "fp8", "activation_scheme": "static"}}
    (path / "config.json").write_text(json.dumps(config))
    return expected


def _fused(expected: dict[str, torch.Tensor], layer: int, fused: str) -> torch.Tensor:
    parts = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj"),
             "o_proj": ("o_proj",), "down_proj": ("down_proj",)}[fused]
    return torch.cat([expected[_hf_name(layer, p)] for p in parts])


def _layers(model):
    for i, layer in enumerate(model.model.layers):
        for fused, module in (("qkv_proj", layer.self_attn.qkv_proj), ("o_proj", layer.self_attn.o_proj),
                              ("gate_up_proj", layer.mlp.gate_up_proj), ("down_proj", layer.mlp.down_proj)):
            yield i, fused, module


def test_fp8_checkpoint_keeps_its_values_and_scales(tmp_path, fp8_here):
    expected = _write_fp8_checkpoint(tmp_path)
    model = loader.load_model(ModelConfig(model=str(tmp_path)), dtype=torch.bfloat16)  # auto: the file's fp8
    for i, fused, module in _layers(model):
        assert isinstance(module.qweight, Fp8Weight), (i, fused)
        assert not hasattr(module, "weight_scale")
        want = _fused(expected, i, fused)
        assert torch.equal(module.qweight.dequantize(), want), (i, fused)  # exact: no requantization


def test_fp8_checkpoint_dequantized_where_there_is_no_fp8(tmp_path):
    expected = _write_fp8_checkpoint(tmp_path)
    model = loader.load_model(ModelConfig(model=str(tmp_path)), dtype=torch.float32)  # the CPU: auto
    for i, fused, module in _layers(model):
        assert module.qweight is None
        assert torch.allclose(module.weight.float(), _fused(expected, i, fused), rtol=1e-6, atol=0)


def test_block_wise_fp8_checkpoint_refused(tmp_path):
    from pagedserve.contracts.errors import ModelLoadError

    _write_fp8_checkpoint(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"]["weight_block_size"] = [128, 128]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="block-wise FP8"):
        loader.load_model(ModelConfig(model=str(tmp_path)))
