"""Dispatch for the paged-KV ops: Triton kernels for CUDA tensors; on CPU the C decode kernel
(kernels.cpu_attention) with torch SDPA for prefill chunks and as the fall-back."""
from __future__ import annotations

import functools

import torch

from pagedserve.kernels import fused
from pagedserve.kernels.metadata import AttentionMetadata
from pagedserve.kernels.cpu_attention import paged_attention_cpu
from pagedserve.kernels.torch_attention import write_kv_cache_torch

__all__ = ["write_kv_cache", "paged_attention", "triton_available", "use_triton"]


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def use_triton(t: torch.Tensor) -> bool:
    """Whether ops on ``t`` take the Triton kernels: a CUDA tensor, Triton installed. The one
    test of the attention ops here and of the elementwise ones (gpu/models/layers.py, rotary.py)."""
    return t.is_cuda and triton_available()


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write new K/V ``[T, Hkv, D]`` into caches ``[num_blocks, block_size, Hkv, D]``; slot -1 = skip."""
    if use_triton(k):
        from pagedserve.kernels.triton_attention import write_kv_cache_triton

        write_kv_cache_triton(k, v, k_cache, v_cache, slot_mapping)
    elif fused.can_write_kv(k, v, k_cache, slot_mapping):
        fused.write_kv(k, v, k_cache, v_cache, slot_mapping)
    else:
        write_kv_cache_torch(k, v, k_cache, v_cache, slot_mapping)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of the flat batch ``q [T, H, D]`` over the paged cache -> ``[T, H, D]``.

    The new tokens' K/V must already be in the cache (``write_kv_cache``). H is a multiple of Hkv.
    ``out`` (same shape and dtype as q) is filled and returned when given, e.g. a static buffer;
    rows beyond ``meta.num_tokens`` are zeroed.
    """
    if use_triton(q):
        from pagedserve.kernels.triton_attention import paged_attention_triton

        return paged_attention_triton(q, k_cache, v_cache, meta, scale, out)
    return paged_attention_cpu(q, k_cache, v_cache, meta, scale, out)
