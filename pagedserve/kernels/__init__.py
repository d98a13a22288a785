"""Attention and KV-cache ops (Triton on CUDA, torch on CPU)."""
from pagedserve.kernels.attention import paged_attention, write_kv_cache
from pagedserve.kernels.metadata import AttentionMetadata

__all__ = ["AttentionMetadata", "paged_attention", "write_kv_cache"]
