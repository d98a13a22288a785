"""Small-batch bf16 decode of a Llama layer in two C calls (kernels/csrc/fused_cpu.c).

Why: a batch-1 decode step of the default model spent ~4 of ~20 ms in Python and torch glue
between the dozen C calls each of its 30 layers makes (norm, qkv GEMV, rotary, KV write, o GEMV,
add + norm, gate/up GEMV, SiLU and mul, down GEMV). ``fz_attn_in`` does everything before
attention and ``fz_mlp_out`` everything after, with the same C pieces (so the same roundings);
attention itself stays the one paged-attention dispatch (kernels.attention).

When: CPU, bf16 weights kept plain (our AVX512-BF16 GEMV reads them), batches of at most
``max_rows`` rows, one tensor-parallel rank, a Llama layer without biases or q/k norms. Anything
else (prefill chunks, fp32 machines, quantized weights) takes the eager path. ``PAGEDSERVE_FAST_DECODE=0``
turns it off.
"""
from __future__ import annotations

import logging
import os

import torch
from torch import nn

from gpu.forward_context import get_forward_context
from kernels import fused
from kernels.attention import paged_attention

logger = logging.getLogger(__name__)

ENV = "PAGEDSERVE_FAST_DECODE"


def _plain_bf16(module: nn.Module) -> tuple[torch.Tensor, int] | None:
    """(plain bf16 weight, rows it serves) of an unquantized, bias-free linear layer, or None."""
    if getattr(module, "qweight", None) is not None or getattr(module, "bias", None) is not None:
        return None
    pw = getattr(module, "pweight", None)
    if pw is not None:
        weight, rows = pw.plain, pw.small_rows
    else:
        weight, rows = module.weight, fused.GEMV_MAX_M
    if weight is None or weight.dtype is not torch.bfloat16 or not weight.is_contiguous() or not rows:
        return None
    return weight, min(rows, fused.GEMV_MAX_M)


class FastDecodeLayer:
    """One LlamaDecoderLayer's weights and shapes, bound once; ``forward`` mirrors the layer's."""

    def __init__(self, layer: nn.Module, weights: dict[str, tuple[torch.Tensor, int]]):
        attn = layer.self_attn
        self.layer_idx = attn.attn.layer_idx
        self.scale = attn.attn.scale
        self.q_heads, self.kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.rotary = attn.rotary_emb
        self.in_norm, self.post_norm = layer.input_layernorm, layer.post_attention_layernorm
        self.w_qkv, self.w_o = weights["qkv"][0], weights["o"][0]
        self.w_gu, self.w_down = weights["gate_up"][0], weights["down"][0]
        self.hidden = self.w_o.shape[0]
        self.n_qkv = self.w_qkv.shape[0]
        self.inter = self.w_down.shape[1]
        self.max_rows = min(rows for _, rows in weights.values())

    def forward(self, rope: tuple, x: torch.Tensor, residual: torch.Tensor | None):
        """(out, residual) like LlamaDecoderLayer.forward, or None when this step is not ours."""
        ctx = get_forward_context()
        meta = ctx.attn_metadata
        if meta is None or not ctx.kv_caches or not x.is_contiguous() or rope[2] is None:
            return None  # the profile run, a strided input, or positions the fused rotary cannot read
        lib = fused.library()
        M, H = x.shape
        threads = torch.get_num_threads()
        k_cache, v_cache = ctx.kv_caches[self.layer_idx]
        first = residual is None
        if first:
            residual = torch.empty_like(x)
        qkv = x.new_empty((M, self.n_qkv))
        slots = meta.slot_mapping
        rc = lib.fz_attn_in(x.data_ptr(), residual.data_ptr(), int(not first), self.in_norm._weight_f32().data_ptr(),
                            self.in_norm.eps, M, H, self.w_qkv.data_ptr(), self.n_qkv, qkv.data_ptr(),
                            self.q_heads, self.kv_heads, self.head_dim, self.rotary.rotary_dim,
                            self.rotary.cos_sin_cache.data_ptr(), rope[2].data_ptr(), k_cache.data_ptr(),
                            v_cache.data_ptr(), slots.data_ptr(), k_cache.shape[0] * k_cache.shape[1], threads)
        if rc == -2:
            raise IndexError("KV cache slot out of range in the fast decode path")
        if rc:
            raise RuntimeError("the fused decode layer is not available in this build")
        q = qkv[:, : self.q_heads * self.head_dim].view(M, self.q_heads, self.head_dim)
        attn = paged_attention(q, k_cache, v_cache, meta, self.scale).reshape(M, self.q_heads * self.head_dim)
        if not attn.is_contiguous():
            attn = attn.contiguous()
        y = x.new_empty((M, H))
        h = x.new_empty((M, 2 * self.inter))
        a = x.new_empty((M, self.inter))
        out = x.new_empty((M, H))
        rc = lib.fz_mlp_out(attn.data_ptr(), attn.shape[1], self.w_o.data_ptr(), y.data_ptr(), residual.data_ptr(),
                            self.post_norm._weight_f32().data_ptr(), self.post_norm.eps, M, H,
                            self.w_gu.data_ptr(), self.inter, h.data_ptr(), a.data_ptr(), self.w_down.data_ptr(),
                            out.data_ptr(), threads)
        if rc:
            raise RuntimeError("the fused decode layer is not available in this build")
        return out, residual


def enabled() -> bool:
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def bind_fast_decode(model: nn.Module) -> int:
    """Give every eligible decoder layer a ``fast_decode`` (FastDecodeLayer); returns how many."""
    if not (enabled() and fused.has_bf16_gemv()):
        return 0
    from gpu.models.layers import SiluAndMul
    from gpu.models.llama import LlamaDecoderLayer
    from gpu.parallel_state import get_tp_size

    if get_tp_size() != 1:
        return 0  # o_proj / down_proj would need their all-reduce
    bound = 0
    for layer in model.modules():
        if not isinstance(layer, LlamaDecoderLayer):
            continue
        attn, mlp = layer.self_attn, layer.mlp
        if attn.q_norm is not None or not isinstance(mlp.act, SiluAndMul):
            continue
        weights = {"qkv": _plain_bf16(attn.qkv_proj), "o": _plain_bf16(attn.o_proj),
                   "gate_up": _plain_bf16(mlp.gate_up_proj), "down": _plain_bf16(mlp.down_proj)}
        if any(w is None for w in weights.values()):
            continue
        layer.fast_decode = FastDecodeLayer(layer, weights)
        bound += 1
    if bound:
        logger.info("fast decode path bound for %d layers (batches up to %d rows)", bound,
                    min(layer.fast_decode.max_rows for layer in model.modules()
                        if getattr(layer, "fast_decode", None) is not None))
    return bound
