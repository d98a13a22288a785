"""Triton kernels for the paged-KV ops (the CUDA path).

Tested on CPU under ``TRITON_INTERPRET=1`` against the torch implementation; the variable must
be set before triton is first imported (``triton.jit`` reads it at decoration, also for
triton.language's own helpers) and while kernels run. tests/kernels/test_triton_compile.py
compiles them for sm_80 down to cubin without a GPU.

Attention: one program per (query token, KV head, context split). The program holds the query
vectors of the G heads that share that KV head (GQA), walks its split of the request's keys in
tiles of ``BLOCK_N`` tokens (each token's physical slot looked up through the block table, so any
block size works) and keeps an online softmax, so memory use does not grow with the context.
Tokens past ``meta.num_tokens`` (static-shape padding) get zeros.

Split-K (flash-decoding): a decode step has one query token per request, so one program per
(token, KV head) gave a batch-1 decode of the default model 3 programs for 132 SMs. With
``num_splits`` > 1 each program takes one contiguous share of the keys and writes its running
max, sum and unnormalised output to a scratch buffer; a second kernel merges the shares per
(token, head). The split count depends only on the token count and the GPU (``choose_splits``),
so a captured graph replays with the count it was captured with.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from pagedserve.kernels.metadata import AttentionMetadata
from pagedserve.kernels.triton_keys import attend_keys
from pagedserve.kernels.triton_prefill import prefill_attention

# The interpreter (3.x) runs tl.dot on bf16 operands as raw uint16 numbers, so when interpreting
# the attention kernel upcasts its dot operands to fp32. Compiled kernels keep native bf16 dots.
# (TRITON_INTERPRET is Triton's own switch, read as Triton reads it; contracts/env.py declares ours only.)
_INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@triton.jit
def _write_kv_cache_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ROW_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    offs = tl.arange(0, ROW_PAD)
    head = offs // HEAD_DIM
    dim = offs % HEAD_DIM
    slots = slot + tl.zeros([ROW_PAD], tl.int64)  # block-shaped: the interpreter rejects block & scalar masks
    mask = (offs < NUM_KV_HEADS * HEAD_DIM) & (slots >= 0)
    dst = slots * (NUM_KV_HEADS * HEAD_DIM) + offs  # caches are contiguous: a slot is one row
    k = tl.load(k_ptr + token * stride_kt + head * stride_kh + dim, mask=mask)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    v = tl.load(v_ptr + token * stride_vt + head * stride_vh + dim, mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache_triton(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter new K/V rows ``[T, Hkv, D]`` into the caches at ``slot_mapping`` (-1 = skip)."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("KV caches must be contiguous")
    if k.stride(2) != 1:
        k = k.contiguous()
    if v.stride(2) != 1:
        v = v.contiguous()
    _write_kv_cache_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        ROW_PAD=triton.next_power_of_2(num_kv_heads * head_dim),
    )


@triton.jit
def _paged_attention_kernel(
    out_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    token_request_ptr,
    num_requests,
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
    PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    part_m_ptr,
    part_l_ptr,
    part_acc_ptr,
):
    token = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    request = tl.load(token_request_ptr + token)
    is_real = request < num_requests  # padding tokens map past the last request
    request = tl.minimum(request, num_requests - 1).to(tl.int64)
    query_start = tl.load(query_start_loc_ptr + request)
    query_end = tl.load(query_start_loc_ptr + request + 1)
    seq_len = tl.load(seq_lens_ptr + request)
    position = seq_len - (query_end - query_start) + (token - query_start)
    num_keys = tl.where(is_real, position + 1, 0)  # causal: keys 0 ..= position

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, DIM_PAD)
    heads = kv_head * GROUP + g
    row_mask = (g < GROUP)[:, None] & (d < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + token * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=row_mask, other=0.0)
    if UPCAST_DOT:
        q = q.to(tl.float32)

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    table = block_tables_ptr + request * stride_table
    # This program's share of the keys: whole BLOCK_N tiles, the last share possibly short or empty.
    share = tl.cdiv(tl.cdiv(num_keys, NUM_SPLITS), BLOCK_N) * BLOCK_N
    first = split * share
    last = tl.minimum(first + share, num_keys)
    limit = tl.zeros([GROUP_PAD], tl.int64) + position  # every row: keys up to its token's position
    m_i, l_i, acc = attend_keys(q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, table, kv_head, first, last, limit, scale,
                                stride_cache_block, stride_cache_slot, stride_cache_head, HEAD_DIM, DIM_PAD,
                                BLOCK_SIZE, BLOCK_N, PRECISION, UPCAST_DOT)
    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # no keys (padding token) -> zeros
        tl.store(
            out_ptr + token * stride_ot + heads[:, None] * stride_oh + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_mask,
        )
    else:  # this share's max, sum and unnormalised output: [token, head, split(, dim)]
        part = (token * GROUP * tl.num_programs(1) + heads) * NUM_SPLITS + split
        tl.store(part_m_ptr + part, m_i, mask=g < GROUP)
        tl.store(part_l_ptr + part, l_i, mask=g < GROUP)
        tl.store(part_acc_ptr + part[:, None] * DIM_PAD + d[None, :], acc, mask=row_mask)


@triton.jit
def _merge_splits_kernel(
    out_ptr,
    part_m_ptr,
    part_l_ptr,
    part_acc_ptr,
    stride_ot,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    """One (token, head): the shares' outputs weighted by exp(their max - the overall max)."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    s = tl.arange(0, NUM_SPLITS)
    d = tl.arange(0, DIM_PAD)
    part = (token * NUM_HEADS + head) * NUM_SPLITS + s
    m = tl.load(part_m_ptr + part)
    l_s = tl.load(part_l_ptr + part)
    m_all = tl.max(m, 0)
    m_all = tl.where(m_all > float("-inf"), m_all, 0.0)  # every share empty (a padding token)
    w = tl.where(m > float("-inf"), tl.exp(m - m_all), 0.0)  # an empty share: weight 0
    total = tl.sum(w * l_s, 0)
    acc = tl.load(part_acc_ptr + part[:, None] * DIM_PAD + d[None, :])
    out = tl.sum(w[:, None] * acc, 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty),
             mask=d < HEAD_DIM)


def attention_constexprs(
    num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype
) -> dict[str, object]:
    """Compile-time parameters of ``_paged_attention_kernel``.

    tl.dot needs K >= 16; M (query heads of a group) and N (keys per tile) are padded to 16 too,
    the smallest tensor-core tile.
    """
    group = num_heads // num_kv_heads
    return {
        "GROUP": group,
        "GROUP_PAD": max(16, triton.next_power_of_2(group)),
        "HEAD_DIM": head_dim,
        "DIM_PAD": max(16, triton.next_power_of_2(head_dim)),
        "BLOCK_SIZE": block_size,
        "BLOCK_N": max(16, min(64, block_size)),
        "PRECISION": "ieee" if dtype == torch.float32 else None,  # fp32 stays exact (no tf32)
        "UPCAST_DOT": _INTERPRETING and dtype != torch.float32,
    }


MAX_SPLITS = 16
# Keys per tile of the decode kernel, whatever the cache's block size (each key's block is looked up
# on its own). It had followed the block size (16 on the default cache), so a 1,024-token context
# took 64 dependent tile steps, and batch-64 decode of a 1.2B Llama spent 52 % of its step in
# attention at ~38 % of the H200's bandwidth (loadtest/PERF.md, "GPU check on an H200").
DECODE_BLOCK_N = 64


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def choose_splits(num_tokens: int, num_kv_heads: int, device: torch.device) -> int:
    """Context splits per (token, KV head): enough programs to fill the GPU about twice (a power of
    two, at most MAX_SPLITS); 1 when the tokens alone fill it, and off CUDA (the interpreter).
    Depends only on the token count and the device, never on lengths read from the device."""
    if device.type != "cuda":
        return 1
    return splits_for(num_tokens * num_kv_heads, torch.cuda.get_device_properties(device).multi_processor_count)


def splits_for(programs: int, sms: int) -> int:
    """``choose_splits`` for ``programs`` (token, KV head) pairs on ``sms`` multiprocessors."""
    programs = max(1, programs)
    if programs >= sms:
        return 1
    return min(MAX_SPLITS, triton.next_power_of_2(-(-2 * sms // programs)))


def _token_request(meta: AttentionMetadata, num_tokens: int) -> torch.Tensor:
    """The request index of each of the first ``num_tokens`` query tokens: ``meta.token_request``
    when set (by the graph runner, or by this step's first layer), else derived and kept there.
    The decodes come first, so a map over every token starts with the decodes' own."""
    have = meta.token_request
    if have is None or have.shape[0] < num_tokens:
        tokens = torch.arange(num_tokens, device=meta.query_start_loc.device, dtype=meta.query_start_loc.dtype)
        have = meta.token_request = torch.searchsorted(meta.query_start_loc[1:], tokens, right=True,
                                                       out_int32=True)
    return have[:num_tokens]


def paged_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """Attention of the flat batch ``q [T, H, D]`` over the paged cache -> ``[T, H, D]``.

    A decode-only step reads every length on the device (no host synchronisation: it can be
    graph-captured); ``num_splits``: context splits (a power of two; None = ``choose_splits``);
    ``block_n``: keys per tile of the decode kernel (a power of two >= 16; None = DECODE_BLOCK_N). A
    step with prefill chunks (never captured) runs its decodes so and its prefill requests in query
    tiles (kernels/triton_prefill.py), laid out from the host copy of the metadata.
    """
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads is not a multiple of {num_kv_heads} KV heads")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(3) != 1:
        raise ValueError("K and V caches must share a layout with contiguous head_dim")
    if q.stride(2) != 1:
        q = q.contiguous()
    if out is None:
        out = torch.empty_like(q)
    if num_tokens == 0:
        return out
    constexprs = attention_constexprs(num_heads, num_kv_heads, head_dim, block_size, q.dtype)
    tiled = meta.num_decodes < meta.num_requests and not _capturing(q.device)
    if tiled:
        prefill_attention(q, k_cache, v_cache, meta, scale, out, constexprs)
        if num_tokens > meta.num_tokens:
            out[meta.num_tokens:].zero_()  # static-shape padding tokens
        num_tokens = meta.query_start_loc_host[meta.num_decodes]  # the decodes come first
        if num_tokens == 0:
            return out
    splits = choose_splits(num_tokens, num_kv_heads, q.device) if num_splits is None else num_splits
    if splits < 1 or splits & (splits - 1):
        raise ValueError(f"num_splits must be a power of two, got {splits}")
    if splits > 1:
        part_m = torch.empty((num_tokens, num_heads, splits), dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty((num_tokens, num_heads, splits, constexprs["DIM_PAD"]), dtype=torch.float32,
                               device=q.device)
    else:  # unused by the kernel
        part_m = part_l = part_acc = out
    token_request = _token_request(meta, num_tokens)
    _paged_attention_kernel[(num_tokens, num_kv_heads, splits)](
        out,
        q,
        k_cache,
        v_cache,
        meta.block_tables,
        meta.seq_lens,
        meta.query_start_loc,
        token_request,
        meta.seq_lens.shape[0],
        scale,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        meta.block_tables.stride(0),
        **{**constexprs, "BLOCK_N": block_n or DECODE_BLOCK_N},
        NUM_SPLITS=splits,
        part_m_ptr=part_m,
        part_l_ptr=part_l,
        part_acc_ptr=part_acc,
    )
    if splits > 1:
        _merge_splits_kernel[(num_tokens, num_heads)](
            out, part_m, part_l, part_acc, out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, DIM_PAD=constexprs["DIM_PAD"], NUM_SPLITS=splits,
        )
    return out
