"""Tiny random base models and PEFT adapters for the LoRA tests, made with transformers + peft
(the reference this server is checked against); nothing is downloaded."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import torch

from loadtest.tiny_model import TINY_CONFIG

BASE_CONFIG = {**TINY_CONFIG, "tie_word_embeddings": False}
ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def save_base(path: Path, cfg: dict = BASE_CONFIG, seed: int = 3):
    """The base checkpoint (safetensors + the default model's tokenizer.json); returns the HF model."""
    from engine.tokenizer import Tokenizer
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
