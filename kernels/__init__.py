"""Attention and KV-cache ops (Triton on CUDA, torch on CPU)."""
from kernels.attention import paged_attention, write_kv_cache
from kernels.metadata import AttentionMetadata

__all__ = ["AttentionMetadata", "paged_attention", "write_kv_cache"]
