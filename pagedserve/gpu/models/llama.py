"""The Llama family in one class: Llama 2/3, SmolLM2, Mistral, Qwen2 (q/k/v bias) and Qwen3
(per-head q/k RMSNorm). Differences are config switches, not subclasses.

The forward path calls submodules' ``.forward`` directly: ``nn.Module.__call__`` costs a few
microseconds of hook bookkeeping per call, ~300 calls a step, and no hooks are used here.

Parameter names follow Hugging Face's (``model.layers.N.self_attn...``) except where projections
are fused: q/k/v -> ``qkv_proj``, gate/up -> ``gate_up_proj``.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from pagedserve.gpu.models.attention import Attention
from pagedserve.contracts.errors import ModelLoadError
from pagedserve.gpu.models.layers import (GatedMLP, ParallelLMHead, QKVParallelLinear, RMSNorm, RowParallelLinear,
                               VocabParallelEmbedding)
from pagedserve.gpu.models.rotary import RotaryEmbedding, rope_params_from_config
from pagedserve.gpu.models.stages import MissingLayer, StageActivations, StagePlan
from pagedserve.gpu.parallel_state import is_last_stage

logger = logging.getLogger(__name__)

_STACKED = {
    "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}


def _cfg(cfg: dict, *names, default=None):
    for n in names:
        if cfg.get(n) is not None:
            return cfg[n]
    if default is None:
        raise ModelLoadError(f"model config lacks {names[0]!r}")
    return default


class LlamaAttentionBlock(nn.Module):
    def __init__(self, cfg: dict, layer_idx: int, qkv_bias: bool, o_bias: bool, qk_norm: bool,
                 rotary_emb: RotaryEmbedding):
        super().__init__()
        hidden = cfg["hidden_size"]
        num_heads = cfg["num_attention_heads"]
        num_kv_heads = cfg.get("num_key_value_heads") or num_heads
        head_dim = cfg.get("head_dim") or hidden // num_heads
        self.qkv_proj = QKVParallelLinear(hidden, head_dim, num_heads, num_kv_heads, bias=qkv_bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = head_dim
        self.q_size, self.kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim
        self.o_proj = RowParallelLinear(num_heads * head_dim, hidden, bias=o_bias)
        self.rotary_emb = rotary_emb  # one table shared by every layer
        eps = float(_cfg(cfg, "rms_norm_eps", default=1e-6))
        self.q_norm = RMSNorm(head_dim, eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, eps) if qk_norm else None
        self.attn = Attention(self.num_heads, self.num_kv_heads, head_dim, head_dim ** -0.5, layer_idx)

    def forward(self, rope: tuple, x: torch.Tensor) -> torch.Tensor:
        T = x.shape[0]
        qkv = self.qkv_proj.forward(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None:
            q = self.rotary_emb.apply_(self.q_norm.forward(q.reshape(T, self.num_heads, self.head_dim)), rope)
            k = self.rotary_emb.apply_(self.k_norm.forward(k.reshape(T, self.num_kv_heads, self.head_dim)), rope)
        else:
            # q and k heads are adjacent in the fused output: rotate both in one in-place pass.
            qk = qkv[:, : self.q_size + self.kv_size].view(T, self.num_heads + self.num_kv_heads, self.head_dim)
            self.rotary_emb.apply_(qk, rope)
            q = q.view(T, self.num_heads, self.head_dim)
            k = k.view(T, self.num_kv_heads, self.head_dim)
        return self.o_proj.forward(self.attn.forward(q, k, v))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: dict, layer_idx: int, qkv_bias: bool, o_bias: bool, qk_norm: bool,
                 rotary_emb: RotaryEmbedding, mlp: nn.Module | None = None):
        """``mlp``: the feed-forward block when not the dense gated MLP (a MoE block)."""
        super().__init__()
        eps = float(_cfg(cfg, "rms_norm_eps", default=1e-6))
        self.input_layernorm = RMSNorm(cfg["hidden_size"], eps)
        self.self_attn = LlamaAttentionBlock(cfg, layer_idx, qkv_bias, o_bias, qk_norm, rotary_emb)
        self.post_attention_layernorm = RMSNorm(cfg["hidden_size"], eps)
        self.mlp = mlp if mlp is not None else GatedMLP(cfg["hidden_size"], cfg["intermediate_size"],
                                                        bias=bool(cfg.get("mlp_bias")))

    fast_decode = None  # a gpu.models.fast_decode.FastDecodeLayer: small bf16 batches in two C calls

    def forward(self, rope, x, residual):
        fast = self.fast_decode
        if fast is not None and x.shape[0] <= fast.max_rows:
            out = fast.forward(rope, x, residual)
            if out is not None:
                return out
        if residual is None:
            residual = x
            x = self.input_layernorm.forward(x)
        else:
            x, residual = self.input_layernorm.forward(x, residual)
        x = self.self_attn.forward(rope, x)
        x, residual = self.post_attention_layernorm.forward(x, residual)
        return self.mlp.forward(x), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: dict, qkv_bias: bool, o_bias: bool, qk_norm: bool, keep_embedding: bool = False,
                 make_mlp=None):
        """On a pipeline stage (gpu/models/stages.py) only the stage's layers are built; the
        embedding sits on the first stage (and on the last when ``keep_embedding``: a tied head).
        ``make_mlp(layer_idx)``: a layer's feed-forward block, or None for the dense one."""
        super().__init__()
        num_layers = cfg["num_hidden_layers"]
        self.stage = plan = StagePlan.current(num_layers)
        self.embed_tokens = (VocabParallelEmbedding(cfg["vocab_size"], cfg["hidden_size"])
                             if plan.first or keep_embedding else MissingLayer())
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        theta, scaling = rope_params_from_config(cfg)
        partial = float(cfg.get("partial_rotary_factor") or 1.0)
        rotary = RotaryEmbedding(head_dim, int(head_dim * partial),
                                 int(_cfg(cfg, "max_position_embeddings", default=2048)), theta, scaling)
        self.rotary = rotary
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, i, qkv_bias, o_bias, qk_norm, rotary, make_mlp(i) if make_mlp else None)
            if plan.owns_layer(i) else MissingLayer() for i in range(num_layers))
        self._own_layers = list(self.layers)[plan.start:plan.end]
        self.norm = (RMSNorm(cfg["hidden_size"], float(_cfg(cfg, "rms_norm_eps", default=1e-6)))
                     if plan.last else MissingLayer())

    fast_stack = None  # a gpu.models.fast_decode.FastDecodeStack: decode-only steps in one C call

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate: StageActivations | None = None):
        """The final hidden states; on a stage before the last, its StageActivations instead."""
        if intermediate is None:
            x = self.embed_tokens.forward(input_ids)
            residual = None
        else:
            x, residual = intermediate.hidden, intermediate.residual
        rope = self.rotary.prepare(positions, x.dtype)  # shared by every layer
        done = self.fast_stack.forward(rope, x, residual) if self.fast_stack is not None else None
        if done is not None:
            x, residual = done
        else:
            for layer in self._own_layers:
                x, residual = layer.forward(rope, x, residual)
        if not self.stage.last:
            return StageActivations(x, residual)
        x, _ = self.norm.forward(x, residual)
        return x


class LlamaForCausalLM(nn.Module):
    # Per-architecture switches: (q/k/v bias, o_proj bias, per-head q/k norm); None = the
    # config's attention_bias.
    VARIANTS = {
        "LlamaForCausalLM": (None, None, False),
        "MistralForCausalLM": (False, False, False),
        "Qwen2ForCausalLM": (True, False, False),
        "Qwen3ForCausalLM": (None, None, True),
    }

    windowed = False  # a subclass that applies the config's sliding_window sets True (gpu/models/phi3.py)
    cuda_graphs = True  # decode steps may be captured (gpu/model_runner.py)

    def __init__(self, cfg: dict, architecture: str = "LlamaForCausalLM"):
        super().__init__()
        self.config = cfg
        qkv_bias, o_bias, qk_norm = self.VARIANTS.get(architecture, (None, None, False))
        attention_bias = bool(cfg.get("attention_bias", False))
        qkv_bias = attention_bias if qkv_bias is None else qkv_bias
        o_bias = attention_bias if o_bias is None else o_bias
        window = cfg.get("sliding_window")
        if (window and not self.windowed and cfg.get("use_sliding_window", True)
                and window < cfg.get("max_position_embeddings", 0)):
            logger.warning("%s: sliding-window attention (%d tokens) is not implemented; attention is "
                           "full, so outputs differ from the reference past %d tokens", architecture, window,
                           window)
        self.tie_word_embeddings = bool(cfg.get("tie_word_embeddings", False))
        self.model = LlamaModel(cfg, qkv_bias, o_bias, qk_norm, keep_embedding=self.tie_word_embeddings
                                and is_last_stage(), make_mlp=self.make_mlp)
        self.stage = self.model.stage
        self.lm_head = (ParallelLMHead(cfg["vocab_size"], cfg["hidden_size"]) if self.stage.last
                        else MissingLayer())
        if self.tie_word_embeddings and self.stage.last:
            self.lm_head.tie(self.model.embed_tokens)
        first = self.model.layers[self.stage.start].self_attn
        self.num_layers = len(self.model.layers)
        self.num_kv_heads = first.num_kv_heads
        self.head_dim = first.head_dim
        self.max_positions = self.model.rotary.cos_sin_cache.shape[0]  # rows of the rotary table

    def make_mlp(self, layer_idx: int) -> nn.Module | None:
        """A layer's feed-forward block when not the dense gated MLP (gpu/models/moe_models.py)."""
        return None

    def profile_activations(self, num_tokens: int, dtype: torch.dtype, device) -> StageActivations:
        """What a stage without the embedding receives, as zeros (the start-up profile forward):
        the hidden states and the residual stream."""
        shape = (num_tokens, self.config["hidden_size"])
        return StageActivations(torch.zeros(shape, dtype=dtype, device=device),
                                torch.zeros(shape, dtype=dtype, device=device))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate: StageActivations | None = None):
        return self.model(input_ids, positions, intermediate)

    def compute_logits(self, hidden: torch.Tensor, fp32: bool = True) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden, fp32)

    def map_weight_name(self, name: str):
        return map_hf_name(self, name)

    def _on_this_stage(self, name: str) -> bool:
        return on_this_stage(self, name)


def map_hf_name(model: nn.Module, name: str):
    """A Llama-style checkpoint name -> [(parameter, shard id, None)] (q/k/v and gate/up into
    their fused parameters), or None for what ``model`` does not hold: rotary buffers, a tied
    head, another pipeline stage's tensors. Shared by the models laid out like Llama (gemma.py)."""
    if "rotary_emb." in name or name.endswith((".cos_cached", ".sin_cached")):
        return None
    if name == "lm_head.weight" and model.tie_word_embeddings:
        return None  # the tied embedding is loaded under its own name
    if not model.stage.whole and not on_this_stage(model, name):
        return None
    parts = name.rsplit(".", 2)  # [..., proj, weight|bias]
    if len(parts) == 3 and parts[1] in _STACKED:
        fused, shard = _STACKED[parts[1]]
        return [(f"{parts[0]}.{fused}.{parts[2]}", shard, None)]
    return [(name, None, None)]


def on_this_stage(model: nn.Module, name: str) -> bool:
    """Whether checkpoint tensor ``name`` belongs to the pipeline stage ``model`` was built for."""
    if name.startswith("model.embed_tokens."):
        return not isinstance(model.model.embed_tokens, MissingLayer)
    if name.startswith(("model.norm.", "lm_head.")):
        return model.stage.last
    return model.stage.owns_weight(name)
