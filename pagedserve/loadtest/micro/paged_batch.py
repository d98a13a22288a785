"""Builds random flat batches over a paged KV cache: the attention benchmarks' input, and the
kernel tests' (whose naive oracle is tests/kernels/paged_batch.py)."""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch

from pagedserve.kernels.metadata import AttentionMetadata

GARBAGE = 1.0e3  # finite junk in every cache slot no request owns: masking must hide it


@dataclass
class PagedBatch:
    q: torch.Tensor  # [T, H, D]
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    meta: AttentionMetadata
    slots: list[list[int]]  # per request, the cache slot of each of its seq_len tokens
    query_lens: list[int]


def make_batch(
    requests: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    spare_blocks: int = 3,
    pad_tokens: int = 0,
) -> PagedBatch:
    """``requests`` is a list of (context_len, query_len), decodes (query_len 1) first.

    Block tables use shuffled block ids (never block 0, which stays a null block). All K/V of
    every request (context and new tokens) is written straight into the cache here.
    """
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    seq_lens = [c + q for c, q in requests]
    blocks_per_req = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = 1 + sum(blocks_per_req) + spare_blocks
    ids = list(range(1, num_blocks))
    rng.shuffle(ids)
    tables: list[list[int]] = []
    for n in blocks_per_req:
        tables.append(ids[:n])
        ids = ids[n:]
    max_blocks = max(blocks_per_req) + 1  # one column of padding
    block_tables = torch.zeros(len(requests), max_blocks, dtype=torch.int32)
    for r, t in enumerate(tables):
        block_tables[r, : len(t)] = torch.tensor(t, dtype=torch.int32)

    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, GARBAGE, dtype=dtype)
    v_cache = torch.full(shape, -GARBAGE, dtype=dtype)
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    slots: list[list[int]] = []
    for r, s in enumerate(seq_lens):
        req_slots = [tables[r][t // block_size] * block_size + t % block_size for t in range(s)]
        slots.append(req_slots)
        idx = torch.tensor(req_slots, dtype=torch.int64)
        k_flat[idx] = torch.randn(s, num_kv_heads, head_dim, generator=gen).to(dtype)
        v_flat[idx] = torch.randn(s, num_kv_heads, head_dim, generator=gen).to(dtype)

    query_lens = [q for _, q in requests]
    num_decodes = 0
    while num_decodes < len(query_lens) and query_lens[num_decodes] == 1:
        num_decodes += 1
    starts = [0]
    for ql in query_lens:
        starts.append(starts[-1] + ql)
    num_tokens = starts[-1]
    slot_mapping = [slots[r][-ql + i] for r, ql in enumerate(query_lens) for i in range(ql)]
    slot_mapping += [-1] * pad_tokens
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=block_tables,
        slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64),
        num_decodes=num_decodes,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_start_loc_host=starts,
        seq_lens_host=seq_lens,
    )
    q = torch.randn(num_tokens + pad_tokens, num_heads, head_dim, generator=gen).to(dtype)
    return PagedBatch(q, k_cache, v_cache, meta, slots, query_lens)

