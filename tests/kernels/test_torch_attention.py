"""Torch paged attention and write_kv_cache against naive per-slot oracles (CPU)."""
from __future__ import annotations

import math
import random

import pytest
import torch

from pagedserve.kernels.attention import paged_attention, write_kv_cache
from pagedserve.kernels import torch_attention
from pagedserve.kernels.torch_attention import paged_attention_torch
from tests.kernels.paged_batch import make_batch, naive_attention


@pytest.fixture(autouse=True)
def _torch_path(monkeypatch):
    """These tests pin the torch path (the oracle); tests/kernels/test_cpu_attention.py covers the C kernel."""
    monkeypatch.setenv("PAGEDSERVE_CPU_ATTENTION", "torch")


def _run_poisoned(batch, scale: float) -> torch.Tensor:
    out = torch.full_like(batch.q, float("nan"))
    result = paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, scale, out=out)
    assert result.data_ptr() == out.data_ptr()
    return result


def _random_requests(rng: random.Random, num_decodes: int, num_prefills: int, block_size: int):
    reqs = [(rng.randint(0, 4 * block_size), 1) for _ in range(num_decodes)]
    for _ in range(num_prefills):
        context = rng.choice([0, rng.randint(1, 3 * block_size)])
        reqs.append((context, rng.randint(2, 2 * block_size + 3)))
    return reqs


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2), (8, 2)])
def test_mixed_batch_matches_naive(block_size: int, num_heads: int, num_kv_heads: int) -> None:
    rng = random.Random(block_size * 100 + num_heads * 10 + num_kv_heads)
    reqs = _random_requests(rng, num_decodes=rng.randint(1, 4), num_prefills=rng.randint(1, 3), block_size=block_size)
    head_dim = rng.choice([16, 32, 64])
    batch = make_batch(reqs, num_heads, num_kv_heads, head_dim, block_size, seed=rng.randint(0, 10**6))
    scale = 1.0 / math.sqrt(head_dim)
    got = _run_poisoned(batch, scale)
    want = naive_attention(batch, scale).float()
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize(
    "reqs",
    [
        [(0, 1)],  # first token of a sequence, decoded alone
        [(7, 1), (8, 1), (15, 1), (16, 1)],  # decodes on both sides of block boundaries
        [(0, 37)],  # prefill without context
        [(16, 16)],  # chunk starts exactly at a block boundary
        [(13, 9), (0, 5), (40, 2)],  # prefills only, with and without context
        [(3, 1), (0, 24), (21, 11)],  # mixed
    ],
)
def test_edge_shapes_match_naive(reqs) -> None:
    batch = make_batch(reqs, num_heads=6, num_kv_heads=2, head_dim=32, block_size=8, seed=len(reqs))
    got = _run_poisoned(batch, 0.2)
    torch.testing.assert_close(got, naive_attention(batch, 0.2).float(), atol=2e-5, rtol=1e-4)


def test_padding_rows_zeroed_and_result_dtype() -> None:
    batch = make_batch([(5, 1), (9, 4)], 4, 2, 16, 16, pad_tokens=3)
    out = _run_poisoned(batch, 0.25)
    assert (out[5:] == 0).all()
    assert not out.isnan().any()
    torch.testing.assert_close(out[:5], naive_attention(batch, 0.25).float()[:5], atol=2e-5, rtol=1e-4)
    fresh = paged_attention_torch(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.25)
    assert fresh.dtype == batch.q.dtype and fresh.shape == batch.q.shape
    torch.testing.assert_close(fresh, out)


def test_bf16_close_to_fp32() -> None:
    reqs = [(30, 1), (70, 1), (0, 20), (25, 7)]
    b32 = make_batch(reqs, 9, 3, 64, 16, dtype=torch.float32, seed=3)
    b16 = make_batch(reqs, 9, 3, 64, 16, dtype=torch.bfloat16, seed=3)
    got = _run_poisoned(b16, 0.125)
    assert got.dtype == torch.bfloat16
    want = naive_attention(b16, 0.125).float()  # oracle over the same bf16-rounded inputs
    torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=3e-2)
    assert b32.q.dtype == torch.float32


def test_query_heads_use_their_own_kv_head() -> None:
    # With GQA 4/2, heads 0-1 read kv head 0 and heads 2-3 kv head 1: zero V of kv head 1 only.
    batch = make_batch([(10, 1), (4, 3)], 4, 2, 16, 8, seed=5)
    batch.v_cache[:, :, 1, :] = 0.0
    got = _run_poisoned(batch, 0.25)
    assert (got[:, 2:] == 0).all()
    assert (got[:, :2].abs() > 0).any()
    torch.testing.assert_close(got, naive_attention(batch, 0.25).float(), atol=2e-5, rtol=1e-4)


def test_write_kv_cache_scatters_and_skips_minus_one() -> None:
    gen = torch.Generator().manual_seed(0)
    num_blocks, block_size, hkv, d = 6, 8, 2, 4
    k_cache = torch.full((num_blocks, block_size, hkv, d), float("nan"))
    v_cache = torch.full((num_blocks, block_size, hkv, d), float("nan"))
    slots = torch.tensor([17, -1, 0, 47, 8, -1, 30], dtype=torch.int64)
    k = torch.randn(7, hkv, d, generator=gen)
    v = torch.randn(7, hkv, d, generator=gen)
    write_kv_cache(k, v, k_cache, v_cache, slots)
    written = 0
    for i, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        written += 1
        assert torch.equal(k_cache[s // block_size, s % block_size], k[i])
        assert torch.equal(v_cache[s // block_size, s % block_size], v[i])
    # Exactly the valid slots changed; everything else still NaN.
    assert (~k_cache.isnan()).all(-1).all(-1).sum() == written
    assert (~v_cache.isnan()).all(-1).all(-1).sum() == written


def test_write_kv_cache_all_valid_and_dtype_cast() -> None:
    k_cache = torch.zeros(4, 16, 3, 8, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(64)[:20]
    k = torch.randn(20, 3, 8)
    v = torch.randn(20, 3, 8)
    write_kv_cache(k, v, k_cache, v_cache, slots)
    flat_k = k_cache.view(64, 3, 8)
    flat_v = v_cache.view(64, 3, 8)
    assert torch.equal(flat_k[slots], k.bfloat16())
    assert torch.equal(flat_v[slots], v.bfloat16())
    untouched = torch.ones(64, dtype=torch.bool)
    untouched[slots] = False
    assert (flat_k[untouched] == 0).all()


def test_write_then_attend_round_trip() -> None:
    # Decode step as the model does it: write the new token's K/V, then attend over the cache.
    batch = make_batch([(12, 1), (0, 6)], 4, 4, 16, 8, seed=9)
    k_flat = batch.k_cache.view(-1, 4, 16)
    v_flat = batch.v_cache.view(-1, 4, 16)
    new_slots = batch.meta.slot_mapping
    k_new = k_flat[new_slots].clone()
    v_new = v_flat[new_slots].clone()
    k_flat[new_slots] = 0.0  # wipe them; write_kv_cache must restore exactly these
    v_flat[new_slots] = 0.0
    write_kv_cache(k_new, v_new, batch.k_cache, batch.v_cache, new_slots)
    got = _run_poisoned(batch, 0.25)
    torch.testing.assert_close(got, naive_attention(batch, 0.25).float(), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("kernel", ["bmm", "sdpa"])
@pytest.mark.parametrize("chunk_bytes", [1, 20_000, 4 << 20])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 1), (6, 2), (8, 2)])
def test_decode_kernels_and_chunking(monkeypatch, kernel: str, chunk_bytes: int, num_heads: int, num_kv_heads: int) -> None:
    """Both decode kernels, with one chunk, several length-sorted chunks, and one request per chunk."""
    chosen = torch_attention._decode_bmm if kernel == "bmm" else torch_attention._decode_sdpa
    calls = []

    def pick(dtype, batch):
        calls.append(batch)
        return chosen

    monkeypatch.setattr(torch_attention, "_pick_decode_kernel", pick)
    monkeypatch.setattr(torch_attention, "DECODE_CHUNK_BYTES", chunk_bytes)
    rng = random.Random(chunk_bytes + num_heads)
    reqs = [(rng.randint(0, 60), 1) for _ in range(7)] + [(9, 5)]
    batch = make_batch(reqs, num_heads, num_kv_heads, 16, 8, seed=num_kv_heads)
    got = _run_poisoned(batch, 0.25)
    torch.testing.assert_close(got, naive_attention(batch, 0.25).float(), atol=2e-5, rtol=1e-4)
    assert sum(calls) == 7
    if chunk_bytes == 1:
        assert calls == [1] * 7
    elif chunk_bytes == 4 << 20:
        assert calls == [7]
    else:
        assert 1 < len(calls) < 7


def test_decode_chunks_sorted_and_bounded(monkeypatch) -> None:
    monkeypatch.setattr(torch_attention, "DECODE_CHUNK_BYTES", 1000)
    lens = [50, 3, 17, 64, 8, 33, 1]
    chunks = torch_attention._decode_chunks(lens, 8, bytes_per_token=4)
    flat = [i for c in chunks for i in c]
    assert sorted(flat) == list(range(len(lens)))
    assert [lens[i] for i in flat] == sorted(lens)
    for c in chunks:
        padded = max(-(-lens[i] // 8) * 8 for i in c)
        assert len(c) == 1 or len(c) * padded * 4 <= 1000


def test_strided_query_from_fused_projection() -> None:
    """q as the model passes it: a [T, H, D] view of columns of a wider qkv tensor."""
    batch = make_batch([(20, 1), (33, 1), (0, 7), (12, 4)], 6, 2, 16, 8, seed=11)
    num_tokens = batch.q.shape[0]
    fused = torch.randn(num_tokens, 6 * 16 + 2 * 2 * 16)
    fused[:, : 6 * 16] = batch.q.reshape(num_tokens, -1)
    q = fused[:, : 6 * 16].view(num_tokens, 6, 16)
    assert not q.is_contiguous()
    got = paged_attention(q, batch.k_cache, batch.v_cache, batch.meta, 0.25)
    torch.testing.assert_close(got, naive_attention(batch, 0.25).float(), atol=2e-5, rtol=1e-4)


def test_rejects_head_count_not_multiple_of_kv_heads() -> None:
    batch = make_batch([(3, 1)], 4, 2, 16, 8)
    with pytest.raises(ValueError, match="multiple"):
        paged_attention(batch.q[:, :3], batch.k_cache, batch.v_cache, batch.meta, 0.25)


@pytest.mark.parametrize("seed", range(8))
def test_random_batches_match_naive(seed: int) -> None:
    rng = random.Random(1000 + seed)
    num_kv_heads = rng.choice([1, 2, 3])
    num_heads = num_kv_heads * rng.choice([1, 3, 4])
    block_size = rng.choice([8, 16, 32, 64])
    head_dim = rng.choice([8, 24, 64])
    reqs = _random_requests(rng, rng.randint(0, 6), rng.randint(0 if seed % 2 else 1, 3), block_size)
    if not reqs:
        reqs = [(0, 1)]
    batch = make_batch(reqs, num_heads, num_kv_heads, head_dim, block_size, seed=seed, pad_tokens=rng.randint(0, 2))
    scale = rng.uniform(0.05, 0.5)
    got = _run_poisoned(batch, scale)
    n = batch.meta.num_tokens
    torch.testing.assert_close(got[:n], naive_attention(batch, scale).float()[:n], atol=2e-5, rtol=1e-4)
    assert (got[n:] == 0).all()
