"""The naive attention oracle over a random paged batch (built by loadtest/micro/paged_batch.py,
which the attention benchmarks share)."""
from __future__ import annotations

import torch

from pagedserve.loadtest.micro.paged_batch import GARBAGE, PagedBatch, make_batch  # noqa: F401  (the tests' one import)


def naive_attention(batch: PagedBatch, scale: float) -> torch.Tensor:
    """Per request and head: gather K/V slot by slot, masked softmax in float64. -> [T, H, D]."""
    q = batch.q.double()
    num_heads = q.shape[1]
    num_kv_heads = batch.k_cache.shape[2]
    group = num_heads // num_kv_heads
    k_flat = batch.k_cache.double().view(-1, num_kv_heads, batch.k_cache.shape[-1])
    v_flat = batch.v_cache.double().view(-1, num_kv_heads, batch.v_cache.shape[-1])
    out = torch.zeros_like(q)
    start = 0
    for req_slots, ql in zip(batch.slots, batch.query_lens):
        seq_len = len(req_slots)
        keys = k_flat[torch.tensor(req_slots)]  # [S, Hkv, D]
        values = v_flat[torch.tensor(req_slots)]
        for i in range(ql):
            pos = seq_len - ql + i  # this query's position; it sees keys 0..=pos
            for h in range(num_heads):
                kh = h // group
                scores = keys[:, kh, :] @ q[start + i, h] * scale
                scores[pos + 1 :] = float("-inf")
                out[start + i, h] = torch.softmax(scores, dim=0) @ values[:, kh, :]
        start += ql
    return out
