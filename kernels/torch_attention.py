"""Torch implementations of the paged-KV ops: the CPU path and the oracle for the Triton kernels.

Decodes (the first ``meta.num_decodes`` requests, one query token each) run as one padded batch:
their blocks are gathered into ``[Bd, L, Hkv, D]`` and one SDPA call attends with a length mask.
GQA is folded into the query-length axis (the G query heads that share a KV head become G
"query rows" of one head), so no KV head is ever repeated. Prefill chunks run one request at a
time with a causal mask shifted by the request's cached context.

Unwritten cache slots inside gathered blocks are masked out of the softmax, but their values
still meet a zero weight in ``P @ V``: allocate caches with ``torch.zeros`` (any finite garbage is
fine, NaN/Inf is not).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.metadata import AttentionMetadata


def write_kv_cache_torch(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter new K/V rows ``[T, Hkv, D]`` into the caches at ``slot_mapping`` (-1 = skip)."""
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    k_flat = k_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
    v_flat = v_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
    num_tokens = k.shape[0]
    slots = slot_mapping[:num_tokens].to(torch.int64)
    valid = slots >= 0
    if k.device.type == "cpu" and bool(valid.all()):
        # Common case (no padding): one contiguous row copy per token, no compaction.
        k_flat.index_copy_(0, slots, k.to(k_cache.dtype))
        v_flat.index_copy_(0, slots, v.to(v_cache.dtype))
        return
    keep = valid.nonzero().squeeze(1)
    k_flat.index_copy_(0, slots[keep], k[keep].to(k_cache.dtype))
    v_flat.index_copy_(0, slots[keep], v[keep].to(v_cache.dtype))


def _gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """``cache[block_ids]`` for block ids of any shape ``S`` -> ``[*S, block_size, Hkv, D]``."""
    flat = block_ids.reshape(-1).to(torch.int64)
    gathered = cache.index_select(0, flat)
    return gathered.view(*block_ids.shape, *cache.shape[1:])


def _decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    scale: float,
) -> torch.Tensor:
    """One query token per request. q ``[B, H, D]`` -> ``[B, H, D]``."""
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    num_blocks = -(-max_seq_len // block_size)
    length = num_blocks * block_size
    tables = block_tables[:batch, :num_blocks]
    # [B, L, Hkv, D] viewed as [B, Hkv, L, D] (strided; SDPA reads it in place).
    keys = _gather_blocks(k_cache, tables).view(batch, length, num_kv_heads, head_dim).transpose(1, 2)
    values = _gather_blocks(v_cache, tables).view(batch, length, num_kv_heads, head_dim).transpose(1, 2)
    queries = q.view(batch, num_kv_heads, group, head_dim)
    positions = torch.arange(length, device=q.device, dtype=seq_lens.dtype)
    mask = (positions[None, :] < seq_lens[:batch, None]).view(batch, 1, 1, length)
    out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scale)
    return out.reshape(batch, num_heads, head_dim)


def _prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: int,
    scale: float,
) -> torch.Tensor:
    """One request's chunk: q ``[Q, H, D]`` are the last Q of ``seq_len`` tokens -> ``[Q, H, D]``."""
    query_len, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_blocks = -(-seq_len // block_size)
    keys = _gather_blocks(k_cache, block_table[:num_blocks]).view(-1, num_kv_heads, head_dim)[:seq_len]
    values = _gather_blocks(v_cache, block_table[:num_blocks]).view(-1, num_kv_heads, head_dim)[:seq_len]
    queries = q.transpose(0, 1).unsqueeze(0)  # [1, H, Q, D]
    keys = keys.transpose(0, 1).unsqueeze(0)  # [1, Hkv, S, D]
    values = values.transpose(0, 1).unsqueeze(0)
    context_len = seq_len - query_len
    if context_len == 0:
        out = F.scaled_dot_product_attention(
            queries, keys, values, is_causal=True, scale=scale, enable_gqa=num_heads != num_kv_heads
        )
    else:
        rows = torch.arange(query_len, device=q.device)[:, None] + context_len
        cols = torch.arange(seq_len, device=q.device)[None, :]
        out = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=cols <= rows, scale=scale, enable_gqa=num_heads != num_kv_heads
        )
    return out[0].transpose(0, 1)


def paged_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of the flat batch ``q [T, H, D]`` over the paged cache -> ``[T, H, D]`` in q's dtype.

    Writes into ``out`` when given. Rows beyond ``meta.num_tokens`` (padding for static batch
    shapes) come back as zeros.
    """
    num_tokens = meta.num_tokens
    if out is None:
        out = torch.empty_like(q)
    if q.shape[0] > num_tokens:
        out[num_tokens:].zero_()
    if k_cache.dtype != q.dtype:
        raise TypeError(f"KV cache dtype {k_cache.dtype} differs from query dtype {q.dtype}")
    starts = meta.query_start_loc_host
    seq_lens = meta.seq_lens_host
    num_decodes = meta.num_decodes
    if num_decodes > 0:
        out[:num_decodes] = _decode_attention(
            q[:num_decodes],
            k_cache,
            v_cache,
            meta.block_tables,
            meta.seq_lens,
            max(seq_lens[:num_decodes]),
            scale,
        )
    for r in range(num_decodes, meta.num_requests):
        start, end = starts[r], starts[r + 1]
        if end == start:
            continue
        out[start:end] = _prefill_attention(
            q[start:end], k_cache, v_cache, meta.block_tables[r], seq_lens[r], scale
        )
    return out
