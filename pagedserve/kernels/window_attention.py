"""Paged attention with a sliding window and/or tanh soft-capping of the scores (Gemma 2/3, Phi-3).

Why a path of its own: SDPA (the torch prefill path), the C decode kernel and the Triton kernels
take neither a window nor a soft-cap, and a soft-cap must be applied to the scores before the
softmax, which SDPA never exposes. Here each request's keys are gathered from the paged cache
(only those a query of this step can see: the window's span before its first query) and the
scores are computed explicitly, capped, masked (causal and window) and softmaxed in fp32.

Window semantics are transformers': the query at position p sees keys k with
``p - window < k <= p`` (``window`` keys, itself included). The same code runs on CPU and CUDA
tensors (torch ops only): the decodes of a step as one padded batch (each request's blocks from
the first one its window reaches), the prefill chunks one request at a time. As in
kernels.torch_attention, padding slots meet a zero weight: caches must hold finite values.
"""
from __future__ import annotations

import torch

from pagedserve.kernels.kv_cache_dtype import readable
from pagedserve.kernels.metadata import AttentionMetadata


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, q_pos: torch.Tensor,
           k_pos: torch.Tensor, scale: float, window: int | None, softcap: float | None) -> torch.Tensor:
    """q ``[Q, H, D]`` at positions ``q_pos [Q]`` over keys/values ``[S, Hkv, D]`` at ``k_pos [S]``
    -> ``[Q, H, D]``; causal, windowed when ``window``, scores capped at ``softcap`` (tanh)."""
    num_q, num_heads, head_dim = q.shape
    num_kv_heads = keys.shape[1]
    group = num_heads // num_kv_heads
    # [Hkv, G*Q, D] x [Hkv, D, S]: the G query heads of a KV head share its keys (no repeat).
    qh = q.view(num_q, num_kv_heads, group, head_dim).permute(1, 2, 0, 3).reshape(num_kv_heads, group * num_q, head_dim)
    scores = torch.bmm(qh, keys.permute(1, 2, 0)).float() * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    visible = k_pos[None, :] <= q_pos[:, None]
    if window:
        visible &= k_pos[None, :] > q_pos[:, None] - window
    scores = scores.view(num_kv_heads, group, num_q, -1).masked_fill_(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(values.dtype).view(num_kv_heads, group * num_q, -1)
    out = torch.bmm(probs, values.transpose(0, 1))  # [Hkv, G*Q, D]
    return out.view(num_kv_heads, group, num_q, head_dim).permute(2, 0, 1, 3).reshape(num_q, num_heads, head_dim)


def paged_attention_window(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                           scale: float, window: int | None, softcap: float | None,
                           out: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as ``kernels.attention.paged_attention`` (flat batch, decodes first, padding
    rows zeroed), for every request decode or prefill alike, with ``window`` and ``softcap``."""
    if not readable(k_cache.dtype, q.dtype):
        raise TypeError(f"KV cache dtype {k_cache.dtype} differs from query dtype {q.dtype}")
    if out is None:
        out = torch.empty_like(q)
    num_tokens = meta.num_tokens
    if q.shape[0] > num_tokens:
        out[num_tokens:].zero_()
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    starts, seq_lens = meta.query_start_loc_host, meta.seq_lens_host
    if meta.num_decodes:
        out[:meta.num_decodes] = _decodes(q[:meta.num_decodes], k_cache, v_cache, meta, scale, window, softcap)
    for r in range(meta.num_decodes, meta.num_requests):
        start, end = starts[r], starts[r + 1]
        if end == start:
            continue
        seq_len = seq_lens[r]
        first_q = seq_len - (end - start)
        first_k = max(0, first_q - window + 1) if window else 0
        first_block, last_block = first_k // block_size, -(-seq_len // block_size)
        blocks = meta.block_tables[r, first_block:last_block].to(torch.int64)
        lo, hi = first_k - first_block * block_size, seq_len - first_block * block_size
        keys = k_cache.index_select(0, blocks).view(-1, num_kv_heads, head_dim)[lo:hi].to(q.dtype)
        values = v_cache.index_select(0, blocks).view(-1, num_kv_heads, head_dim)[lo:hi].to(q.dtype)
        q_pos = torch.arange(first_q, seq_len, device=q.device)
        k_pos = torch.arange(first_k, seq_len, device=q.device)
        out[start:end] = attend(q[start:end], keys, values, q_pos, k_pos, scale, window, softcap)
    return out


def _decodes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
             window: int | None, softcap: float | None) -> torch.Tensor:
    """The first ``meta.num_decodes`` requests (one query each, at position seq_len - 1) as one
    batch: ``q [n, H, D]`` -> ``[n, H, D]``."""
    n, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    seq_lens = meta.seq_lens_host[:n]
    first_k = [max(0, s - window) if window else 0 for s in seq_lens]
    first_block = [f // block_size for f in first_k]
    width = max(-(-s // block_size) - b for s, b in zip(seq_lens, first_block))  # blocks per request
    device = q.device
    offsets = torch.tensor(first_block, device=device)[:, None] + torch.arange(width, device=device)
    tables = meta.block_tables[:n].to(torch.int64)
    ids = torch.gather(tables, 1, offsets.clamp_(max=tables.shape[1] - 1))  # past a table's end: masked
    length = width * block_size
    keys = k_cache.index_select(0, ids.reshape(-1)).view(n, length, num_kv_heads, head_dim).to(q.dtype)
    values = v_cache.index_select(0, ids.reshape(-1)).view(n, length, num_kv_heads, head_dim).to(q.dtype)
    k_pos = (torch.tensor(first_block, device=device) * block_size)[:, None] + torch.arange(length, device=device)
    lo = torch.tensor(first_k, device=device)[:, None]
    hi = torch.tensor(seq_lens, device=device)[:, None]
    visible = (k_pos >= lo) & (k_pos < hi)  # [n, L]: in the window (or after 0) and written
    # [n, Hkv, G, D] x [n, Hkv, D, L]
    scores = torch.matmul(q.view(n, num_kv_heads, group, head_dim), keys.permute(0, 2, 3, 1)).float() * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores.masked_fill_(~visible[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(values.dtype)
    return torch.matmul(probs, values.transpose(1, 2)).reshape(n, num_heads, head_dim)
