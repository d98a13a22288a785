"""--lora-dtype: the adapter slots' dtype. "auto" keeps an unquantized model's dtype (fp32 adds exactly
PEFT's fp32 delta) and picks bf16 over quantized base weights with fp32 activations; bf16 slots on an
fp32 model equal PEFT run on the same adapters with their weights rounded to bf16 (the fused C layer
and the torch path both widen them exactly and sum in fp32)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from pagedserve.contracts.config import ConfigError, EngineConfig, LoRAConfig
from pagedserve.engine.lora_request import LoRARequest
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.gpu.lora_worker import base_is_quantized, resolve_lora_dtype
from tests.lora_fixtures import peft_model, reference_greedy, save_adapter, save_base

N_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=N_TOKENS, ignore_eos=True, logprobs=5)
PROMPTS = [[1, 520, 3311, 42, 9001, 77, 1204, 5, 88, 301, 12], [1, 4242, 4243, 300, 12000]]


def test_auto_is_the_model_dtype_except_bf16_over_a_quantized_fp32_base():
    assert resolve_lora_dtype("auto", torch.float32, quantized=False) == torch.float32
    assert resolve_lora_dtype("auto", torch.float32, quantized=True) == torch.bfloat16
    assert resolve_lora_dtype("auto", torch.bfloat16, quantized=False) == torch.bfloat16
    assert resolve_lora_dtype("auto", torch.bfloat16, quantized=True) == torch.bfloat16
    assert resolve_lora_dtype("float32", torch.float32, quantized=True) == torch.float32
    assert resolve_lora_dtype("bfloat16", torch.float32, quantized=False) == torch.bfloat16


def test_quantized_base_is_read_from_the_first_layers_qkv():
    def model(qweight):
        layer = SimpleNamespace(self_attn=SimpleNamespace(qkv_proj=SimpleNamespace(qweight=qweight)))
        return SimpleNamespace(model=SimpleNamespace(layers=[layer]))

    assert base_is_quantized(model(object()))
    assert not base_is_quantized(model(None))
    assert not base_is_quantized(SimpleNamespace())


def test_the_option_is_checked_and_reaches_the_config():
    assert LoRAConfig().lora_dtype == "auto"
    with pytest.raises(ConfigError, match="--lora-dtype"):
        LoRAConfig(lora_dtype="float16")
    assert EngineConfig.from_options(lora_dtype="bfloat16", enable_lora=True).lora.lora_dtype == "bfloat16"

    import argparse

    from pagedserve.app.engine_args import add_engine_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert parser.parse_args(["--lora-dtype", "bfloat16"]).lora_dtype == "bfloat16"
    assert parser.parse_args([]).lora_dtype == "auto"


def _rounded_copy(src: Path, dst: Path) -> Path:
    """The adapter with its A and B rounded to bf16 (stored as fp32): what bf16 slots hold, since the
    fixtures' scalings (alpha / r, alpha / sqrt(r)) are powers of two, which commute with rounding."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    cfg = json.loads((src / "adapter_config.json").read_text())
    scale = cfg["lora_alpha"] / (cfg["r"] ** 0.5 if cfg.get("use_rslora") else cfg["r"])
    assert scale == 2.0 ** round(torch.log2(torch.tensor(scale)).item())
    tensors = load_file(str(src / "adapter_model.safetensors"))
    save_file({k: v.to(torch.bfloat16).to(torch.float32) for k, v in tensors.items()},
              str(dst / "adapter_model.safetensors"))
    return dst


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-dtype")
    base = save_base(root / "base")
    adapters = {"all": save_adapter(base, root / "a-all", r=8, alpha=16, seed=1),
                "attn-rs": save_adapter(base, root / "a-attn-rs", r=16, alpha=8, rslora=True, seed=2,
                                        targets=["q_proj", "v_proj", "o_proj"])}
    return root, base, adapters


@pytest.mark.parametrize("fast_decode_mode", ["1", "0"])
def test_bf16_slots_on_an_fp32_model_match_peft_with_bf16_rounded_adapters(models, monkeypatch, fast_decode_mode):
    """Greedy tokens equal and logprobs within 1e-4 of PEFT on the rounded adapters, through the fused
    C stack (decode steps) and through the per-linear torch path (PAGEDSERVE_FAST_DECODE=0); and not
    what PEFT gives on the unrounded ones (the option is in effect)."""
    from pagedserve.engine.llm import LLM
    from pagedserve.gpu.models import fast_decode

    from tests.gpu.test_lora_peft import _count_fused_lora_steps

    monkeypatch.setenv(fast_decode.ENV, fast_decode_mode)
    calls = _count_fused_lora_steps(monkeypatch)
    root, base, adapters = models
    llm = LLM(model=str(root / "base"), dtype="float32", kv_cache_memory=1 / 16, enable_lora=True, max_loras=2,
              max_lora_rank=16, lora_dtype="bfloat16")
    try:
        for i, (name, path) in enumerate(adapters.items()):
            rounded = peft_model(base, _rounded_copy(path, root / f"{name}-{fast_decode_mode}-bf16"))
            # one stream at a time: the fp32 plain-weight stack takes 1-row decode steps
            outs = [llm.generate([p], GREEDY, use_tqdm=False, lora_request=LoRARequest(name, i + 1, str(path)))[0]
                    for p in PROMPTS]
            exact_fp32_lps = [reference_greedy(peft_model(base, path), p, N_TOKENS)[1] for p in PROMPTS]
            moved = 0.0
            for out, p, fp32_lps in zip(outs, PROMPTS, exact_fp32_lps):
                ref_tokens, ref_lps = reference_greedy(rounded, p, N_TOKENS)
                c = out.outputs[0]
                assert c.token_ids == ref_tokens
                for pos, entry in enumerate(c.logprobs):
                    for token, got in entry.items():
                        assert abs(got.logprob - float(ref_lps[pos][token])) < 1e-4, (name, pos, token)
                        moved = max(moved, abs(got.logprob - float(fp32_lps[pos][token])))
            assert moved > 1e-4, name  # bf16 weights do change the result: the slots were bf16
    finally:
        llm.shutdown()
    if fast_decode_mode == "1":  # every decode step ran the C stack with the bf16 slots
        decode = [ran for rows, ran in calls if rows == 1]
        assert len(decode) >= len(adapters) * len(PROMPTS) * (N_TOKENS - 1) and all(decode), calls
    else:
        assert calls == []
