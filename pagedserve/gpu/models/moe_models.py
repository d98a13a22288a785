"""Qwen3-MoE and Mixtral: the Llama body (Qwen3's q/k norms, Mistral's plain attention) with
SparseMoeBlock feed-forwards (gpu/models/moe.py) on the sparse layers.

Checkpoint names: Qwen3-MoE's ``mlp.gate`` (router) and ``mlp.experts.E.{gate,up,down}_proj``;
Mixtral's ``block_sparse_moe.gate`` and ``block_sparse_moe.experts.E.{w1,w3,w2}`` (gate, up,
down); or transformers 5's stacked ``mlp.experts.gate_up_proj`` / ``mlp.experts.down_proj``; or a
GGUF file's all-experts tensors of one projection, ``mlp.experts.{gate,up,down}_proj.weight``
[E, rows, cols] under gpu/models/gguf_loader.py's names (cut expert by expert).
"""
from __future__ import annotations

import re

from torch import nn

from pagedserve.contracts.errors import ModelLoadError
from pagedserve.gpu.models.llama import LlamaForCausalLM
from pagedserve.gpu.models.moe import SparseMoeBlock

_EXPERT = re.compile(r"^(?P<layer>.+)\.(?:mlp|block_sparse_moe)\.experts\.(?P<expert>\d+)\.(?P<proj>\w+)\.weight$")
_STACKED = re.compile(r"^(?P<layer>.+)\.mlp\.experts\.(?P<proj>gate_up_proj|down_proj)$")
_GGUF_STACKED = re.compile(r"^(?P<layer>.+)\.mlp\.experts\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
_PROJ = {"gate_proj": ("w13", 0), "up_proj": ("w13", 1), "down_proj": ("w2", None),
         "w1": ("w13", 0), "w3": ("w13", 1), "w2": ("w2", None)}


def _expert_slice(t, expert: int, experts: int):
    if t.dim() != 3 or t.shape[0] != experts:
        raise ModelLoadError(f"an all-experts tensor of shape {tuple(t.shape)}: expected {experts} experts first")
    return t[expert]


class MoeForCausalLM(LlamaForCausalLM):
    VARIANTS = {"Qwen3MoeForCausalLM": (None, None, True), "MixtralForCausalLM": (False, False, False)}

    def __init__(self, cfg: dict, architecture: str = "Qwen3MoeForCausalLM"):
        self._qwen = architecture == "Qwen3MoeForCausalLM"
        super().__init__(cfg, architecture)

    def _sparse(self, layer_idx: int) -> bool:
        cfg = self.config
        if not self._qwen:
            return True
        if layer_idx in (cfg.get("mlp_only_layers") or ()):
            return False
        experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)  # transformers 5 saves the latter
        return experts > 0 and (layer_idx + 1) % int(cfg.get("decoder_sparse_step") or 1) == 0

    def make_mlp(self, layer_idx: int) -> nn.Module | None:
        if not self._sparse(layer_idx):
            return None
        cfg = self.config
        experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
        top_k = int(cfg.get("num_experts_per_tok") or 0)
        if not 0 < top_k <= experts:
            raise ModelLoadError(f"MoE config needs 0 < num_experts_per_tok <= experts, got {top_k} of {experts}")
        inter = cfg.get("moe_intermediate_size") if self._qwen else cfg["intermediate_size"]
        renormalize = bool(cfg.get("norm_topk_prob", False)) if self._qwen else True
        return SparseMoeBlock(cfg["hidden_size"], int(inter), experts, top_k, renormalize)

    def map_weight_name(self, name: str):
        m = _EXPERT.match(name)
        if m:
            if not self.stage.whole and not self._on_this_stage(name):
                return None
            param, part = _PROJ.get(m["proj"], (None, None))
            if param is None:
                return [(name, None, None)]  # no such parameter: the tracker names it
            expert = int(m["expert"])
            return [(f"{m['layer']}.mlp.experts.{param}", (expert, part) if part is not None else expert, None)]
        m = _GGUF_STACKED.match(name)
        if m:
            if not self.stage.whole and not self._on_this_stage(name):
                return None
            param, part = _PROJ[m["proj"]]
            target = f"{m['layer']}.mlp.experts.{param}"
            experts = int(self.config.get("num_experts") or self.config.get("num_local_experts") or 0)
            return [(target, (e, part) if part is not None else e, lambda t, e=e: _expert_slice(t, e, experts))
                    for e in range(experts)]
        m = _STACKED.match(name)
        if m:
            if not self.stage.whole and not self._on_this_stage(name):
                return None
            return [(f"{m['layer']}.mlp.experts.{'w13' if m['proj'] == 'gate_up_proj' else 'w2'}", None, None)]
        if ".block_sparse_moe.gate." in name:
            name = name.replace(".block_sparse_moe.gate.", ".mlp.gate.")
            if not self.stage.whole and not self._on_this_stage(name):
                return None
            return [(name, None, None)]
        return super().map_weight_name(name)
