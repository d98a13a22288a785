"""pagedserve.kernels.window_attention: paged attention with a sliding window and a tanh soft-cap, against a
naive per-request attention written from the definition, on a flat batch that mixes decodes
and prefill chunks over scattered blocks; with neither option it is the torch paged oracle."""
from __future__ import annotations

import math

import pytest
import torch

from pagedserve.kernels.metadata import AttentionMetadata
from pagedserve.kernels.torch_attention import paged_attention_torch, write_kv_cache_torch
from pagedserve.kernels.window_attention import paged_attention_window

BLOCK, HKV, GROUP, D = 4, 2, 3, 8


def naive(q, keys, values, first_pos, scale, window, softcap):
    """q [Q, H, D] at positions first_pos.. over keys/values [S, Hkv, D] at 0..S-1."""
    out = torch.empty_like(q)
    for i in range(q.shape[0]):
        p = first_pos + i
        for h in range(q.shape[1]):
            kv = h // GROUP
            lo = max(0, p - window + 1) if window else 0
            s = keys[lo:p + 1, kv] @ q[i, h] * scale
            if softcap:
                s = torch.tanh(s / softcap) * softcap
            out[i, h] = torch.softmax(s, 0) @ values[lo:p + 1, kv]
    return out


def build(reqs, g):
    """reqs: (cached, new) per request, decodes first. Returns q, caches, meta, per-request K/V."""
    tables, kvs, qsl, seq_lens, slots = [], [], [0], [], []
    free = torch.randperm(40, generator=g).tolist()
    k_cache = torch.zeros(40, BLOCK, HKV, D)
    v_cache = torch.zeros(40, BLOCK, HKV, D)
    for cached, new in reqs:
        total = cached + new
        table = [free.pop() for _ in range(-(-total // BLOCK))]
        keys, values = torch.randn(total, HKV, D, generator=g), torch.randn(total, HKV, D, generator=g)
        slot = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(total)])
        write_kv_cache_torch(keys, values, k_cache, v_cache, slot)
        tables.append(table)
        kvs.append((keys, values))
        qsl.append(qsl[-1] + new)
        seq_lens.append(total)
        slots += slot[cached:].tolist()
    width = max(len(t) for t in tables)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32), seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        slot_mapping=torch.tensor(slots), num_decodes=sum(1 for _, n in reqs if n == 1),
        max_query_len=max(n for _, n in reqs), max_seq_len=max(seq_lens), query_start_loc_host=qsl,
        seq_lens_host=seq_lens)
    q = torch.randn(qsl[-1] + 2, HKV * GROUP, D, generator=g)  # 2 padding rows
    return q, k_cache, v_cache, meta, kvs


REQS = [(6, 1), (13, 1), (0, 1), (0, 9), (5, 7), (17, 3)]


@pytest.mark.parametrize("window,softcap", [(5, None), (None, 1.5), (3, 0.7), (1, None), (100, None)])
def test_matches_the_definition(window, softcap):
    g = torch.Generator().manual_seed(window or 0)
    q, k_cache, v_cache, meta, kvs = build(REQS, g)
    q[-2:] = float("nan")  # padding rows: never read, zeroed in the output
    scale = 1 / math.sqrt(D)
    out = paged_attention_window(q, k_cache, v_cache, meta, scale, window, softcap)
    for r, ((cached, new), (keys, values)) in enumerate(zip(REQS, kvs)):
        start = meta.query_start_loc_host[r]
        want = naive(q[start:start + new], keys, values, cached, scale, window, softcap)
        torch.testing.assert_close(out[start:start + new], want, atol=1e-5, rtol=1e-5)
    assert torch.equal(out[-2:], torch.zeros_like(out[-2:]))


def test_without_window_or_cap_is_the_paged_oracle():
    q, k_cache, v_cache, meta, _ = build(REQS, torch.Generator().manual_seed(3))
    want = paged_attention_torch(q, k_cache, v_cache, meta, 0.3)
    meta.cpu_plan = None
    torch.testing.assert_close(paged_attention_window(q, k_cache, v_cache, meta, 0.3, None, None), want,
                               atol=1e-5, rtol=1e-5)


def test_out_of_window_blocks_are_never_read():
    """A decode whose window lies in its last block reads nothing before it: poison the earlier
    blocks (NaN) and the output stays finite and equal to the definition's."""
    g = torch.Generator().manual_seed(4)
    q, k_cache, v_cache, meta, kvs = build([(14, 1)], g)
    table = meta.block_tables[0].tolist()
    k_cache[table[:3]] = float("nan")  # positions 0..11; the window of position 14 is 12..14
    v_cache[table[:3]] = float("nan")
    out = paged_attention_window(q, k_cache, v_cache, meta, 0.3, 3, None)
    keys, values = kvs[0]
    torch.testing.assert_close(out[:1], naive(q[:1], keys, values, 14, 0.3, 3, None), atol=1e-5, rtol=1e-5)
