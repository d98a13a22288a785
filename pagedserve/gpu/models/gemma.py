"""Gemma 2 and Gemma 3 (text): Llama's shape with Gemma's differences, as config switches.

- RMSNorm scales by ``1 + w`` (the checkpoint stores w), computed in fp32 then cast;
- the embedding is multiplied by sqrt(hidden) (rounded to the activations' dtype, as HF does);
- GeGLU MLP (gelu-tanh) and four norms a layer: input, post-attention, pre- and post-feedforward;
- queries scaled by ``query_pre_attn_scalar ** -0.5``, not head_dim's;
- sliding-window layers interleaved with global ones (``layer_types``), Gemma 2's tanh
  soft-capping of attention scores and of the final logits (kernels.window_attention);
- Gemma 3: per-head q/k norms and two rotary tables (local layers: ``rope_local_base_freq``,
  global layers: ``rope_theta`` with its scaling).

The residual stream is carried like Llama's (fused add + norm), so pipeline stages hand over the
same StageActivations.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.contracts.errors import ModelLoadError
from pagedserve.gpu.models.attention import Attention
from pagedserve.gpu.models.llama import map_hf_name
from pagedserve.gpu.models.layers import (MergedColumnParallelLinear, ParallelLMHead, QKVParallelLinear, RMSNorm,
                               RowParallelLinear, VocabParallelEmbedding)
from pagedserve.gpu.models.rotary import RotaryEmbedding, rope_params_from_config
from pagedserve.gpu.models.stages import MissingLayer, StageActivations, StagePlan
from pagedserve.gpu.parallel_state import is_last_stage

_GELU = {"gelu_pytorch_tanh": "tanh", "gelu_new": "tanh", "gelu_fast": "tanh", "gelu": "none"}
SLIDING, FULL = "sliding_attention", "full_attention"
_VISION = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


class GemmaRMSNorm(RMSNorm):
    """RMSNorm with the scale ``1 + w``: the fused CPU op and the torch fall-back both read it
    from ``_weight_f32`` (w itself stays as loaded, so bf16 checkpoints lose nothing to 1 + w)."""

    def _weight_f32(self) -> torch.Tensor:
        w = self.weight
        key = (w.data_ptr(), w._version)
        if self._w32_key != key:
            self._w32 = (1.0 + w.detach().float()).contiguous()
            self._w32_key = key
        return self._w32

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), (x.shape[-1],), self._weight_f32(), self.eps).to(x.dtype)


class GeluAndMul(nn.Module):
    """gelu(gate) * up over the two halves of a fused gate/up output."""

    def __init__(self, approximate: str):
        super().__init__()
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate=self.approximate).mul_(up)


def layer_types(cfg: dict) -> list[str]:
    """Each layer's attention kind; old configs give only a period (Gemma 2: every other layer
    sliding; Gemma 3: ``sliding_window_pattern``, default 6, the last of each period global)."""
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if types:
        if len(types) != n or set(types) - {SLIDING, FULL}:
            raise ModelLoadError(f"layer_types must list {n} of {SLIDING!r} / {FULL!r}, got {types!r}")
        return list(types)
    period = 2 if cfg.get("model_type") == "gemma2" else int(cfg.get("sliding_window_pattern") or 6)
    return [SLIDING if (i + 1) % period else FULL for i in range(n)]


def _rope(cfg: dict, kind: str, head_dim: int) -> RotaryEmbedding:
    """The rotary table of one layer kind. Gemma 3 keeps one rope dict per kind in
    ``rope_parameters`` (transformers 5) or ``rope_local_base_freq`` beside rope_theta/rope_scaling."""
    params = cfg.get("rope_parameters") or {}
    if cfg.get("model_type") == "gemma3" and isinstance(params.get(kind), dict):
        theta, scaling = rope_params_from_config({"rope_parameters": params[kind]})
    elif cfg.get("model_type") == "gemma3" and kind == SLIDING:
        theta, scaling = float(cfg.get("rope_local_base_freq") or 10000.0), None
    else:
        theta, scaling = rope_params_from_config(cfg)
        if cfg.get("model_type") == "gemma3" and cfg.get("rope_theta") is None and not params:
            theta = 1_000_000.0  # Gemma 3's default global base
    return RotaryEmbedding(head_dim, head_dim, int(cfg.get("max_position_embeddings") or 8192), theta, scaling)


class GemmaAttentionBlock(nn.Module):
    def __init__(self, cfg: dict, layer_idx: int, kind: str, rope_index: int, rotary_emb: RotaryEmbedding):
        super().__init__()
        hidden, num_heads = cfg["hidden_size"], cfg["num_attention_heads"]
        num_kv_heads = cfg.get("num_key_value_heads") or num_heads
        head_dim = cfg.get("head_dim") or hidden // num_heads
        bias = bool(cfg.get("attention_bias", False))
        self.qkv_proj = QKVParallelLinear(hidden, head_dim, num_heads, num_kv_heads, bias=bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = head_dim
        self.q_size, self.kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim
        self.o_proj = RowParallelLinear(num_heads * head_dim, hidden, bias=bias)
        self.rope_index, self.rotary_emb = rope_index, rotary_emb
        eps = float(cfg.get("rms_norm_eps") or 1e-6)
        qk_norm = cfg.get("model_type") == "gemma3"
        self.q_norm = GemmaRMSNorm(head_dim, eps) if qk_norm else None
        self.k_norm = GemmaRMSNorm(head_dim, eps) if qk_norm else None
        scale = float(cfg.get("query_pre_attn_scalar") or head_dim) ** -0.5
        window = int(cfg["sliding_window"]) if kind == SLIDING and cfg.get("sliding_window") else None
        self.attn = Attention(self.num_heads, self.num_kv_heads, head_dim, scale, layer_idx, sliding_window=window,
                              logit_softcap=cfg.get("attn_logit_softcapping"))

    def forward(self, ropes: list[tuple], x: torch.Tensor) -> torch.Tensor:
        T = x.shape[0]
        rope = ropes[self.rope_index]
        qkv = self.qkv_proj.forward(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None:
            q = self.rotary_emb.apply_(self.q_norm.forward(q.reshape(T, self.num_heads, self.head_dim)), rope)
            k = self.rotary_emb.apply_(self.k_norm.forward(k.reshape(T, self.num_kv_heads, self.head_dim)), rope)
        else:
            qk = qkv[:, : self.q_size + self.kv_size].view(T, self.num_heads + self.num_kv_heads, self.head_dim)
            self.rotary_emb.apply_(qk, rope)  # q and k heads adjacent: one in-place pass
        return self.o_proj.forward(self.attn.forward(q.reshape(T, -1), k.reshape(T, -1), v))


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg: dict, layer_idx: int, kind: str, rope_index: int, rotary_emb: RotaryEmbedding):
        super().__init__()
        hidden, eps = cfg["hidden_size"], float(cfg.get("rms_norm_eps") or 1e-6)
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.self_attn = GemmaAttentionBlock(cfg, layer_idx, kind, rope_index, rotary_emb)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
        if act not in _GELU:
            raise ModelLoadError(f"unsupported Gemma activation {act!r}; supported: {', '.join(_GELU)}")
        self.mlp = nn.Module()
        self.mlp.gate_up_proj = MergedColumnParallelLinear(hidden, [cfg["intermediate_size"]] * 2)
        self.mlp.act = GeluAndMul(_GELU[act])
        self.mlp.down_proj = RowParallelLinear(cfg["intermediate_size"], hidden)

    def forward(self, ropes: list[tuple], x: torch.Tensor, residual: torch.Tensor | None):
        """(mlp output, residual): the next layer's input norm adds them, as Llama's does."""
        if residual is None:
            residual = x
            x = self.input_layernorm.forward(x)
        else:
            x, residual = self.input_layernorm.forward(x, residual)
        x = self.post_attention_layernorm.forward(self.self_attn.forward(ropes, x))
        x, residual = self.pre_feedforward_layernorm.forward(x, residual)
        mlp = self.mlp
        x = mlp.down_proj.forward(mlp.act.forward(mlp.gate_up_proj.forward(x)))
        return self.post_feedforward_layernorm.forward(x), residual


class GemmaModel(nn.Module):
    def __init__(self, cfg: dict, keep_embedding: bool):
        super().__init__()
        num_layers, hidden = cfg["num_hidden_layers"], cfg["hidden_size"]
        self.stage = plan = StagePlan.current(num_layers)
        self.embed_tokens = (VocabParallelEmbedding(cfg["vocab_size"], hidden) if plan.first or keep_embedding
                             else MissingLayer())
        self.embed_scale = hidden ** 0.5
        head_dim = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
        kinds = layer_types(cfg)
        # One table per distinct rotary (Gemma 2: one; Gemma 3: local and global), built once.
        order = sorted(set(kinds)) if cfg.get("model_type") == "gemma3" else [FULL]
        self.rotaries = nn.ModuleList(_rope(cfg, kind, head_dim) for kind in order)
        index = {kind: (order.index(kind) if kind in order else 0) for kind in (SLIDING, FULL)}
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(cfg, i, kinds[i], index[kinds[i]], self.rotaries[index[kinds[i]]])
            if plan.owns_layer(i) else MissingLayer() for i in range(num_layers))
        self._own_layers = list(self.layers)[plan.start:plan.end]
        self.norm = GemmaRMSNorm(hidden, float(cfg.get("rms_norm_eps") or 1e-6)) if plan.last else MissingLayer()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate: StageActivations | None = None):
        if intermediate is None:
            x = self.embed_tokens.forward(input_ids)
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype, device=x.device)
            residual = None
        else:
            x, residual = intermediate.hidden, intermediate.residual
        ropes = [rotary.prepare(positions, x.dtype) for rotary in self.rotaries]
        for layer in self._own_layers:
            x, residual = layer.forward(ropes, x, residual)
        if not self.stage.last:
            return StageActivations(x, residual)
        x, _ = self.norm.forward(x, residual)
        return x


class GemmaForCausalLM(nn.Module):
    """Gemma2ForCausalLM and Gemma3ForCausalLM (the architecture name picks the variant)."""

    cuda_graphs = False  # windowed / soft-capped attention loops over the step's requests on the host

    def __init__(self, cfg: dict, architecture: str = "Gemma2ForCausalLM"):
        super().__init__()
        # The variant comes from the architecture ("gemma3_text" checkpoints included).
        cfg = dict(cfg, model_type="gemma3" if architecture.startswith("Gemma3") else "gemma2")
        if cfg.get("use_bidirectional_attention"):
            raise ModelLoadError(f"{architecture} with use_bidirectional_attention (an embedding model) is not "
                                 "supported for generation")
        self.config = cfg
        self.tie_word_embeddings = bool(cfg.get("tie_word_embeddings", True))
        self.model = GemmaModel(cfg, keep_embedding=self.tie_word_embeddings and is_last_stage())
        self.stage = self.model.stage
        self.lm_head = ParallelLMHead(cfg["vocab_size"], cfg["hidden_size"]) if self.stage.last else MissingLayer()
        if self.tie_word_embeddings and self.stage.last:
            self.lm_head.tie(self.model.embed_tokens)
        self.final_softcap = cfg.get("final_logit_softcapping") or None
        first = self.model.layers[self.stage.start].self_attn
        self.num_layers = len(self.model.layers)
        self.num_kv_heads, self.head_dim = first.num_kv_heads, first.head_dim
        self.max_positions = self.model.rotaries[0].cos_sin_cache.shape[0]

    def profile_activations(self, num_tokens: int, dtype: torch.dtype, device) -> StageActivations:
        shape = (num_tokens, self.config["hidden_size"])
        return StageActivations(torch.zeros(shape, dtype=dtype, device=device),
                                torch.zeros(shape, dtype=dtype, device=device))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate: StageActivations | None = None):
        return self.model(input_ids, positions, intermediate)

    def compute_logits(self, hidden: torch.Tensor, fp32: bool = True) -> torch.Tensor:
        logits = self.lm_head.compute_logits(hidden, fp32)
        if self.final_softcap:
            cap = float(self.final_softcap)
            logits = torch.tanh(logits / cap) * cap
        return logits

    def map_weight_name(self, name: str):
        if name.startswith(_VISION):
            return None  # Gemma3ForConditionalGeneration served text-only: no vision tower
        for prefix in ("language_model.model.", "model.language_model."):
            if name.startswith(prefix):
                name = "model." + name[len(prefix):]
        if name.startswith("language_model.lm_head."):
            name = name[len("language_model."):]
        return map_hf_name(self, name)
