"""Attention over the paged KV cache, reading the step's metadata from the forward context."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.gpu.forward_context import get_forward_context
from pagedserve.kernels.attention import paged_attention, write_kv_cache
from pagedserve.kernels.window_attention import attend, paged_attention_window


class Attention(nn.Module):
    """q/k/v (already projected and rotated) -> attention output ``[T, H * D]``.

    Layer ``layer_idx`` writes its new K/V into ``ctx.kv_caches[layer_idx]`` and attends over the
    cache. Without caches or metadata (the memory-profile run) the whole flat batch is treated
    as one causal sequence. A layer with a ``sliding_window`` (keys older than that many tokens
    are invisible) or a ``logit_softcap`` (scores -> tanh(s / cap) * cap) runs through
    kernels.window_attention on every device: the other kernels take neither.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, layer_idx: int,
                 sliding_window: int | None = None, logit_softcap: float | None = None):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.layer_idx = layer_idx
        self.sliding_window = sliding_window or None
        self.logit_softcap = logit_softcap or None

    @property
    def plain(self) -> bool:
        """True when the shared paged kernels compute this layer (no window, no soft-cap)."""
        return self.sliding_window is None and self.logit_softcap is None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        T = q.shape[0]
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        ctx = get_forward_context()
        meta = ctx.attn_metadata
        if meta is None or not ctx.kv_caches:
            if not self.plain:
                pos = torch.arange(T, device=q.device)
                out = attend(q, k, v, pos, pos, self.scale, self.sliding_window, self.logit_softcap)
                return out.reshape(T, self.num_heads * self.head_dim)
            return self._causal_sdpa(q, k, v).reshape(T, self.num_heads * self.head_dim)
        k_cache, v_cache = ctx.kv_caches[self.layer_idx]
        write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        if self.plain:
            out = paged_attention(q, k_cache, v_cache, meta, self.scale)
        else:
            out = paged_attention_window(q, k_cache, v_cache, meta, self.scale, self.sliding_window,
                                         self.logit_softcap)
        return out.reshape(T, self.num_heads * self.head_dim)

    def _causal_sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        group = self.num_heads // self.num_kv_heads
        if group > 1:
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                             is_causal=True, scale=self.scale)
        return out.transpose(0, 1)
