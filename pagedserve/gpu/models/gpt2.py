"""GPT-2: learned positions, pre-LayerNorm blocks, GELU (tanh) MLP, tied LM head.

Checkpoints store linear weights in Conv1D layout ``[in, out]``; they are transposed on load,
and the fused ``c_attn`` is split into q/k/v so the qkv layer can shard it by heads.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.gpu.models.attention import Attention
from pagedserve.contracts.errors import ModelLoadError
from pagedserve.gpu.models.stages import MissingLayer, StageActivations, StagePlan
from pagedserve.gpu.models.layers import (ColumnParallelLinear, LayerNorm, ParallelLMHead, QKVParallelLinear,
                               RowParallelLinear, VocabParallelEmbedding)

_ACTIVATIONS = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu_fast": "tanh", "gelu": "none"}


class GPT2Block(nn.Module):
    def __init__(self, cfg: dict, layer_idx: int):
        super().__init__()
        hidden, heads = cfg["n_embd"], cfg["n_head"]
        inner = cfg.get("n_inner") or 4 * hidden
        eps = float(cfg.get("layer_norm_epsilon", 1e-5))
        self.head_dim = hidden // heads
        self.ln_1 = LayerNorm(hidden, eps)
        self.attn = nn.Module()
        self.attn.c_attn = QKVParallelLinear(hidden, self.head_dim, heads, heads, bias=True)
        self.attn.c_proj = RowParallelLinear(hidden, hidden, bias=True)
        self.num_heads = self.attn.c_attn.num_heads
        self.q_size = self.num_heads * self.head_dim
        scale = self.head_dim ** -0.5 if cfg.get("scale_attn_weights", True) else 1.0
        if cfg.get("scale_attn_by_inverse_layer_idx"):
            scale /= float(layer_idx + 1)
        self.attn.attn = Attention(self.num_heads, self.num_heads, self.head_dim, scale, layer_idx)
        self.ln_2 = LayerNorm(hidden, eps)
        self.mlp = nn.Module()
        self.mlp.c_fc = ColumnParallelLinear(hidden, inner, bias=True)
        self.mlp.c_proj = RowParallelLinear(inner, hidden, bias=True)
        act = cfg.get("activation_function", "gelu_new")
        if act not in _ACTIVATIONS:
            raise ModelLoadError(f"unsupported GPT-2 activation {act!r}; supported: {', '.join(_ACTIVATIONS)}")
        self.approximate = _ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln_1(x)
        q, k, v = self.attn.c_attn(h).split(self.q_size, dim=-1)
        x = x + self.attn.c_proj(self.attn.attn(q, k, v))
        h = F.gelu(self.mlp.c_fc(self.ln_2(x)), approximate=self.approximate)
        return x + self.mlp.c_proj(h)


class GPT2LMHeadModel(nn.Module):
    def __init__(self, cfg: dict, architecture: str = "GPT2LMHeadModel"):
        super().__init__()
        self.config = cfg
        hidden = cfg["n_embd"]
        self.tie_word_embeddings = bool(cfg.get("tie_word_embeddings", True))
        # On a pipeline stage only its blocks exist (gpu/models/stages.py).
        self.stage = plan = StagePlan.current(cfg["n_layer"])
        self.transformer = nn.Module()
        keep_wte = plan.first or (plan.last and self.tie_word_embeddings)
        self.transformer.wte = VocabParallelEmbedding(cfg["vocab_size"], hidden) if keep_wte else MissingLayer()
        self.transformer.wpe = (VocabParallelEmbedding(cfg["n_positions"], hidden) if plan.first
                                else MissingLayer())
        self.transformer.h = nn.ModuleList(GPT2Block(cfg, i) if plan.owns_layer(i) else MissingLayer()
                                           for i in range(cfg["n_layer"]))
        self._own_blocks = list(self.transformer.h)[plan.start:plan.end]
        self.transformer.ln_f = (LayerNorm(hidden, float(cfg.get("layer_norm_epsilon", 1e-5))) if plan.last
                                 else MissingLayer())
        self.lm_head = ParallelLMHead(cfg["vocab_size"], hidden) if plan.last else MissingLayer()
        if self.tie_word_embeddings and plan.last:
            self.lm_head.tie(self.transformer.wte)
        self.num_layers = cfg["n_layer"]
        self.num_kv_heads = self.transformer.h[plan.start].num_heads
        self.head_dim = self.transformer.h[plan.start].head_dim
        self._hidden = hidden
        self.max_positions = int(cfg["n_positions"])  # the learned position table's length

    def profile_activations(self, num_tokens: int, dtype: torch.dtype, device) -> StageActivations:
        """What a stage without the embedding receives, as zeros (the start-up profile forward)."""
        return StageActivations(torch.zeros(num_tokens, self._hidden, dtype=dtype, device=device))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate: StageActivations | None = None):
        """The final hidden states; on a stage before the last, its StageActivations instead."""
        t = self.transformer
        x = t.wte(input_ids) + t.wpe(positions) if intermediate is None else intermediate.hidden
        for block in self._own_blocks:
            x = block(x)
        if not self.stage.last:
            return StageActivations(x)
        return t.ln_f(x)

    def compute_logits(self, hidden: torch.Tensor, fp32: bool = True) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden, fp32)

    def map_weight_name(self, name: str):
        if name.endswith((".attn.bias", ".attn.masked_bias")):
            return None  # causal-mask buffers of old checkpoints
        if name == "lm_head.weight":
            return None if self.tie_word_embeddings or not self.stage.last else [(name, None, None)]
        if not name.startswith("transformer."):
            name = "transformer." + name  # checkpoints saved from GPT2Model lack the prefix
        if not self.stage.whole and not self._on_this_stage(name):
            return None
        if name.endswith(".attn.c_attn.weight") or name.endswith(".attn.c_attn.bias"):
            h = self._hidden
            conv = name.endswith(".weight")

            def piece(i):
                def cut(t: torch.Tensor) -> torch.Tensor:
                    return (t.t() if conv else t)[i * h:(i + 1) * h]
                return cut
            return [(name, s, piece(i)) for i, s in enumerate(("q", "k", "v"))]
        if name.endswith((".c_proj.weight", ".c_fc.weight")):
            return [(name, None, lambda t: t.t())]
        return [(name, None, None)]

    def _on_this_stage(self, name: str) -> bool:
        for part in ("wte", "wpe", "ln_f"):
            if name.startswith(f"transformer.{part}."):
                return not isinstance(getattr(self.transformer, part), MissingLayer)
        return self.stage.owns_weight(name)
