"""PEFT adapters are checked at load time: each way an adapter can be wrong is a clear error
naming it (contracts/lora.py), never a crash inside a step."""
from __future__ import annotations

import json
import math

import pytest

from pagedserve.contracts.lora import LoRAAdapterError, read_adapter
from tests.lora_fixtures import TINY_HF, write_adapter_files

A_KEY = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"


def test_a_good_adapter_gives_rank_scaling_and_modules(tmp_path):
    spec = read_adapter(str(write_adapter_files(tmp_path / "a", r=4)), TINY_HF, max_rank=8)
    assert (spec.rank, spec.scaling) == (4, 2.0)  # lora_alpha 8 / r 4
    assert {(m.layer, m.module) for m in spec.modules} == {(0, "q_proj"), (0, "v_proj"), (1, "q_proj"), (1, "v_proj")}
    rs = read_adapter(str(write_adapter_files(tmp_path / "rs", r=4, config={"use_rslora": True})), TINY_HF, 8)
    assert math.isclose(rs.scaling, 8 / math.sqrt(4))


BAD = [
    (dict(config={"use_dora": True}), "DoRA"),
    (dict(extra_tensors=None, shapes={"base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector": (8,)}),
     "DoRA"),
    (dict(r=8), "rank 8 is over --max-lora-rank 4"),
    (dict(shapes={A_KEY: (2, 16)}), r"shape \[2, 16\].*needs \[2, 8\].*another model"),
    (dict(shapes={"base_model.model.model.layers.0.self_attn.foo_proj.lora_A.weight": (2, 8)}),
     "unknown target module self_attn.foo_proj"),
    (dict(shapes={"base_model.model.model.norm.weight": (8,)}), "unknown tensor"),
    (dict(shapes={"base_model.model.model.layers.0.mlp.q_proj.lora_A.weight": (2, 8)}), "unknown target module"),
    (dict(config={"target_modules": ["q_proj", "lm_head"]}), "lm_head is not supported"),
    (dict(config={"target_modules": ["q_proj", "dense_h_to_4h"]}), "unknown target module 'dense_h_to_4h'"),
    (dict(shapes={"base_model.model.lm_head.lora_A.weight": (2, 8)}), "lm_head is not supported"),
    (dict(shapes={"base_model.model.model.embed_tokens.lora_embedding_A": (2, 300)}), "embed_tokens is not supported"),
    (dict(shapes={"base_model.model.model.layers.5.self_attn.q_proj.lora_A.weight": (2, 8)}),
     "layer 5 does not exist"),
    (dict(config={"bias": "all"}), "bias='all' is not supported"),
    (dict(config={"peft_type": "IA3"}), "peft_type 'IA3' is not supported"),
    (dict(config={"rank_pattern": {"q_proj": 4}}), "rank_pattern"),
    (dict(config={"modules_to_save": ["lm_head"]}), "modules_to_save"),
    (dict(config={"lora_alpha": "big"}), "lora_alpha"),
]


@pytest.mark.parametrize("kwargs, message", BAD)
def test_bad_adapters_are_refused_naming_what_is_wrong(tmp_path, kwargs, message):
    path = write_adapter_files(tmp_path / "bad", **kwargs)
    with pytest.raises(LoRAAdapterError, match=message):
        read_adapter(str(path), TINY_HF, max_rank=4)


def test_missing_b_and_bad_dtype(tmp_path):
    import numpy as np
    from safetensors.numpy import save_file

    path = write_adapter_files(tmp_path / "a")
    save_file({A_KEY: np.zeros((2, 8), np.float32)}, str(path / "adapter_model.safetensors"))
    with pytest.raises(LoRAAdapterError, match="layer 0 q_proj has no lora_B"):
        read_adapter(str(path), TINY_HF, 4)
    save_file({A_KEY: np.zeros((2, 8), np.int32)}, str(path / "adapter_model.safetensors"))
    with pytest.raises(LoRAAdapterError, match="dtype 'I32' is not supported"):
        read_adapter(str(path), TINY_HF, 4)


def test_files_missing_or_pickled(tmp_path):
    with pytest.raises(LoRAAdapterError, match="not a directory"):
        read_adapter(str(tmp_path / "none"), TINY_HF, 4)
    (tmp_path / "empty").mkdir()
    with pytest.raises(LoRAAdapterError, match="no adapter_config.json"):
        read_adapter(str(tmp_path / "empty"), TINY_HF, 4)
    path = write_adapter_files(tmp_path / "bin")
    (path / "adapter_model.safetensors").rename(path / "adapter_model.bin")
    with pytest.raises(LoRAAdapterError, match="adapter_model.bin.*safetensors"):
        read_adapter(str(path), TINY_HF, 4)
    (path / "adapter_model.safetensors").write_bytes(b"\x05")
    with pytest.raises(LoRAAdapterError, match="not a safetensors file"):
        read_adapter(str(path), TINY_HF, 4)
    (path / "adapter_config.json").write_text("[1]")
    with pytest.raises(LoRAAdapterError, match="JSON object"):
        read_adapter(str(path), TINY_HF, 4)


@pytest.mark.parametrize("peft_kwargs, message", [
    (dict(use_dora=True), "DoRA"),
    (dict(target_modules=["q_proj", "embed_tokens"]), "embed_tokens is not supported"),
    (dict(target_modules=["q_proj"], bias="lora_only"), "bias='lora_only'"),
])
def test_real_peft_adapters_we_do_not_implement_are_refused(tmp_path, peft_kwargs, message):
    """The same refusals on adapters peft itself saved."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(**TINY_HF, max_position_embeddings=64))
    kwargs = {"target_modules": ["q_proj", "v_proj"], **peft_kwargs}
    get_peft_model(base, LoraConfig(r=2, lora_alpha=4, **kwargs)).save_pretrained(str(tmp_path / "p"))
    assert json.loads((tmp_path / "p" / "adapter_config.json").read_text())["r"] == 2
    with pytest.raises(LoRAAdapterError, match=message):
        read_adapter(str(tmp_path / "p"), TINY_HF, 4)
