"""The key loop both Triton attention kernels share (kernels/triton_attention.py per token,
kernels/triton_prefill.py per query tile): walk keys [first, last) of one request and one KV head
in tiles of BLOCK_N, each key's slot looked up through the block table, and fold them into an
online softmax. Rows see keys up to their own position (``limit``, causal); a row with no key yet
keeps max -inf and sum 0 (the callers turn that into zeros).
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def attend_keys(q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, table, kv_head, first, last, limit, scale,
                stride_cache_block, stride_cache_slot, stride_cache_head,
                HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr):
    """(m_i, l_i, acc) after keys [first, last); ``q`` [rows, DIM_PAD], ``limit`` [rows]: each
    row's last visible key position."""
    d = tl.arange(0, DIM_PAD)
    for start in range(first, last, BLOCK_N):
        key_pos = start + tl.arange(0, BLOCK_N)
        key_mask = key_pos < last
        block = tl.load(table + key_pos // BLOCK_SIZE, mask=key_mask, other=0).to(tl.int64)
        row = block * stride_cache_block + (key_pos % BLOCK_SIZE) * stride_cache_slot + kv_head * stride_cache_head
        kv_mask = key_mask[:, None] & (d < HEAD_DIM)[None, :]
        k = tl.load(k_cache_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, DIM_PAD]
        if UPCAST_DOT:
            k = k.to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [rows, BLOCK_N]
        scores = tl.where(key_mask[None, :] & (key_pos[None, :] <= limit[:, None]), scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)  # a row with no key yet
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(scores - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if UPCAST_DOT:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    return m_i, l_i, acc
