"""The one piece of global state: attention metadata and KV caches for the running forward.

The model runner sets it around each forward; attention layers read it. Set and cleared with
``forward_context(...)`` so nothing leaks between steps.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from kernels.metadata import AttentionMetadata


@dataclass(slots=True)
class ForwardContext:
    attn_metadata: AttentionMetadata | None
    # kv_caches[layer_index] = (k_cache, v_cache), each [num_blocks, block_size, num_kv_heads, head_dim]
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]


_current: ForwardContext | None = None


def get_forward_context() -> ForwardContext:
    if _current is None:
        raise RuntimeError("attention ran outside of forward_context(); the model runner sets it")
    return _current


@contextlib.contextmanager
def forward_context(attn_metadata: AttentionMetadata | None, kv_caches):
    global _current
    prev, _current = _current, ForwardContext(attn_metadata, kv_caches)
    try:
        yield _current
    finally:
        _current = prev
