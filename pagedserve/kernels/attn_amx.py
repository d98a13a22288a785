"""The AMX decode attention kernel (csrc/paged_attn_amx.c): loader and when to use it.

Same arguments as ``pa_decode`` of csrc/paged_attn.c (kernels/cpu_attention.py calls either), for
bf16 caches with head_dim a multiple of 32 and at most 16 query heads per KV head. Used where the
CPU has AMX (amx_tile, amx_bf16, avx512_bf16) and Linux grants the tile state, for every batch
size and context length: it measured faster than the AVX-512 kernel at batch 1, 4 and 16 and
contexts 128 to 1024, 1.2-1.7x with a step's caches coming from DRAM and 1.2-2.2x cache-hot (one
thread; loadtest/PERF.md, "AMX decode attention"). ``PAGEDSERVE_ISA`` below ``amx`` turns it off
(kernels/isa.py).
"""
from __future__ import annotations

import ctypes
import functools
import logging

import torch

from pagedserve.kernels import abi, cbuild, isa

logger = logging.getLogger(__name__)


@functools.cache
def library() -> ctypes.CDLL | None:
    """The AMX kernel, or None where the CPU lacks AMX, Linux refuses the tile state, the build
    fails, or ``PAGEDSERVE_ISA`` caps the kernels below AMX."""
    choice = isa.choose("paged_attn_amx")
    if choice is None:
        return None
    lib = cbuild.build_or_none("paged_attn_amx", choice, "the AVX-512 attention kernel")
    if lib is None:
        return None
    if not cbuild.amx_tiles_granted():
        logger.warning("AMX decode attention: Linux refused the tile state, the AVX-512 kernel runs")
        return None
    abi.bind(lib, "paged_attn_amx")
    logger.info("CPU attention: AMX bf16 tiles for decodes")
    return lib


def applies(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether the AMX kernel takes these shapes (bf16, head_dim % 32 == 0, group <= 16)."""
    return (dtype == torch.bfloat16 and head_dim % 32 == 0 and head_dim <= 256
            and num_heads % num_kv_heads == 0 and num_heads // num_kv_heads <= 16)


def decode_fn(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int):
    """``pam_decode`` when this step's decodes should run on AMX, else None (the caller's kernel)."""
    if not applies(dtype, num_heads, num_kv_heads, head_dim):
        return None
    lib = library()
    return None if lib is None else lib.pam_decode
