"""The one piece of global state: attention metadata and KV caches for the running forward.

The model runner sets it around each forward; attention layers read it. Set and cleared with
``forward_context(...)`` so nothing leaks between steps.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch

from pagedserve.kernels.metadata import AttentionMetadata


@dataclass(slots=True)
class ForwardContext:
    attn_metadata: AttentionMetadata | None
    # kv_caches[layer_index] = (k_cache, v_cache), each [num_blocks, block_size, num_kv_heads, head_dim]
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    # gpu.models.lora_layers.LoRABatch of a step with adapter rows (multi-LoRA); None otherwise.
    lora: Any = None


_current: ForwardContext | None = None


def get_forward_context() -> ForwardContext:
    if _current is None:
        raise RuntimeError("attention ran outside of forward_context(); the model runner sets it")
    return _current


def current_lora():
    """The running step's LoRABatch, or None (no forward running, or no adapter rows in it)."""
    return None if _current is None else _current.lora


@contextlib.contextmanager
def forward_context(attn_metadata: AttentionMetadata | None, kv_caches, lora=None):
    global _current
    prev, _current = _current, ForwardContext(attn_metadata, kv_caches, lora)
    try:
        yield _current
    finally:
        _current = prev
