"""Tiny random base models and PEFT adapters for the LoRA tests, made with transformers + peft
(the reference this server is checked against); nothing is downloaded."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import torch

from pagedserve.loadtest.tiny_model import TINY_CONFIG

BASE_CONFIG = {**TINY_CONFIG, "tie_word_embeddings": False}
ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def save_base(path: Path, cfg: dict = BASE_CONFIG, seed: int = 3):
    """The base checkpoint (safetensors + the default model's tokenizer.json); returns the HF model."""
    from pagedserve.engine.tokenizer import Tokenizer
    from tests.gpu.test_models import save_hf_model

    model = save_hf_model(cfg, path, seed=seed)
    Tokenizer.from_model()._tok.save(str(Path(path) / "tokenizer.json"))
    return model


def save_adapter(base, path: Path, r: int = 8, alpha: float = 16, targets=ALL_TARGETS,
                 rslora: bool = False, seed: int = 0, **extra) -> Path:
    """A random PEFT LoRA adapter with B != 0 (init_lora_weights=False), saved as safetensors."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), use_rslora=rslora,
                     init_lora_weights=False, **extra)
    model = get_peft_model(copy.deepcopy(base), cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:  # random, at a size that moves the logits without swamping them
                p.normal_(0.0, 0.15)
    model.save_pretrained(str(path))
    return Path(path)


def peft_model(base, adapter_path):
    from peft import PeftModel

    return PeftModel.from_pretrained(copy.deepcopy(base), str(adapter_path)).eval()


@torch.no_grad()
def reference_greedy(model, prompt_ids: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens and each step's log-softmax (fp32), by full forwards of the reference."""
    ids = list(prompt_ids)
    tokens, logprobs = [], []
    for _ in range(n):
        logits = model(torch.tensor([ids])).logits[0, -1].float()
        lp = torch.log_softmax(logits, -1)
        t = int(lp.argmax())
        tokens.append(t)
        logprobs.append(lp)
        ids.append(t)
    return tokens, logprobs


def edit_config(path: Path, **changes) -> None:
    cfg_path = Path(path) / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(changes)
    cfg_path.write_text(json.dumps(cfg))


TINY_HF = {"hidden_size": 8, "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 16,
           "num_hidden_layers": 2, "vocab_size": 300}


def write_adapter_files(path: Path, hf_config: dict = TINY_HF, r: int = 2, modules=("q_proj", "v_proj"),
                        config: dict | None = None, extra_tensors: dict | None = None,
                        shapes: dict | None = None) -> Path:
    """A PEFT-layout adapter written by hand (numpy + safetensors, no model): for the engine's
    fakes and the checks of malformed adapters. ``shapes`` overrides a tensor's shape by key."""
    import numpy as np
    from safetensors.numpy import save_file

    from pagedserve.contracts.lora import TARGET_MODULES, module_shapes

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    dims = module_shapes(hf_config)
    rng = np.random.default_rng(0)
    tensors = {}
    for layer in range(hf_config["num_hidden_layers"]):
        for m in modules:
            fan_in, fan_out = dims[m]
            prefix = f"base_model.model.model.layers.{layer}.{TARGET_MODULES[m]}.{m}"
            tensors[f"{prefix}.lora_A.weight"] = rng.standard_normal((r, fan_in)).astype(np.float32)
            tensors[f"{prefix}.lora_B.weight"] = rng.standard_normal((fan_out, r)).astype(np.float32)
    for key, shape in (shapes or {}).items():
        tensors[key] = rng.standard_normal(shape).astype(np.float32)
    tensors.update(extra_tensors or {})
    save_file(tensors, str(path / "adapter_model.safetensors"))
    cfg = {"peft_type": "LORA", "r": r, "lora_alpha": 2 * r, "target_modules": list(modules), "bias": "none",
           "use_rslora": False, "use_dora": False}
    cfg.update(config or {})
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    return path
