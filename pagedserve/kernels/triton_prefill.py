"""Prefill attention on the CUDA path in query tiles (Triton), beside kernels/triton_attention.py.

The per-token kernel there runs one program per (query token, KV head), so a prefill chunk of T
tokens reads its keys T times. Here a program takes up to ``PREFILL_BLOCK_M`` consecutive query
tokens of one request with the GQA heads of one KV head, and reads each key tile once for all of
them (causal masking per row). The tiles are laid out on the host from ``query_start_loc_host``
and ``seq_lens_host``: a step with prefill chunks runs eagerly (never graph-captured), so that
costs no synchronisation. Same online softmax, same block-table lookups as the per-token kernel.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels.metadata import AttentionMetadata
from pagedserve.kernels.triton_keys import attend_keys


@triton.jit
def _prefill_attention_kernel(
    out_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    tile_request_ptr,
    tile_token_ptr,
    tile_count_ptr,
    tile_first_pos_ptr,
    scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_table,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    """One (query tile, KV head): up to BLOCK_M consecutive query tokens of one request, each with
    the GROUP heads of this KV head, as BLOCK_M * GROUP_PAD rows that read every key tile once
    (the per-token kernel reads a prefill's keys once per token). Causal per row."""
    tile = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    request = tl.load(tile_request_ptr + tile).to(tl.int64)
    token0 = tl.load(tile_token_ptr + tile).to(tl.int64)
    count = tl.load(tile_count_ptr + tile)
    pos0 = tl.load(tile_first_pos_ptr + tile)  # position of the tile's first query token

    r = tl.arange(0, BLOCK_M * GROUP_PAD)
    i = r // GROUP_PAD  # query token within the tile
    g = r % GROUP_PAD
    d = tl.arange(0, DIM_PAD)
    valid = (i < count) & (g < GROUP)
    pos = tl.where(valid, pos0 + i, -1)  # an invalid row sees no key
    token = token0 + i
    heads = kv_head * GROUP + g
    row_mask = valid[:, None] & (d < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + token[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=row_mask,
                other=0.0)
    if UPCAST_DOT:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M * GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_M * GROUP_PAD, DIM_PAD], tl.float32)
    table = block_tables_ptr + request * stride_table
    num_keys = pos0 + count  # the tile's last token sees keys 0 ..= pos0 + count - 1
    m_i, l_i, acc = attend_keys(q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, table, kv_head, 0, num_keys, pos, scale,
                                stride_cache_block, stride_cache_slot, stride_cache_head, HEAD_DIM, DIM_PAD,
                                BLOCK_SIZE, BLOCK_N, PRECISION, UPCAST_DOT)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + token[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_mask)


PREFILL_BLOCK_M = 16  # query tokens a prefill tile holds


def prefill_tiles(meta: AttentionMetadata, block_m: int = PREFILL_BLOCK_M) -> list[tuple[int, int, int, int]]:
    """(request, first token, tokens, first position) of each query tile of the prefill requests
    (those after the first ``num_decodes``), from the host copy of the metadata."""
    qsl, lens = meta.query_start_loc_host, meta.seq_lens_host
    tiles = []
    for req in range(meta.num_decodes, len(lens)):
        start, end = qsl[req], qsl[req + 1]
        first_pos = lens[req] - (end - start)
        for t in range(start, end, block_m):
            tiles.append((req, t, min(block_m, end - t), first_pos + t - start))
    return tiles


def prefill_attention(q, k_cache, v_cache, meta, scale, out, constexprs) -> None:
    tiles = prefill_tiles(meta)
    if not tiles:
        return
    info = torch.tensor(tiles, dtype=torch.int32).t().contiguous().to(q.device, non_blocking=True)
    _prefill_attention_kernel[(len(tiles), k_cache.shape[2])](
        out, q, k_cache, v_cache, meta.block_tables, info[0], info[1], info[2], info[3], scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), meta.block_tables.stride(0), BLOCK_M=PREFILL_BLOCK_M,
        **{**constexprs, "GROUP_PAD": triton.next_power_of_2(constexprs["GROUP"])})  # BLOCK_M rows fill a dot
