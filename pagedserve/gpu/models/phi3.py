"""Phi-3 and Phi-4-mini (``Phi3ForCausalLM``): a Llama whose checkpoint fuses q/k/v and gate/up.

The fused tensors are cut back into their parts on load, so each part is sharded the way the
Llama layers shard it (heads for q/k/v, rows for gate/up) under tensor parallelism. Partial
rotary (``partial_rotary_factor``, Phi-4-mini: 0.75) and LongRoPE (gpu/models/rotary.py) are the
rotary table's; a configured ``sliding_window`` (Phi-3-mini: 2047) masks every layer.
"""
from __future__ import annotations

import torch

from pagedserve.gpu.models.llama import LlamaForCausalLM
from pagedserve.gpu.models.stages import MissingLayer


def _rows(start: int, size: int):
    def cut(t: torch.Tensor) -> torch.Tensor:
        return t.narrow(0, start, size)
    cut.row_cut = True  # the GGUF loader may apply it to a packed weight's tensors (gguf_packed.py)
    return cut


class Phi3ForCausalLM(LlamaForCausalLM):
    VARIANTS = {"Phi3ForCausalLM": (False, False, False)}
    windowed = True  # the sliding window below is honoured

    def __init__(self, cfg: dict, architecture: str = "Phi3ForCausalLM"):
        cfg = dict(cfg)
        params = cfg.get("rope_parameters") or {}
        if cfg.get("partial_rotary_factor") is None and params.get("partial_rotary_factor") is not None:
            cfg["partial_rotary_factor"] = params["partial_rotary_factor"]  # transformers 5 keeps it there
        super().__init__(cfg, architecture)
        window = cfg.get("sliding_window")
        if window and window < int(cfg.get("max_position_embeddings") or 0):
            self.cuda_graphs = False  # the windowed path loops over the step's requests on the host
            for layer in self.model.layers:
                if not isinstance(layer, MissingLayer):
                    layer.self_attn.attn.sliding_window = int(window)
        hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or hidden // heads
        kv_heads = cfg.get("num_key_value_heads") or heads
        q, kv, inter = heads * head_dim, kv_heads * head_dim, cfg["intermediate_size"]
        self._fused_parts = {
            "qkv_proj": [("q", _rows(0, q)), ("k", _rows(q, kv)), ("v", _rows(q + kv, kv))],
            "gate_up_proj": [(0, _rows(0, inter)), (1, _rows(inter, inter))],
        }

    def map_weight_name(self, name: str):
        parts = name.rsplit(".", 2)
        if len(parts) == 3 and parts[1] in self._fused_parts:
            if not self.stage.whole and not self._on_this_stage(name):
                return None
            return [(name, shard, cut) for shard, cut in self._fused_parts[parts[1]]]
        return super().map_weight_name(name)
