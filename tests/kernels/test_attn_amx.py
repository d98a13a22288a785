"""The AMX decode kernel (kernels/csrc/paged_attn_amx.c) against the float64 oracle and the torch
path, and the choice between it and the AVX-512 / AVX2 / scalar kernel (PAGEDSERVE_ISA).

Skipped where the CPU has no AMX; the forced non-AMX path is tested everywhere."""
from __future__ import annotations

import math
import random

import pytest
import torch

from pagedserve.kernels import attn_amx, cpu_attention, isa
from pagedserve.kernels.attention import paged_attention
from pagedserve.kernels.torch_attention import paged_attention_torch
from tests.kernels.paged_batch import make_batch, naive_attention
from tests.kernels.test_cpu_attention import _poison_unused

needs_amx = pytest.mark.skipif(attn_amx.library() is None, reason="no AMX (amx_tile, amx_bf16) on this CPU")
BF16_TOL = 1e-2  # same bf16 inputs; products exact, sums fp32, P rounded to bf16 once, output rounded once


def _amx_decode(batch, scale: float, threads: int = 1, part: int = 0) -> torch.Tensor:
    """The batch's decodes through decode_attention_c with the AMX kernel pinned for the step."""
    b = batch.meta.num_decodes
    out = torch.full_like(batch.q[:b], float("nan"))
    key = ("c", b, batch.q.shape[1], batch.k_cache.shape[2], batch.k_cache.shape[3], batch.k_cache.shape[1])
    cpu_attention.step_call(batch.meta, key, threads, part, attn_amx.library().pam_decode)
    cpu_attention.decode_attention_c(cpu_attention.library(), batch.q[:b], batch.k_cache, batch.v_cache, batch.meta,
                                     scale, out)
    return out


def _lens(rng: random.Random, n: int, block_size: int, longest: int) -> list[int]:
    """n context lengths, none a multiple of the block size (plus one of 0: a single token)."""
    lens = [rng.randint(1, longest) for _ in range(n)]
    lens = [c + 1 if (c + 1) % block_size == 0 else c for c in lens]
    if n > 2:
        lens[1] = 0
    return lens


@needs_amx
@pytest.mark.parametrize("batch_size", [1, 2, 3, 5, 8, 11, 16])
@pytest.mark.parametrize("group", [1, 3, 4, 7, 16])
def test_amx_matches_naive(batch_size: int, group: int) -> None:
    """Batch sizes 1..16, GQA groups up to the tile's 16 columns, head_dim 32..256, blocks of 8..64
    (a 16-token tile inside a block, across blocks, or a block of its own), shuffled block ids, NaN
    in every slot no request owns."""
    rng = random.Random(batch_size * 31 + group)
    num_kv_heads = rng.choice([1, 2, 3])
    head_dim = rng.choice([32, 64, 96, 128, 256])
    block_size = rng.choice([8, 16, 32, 64])
    reqs = [(c, 1) for c in _lens(rng, batch_size, block_size, 6 * block_size)]
    batch = make_batch(reqs, num_kv_heads * group, num_kv_heads, head_dim, block_size, dtype=torch.bfloat16,
                       seed=batch_size + group)
    _poison_unused(batch)
    scale = 1.0 / math.sqrt(head_dim)
    got = _amx_decode(batch, scale)
    assert got.dtype == torch.bfloat16 and not got.isnan().any()
    torch.testing.assert_close(got.double(), naive_attention(batch, scale)[:batch_size], atol=BF16_TOL, rtol=BF16_TOL)


@needs_amx
@pytest.mark.parametrize("batch_size", [1, 4, 16])
def test_amx_matches_torch_path_default_model(batch_size: int) -> None:
    """Default-model shapes (9 heads, 3 KV heads, head_dim 64, block 16) at serving contexts,
    against kernels/torch_attention.py."""
    rng = random.Random(batch_size)
    reqs = [(rng.randint(100, 700), 1) for _ in range(batch_size)]
    batch = make_batch(reqs, 9, 3, 64, 16, dtype=torch.bfloat16, seed=batch_size)
    got = _amx_decode(batch, 0.125)
    want = paged_attention_torch(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.125)
    torch.testing.assert_close(got.float(), want.float(), atol=BF16_TOL, rtol=BF16_TOL)


@needs_amx
@pytest.mark.parametrize("threads,part", [(2, 0), (1, 16), (2, 16), (2, 48), (3, 32), (2, 40)])
def test_amx_threads_and_split_parts(threads: int, part: int) -> None:
    """Parts of a request (flash-decoding; 40: parts not aligned to 16-token tiles) combine exactly,
    each OpenMP thread with its own tile config."""
    rng = random.Random(threads * 100 + part)
    reqs = [(rng.randint(0, 150), 1) for _ in range(5)] + [(0, 1), (15, 1), (16, 1), (31, 1)]
    batch = make_batch(reqs, 6, 2, 32, 16, dtype=torch.bfloat16, seed=part)
    _poison_unused(batch)
    got = _amx_decode(batch, 0.2, threads, part)
    torch.testing.assert_close(got.double(), naive_attention(batch, 0.2)[: len(reqs)], atol=BF16_TOL, rtol=BF16_TOL)


@needs_amx
def test_amx_rejects_what_it_does_not_take() -> None:
    """fp32, head_dim not a multiple of 32, groups past 16: -1 before reading anything."""
    lib = attn_amx.library()
    batch = make_batch([(20, 1)], 4, 2, 32, 16, dtype=torch.bfloat16)
    m, out = batch.meta, torch.empty_like(batch.q)

    def call(**over) -> int:
        a = dict(q=batch.q.data_ptr(), qs=4 * 32, k=batch.k_cache.data_ptr(), v=batch.v_cache.data_ptr(),
                 bt=m.block_tables.data_ptr(), bts=m.block_tables.stride(0), sl=m.seq_lens.data_ptr(), n=1, h=4,
                 hkv=2, d=32, bs=16, scale=0.2, out=out.data_ptr(), os=4 * 32, dtype=1, part=0, threads=1)
        a.update(over)
        return lib.pam_decode(*a.values())

    assert call() == 0
    assert call(dtype=0) == -1 and call(d=48) == -1 and call(h=34) == -1  # 34 heads over 2 KV heads: group 17
    assert not attn_amx.applies(torch.float32, 9, 3, 64) and not attn_amx.applies(torch.bfloat16, 9, 3, 48)
    assert attn_amx.applies(torch.bfloat16, 9, 3, 64) and not attn_amx.applies(torch.bfloat16, 34, 2, 64)


@pytest.fixture
def fresh_libraries():
    """The loaders read PAGEDSERVE_ISA once; clear their caches around a test that sets it."""
    def clear() -> None:
        attn_amx.library.cache_clear()
        cpu_attention.library.cache_clear()
        cpu_attention._decode_with.cache_clear()
    clear()
    yield
    clear()


@pytest.mark.parametrize("forced", ["amx", "avx512bf16", "avx2", "scalar", None])
def test_isa_env_forces_the_path(monkeypatch, fresh_libraries, forced: str | None) -> None:
    """Through kernels.attention: ``amx`` runs the AMX kernel, another build name runs that build and
    never AMX, unset runs AMX where there is one; every choice matches the oracle."""
    runnable = isa.levels_here("paged_attn") + isa.levels_here("paged_attn_amx")
    if forced is not None and forced not in runnable:
        pytest.skip(f"this CPU cannot run {forced}")
    if forced is None:
        monkeypatch.delenv("PAGEDSERVE_ISA", raising=False)
    else:
        monkeypatch.setenv("PAGEDSERVE_ISA", forced)
    batch = make_batch([(37, 1), (130, 1), (5, 1)], 9, 3, 64, 16, dtype=torch.bfloat16, seed=7)
    _poison_unused(batch)
    got = paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.125)
    call = batch.meta.cpu_plan[1]
    want_amx = forced == "amx" or (forced is None and "amx" in runnable)
    assert (call.decode is not None) == want_amx
    if not want_amx and forced is not None:
        assert cpu_attention.isa() == forced and attn_amx.library() is None
    torch.testing.assert_close(got.double(), naive_attention(batch, 0.125), atol=BF16_TOL, rtol=BF16_TOL)


def test_fp32_never_takes_amx(fresh_libraries) -> None:
    batch = make_batch([(40, 1), (9, 1)], 6, 2, 32, 16, dtype=torch.float32, seed=3)
    got = paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.2)
    assert batch.meta.cpu_plan[1].decode is None
    torch.testing.assert_close(got.double(), naive_attention(batch, 0.2), atol=2e-5, rtol=1e-4)


@needs_amx
def test_amx_strided_query_in_a_mixed_batch(fresh_libraries) -> None:
    """Through kernels.attention: q a view of a fused QKV row (row stride past H * D), decodes on
    AMX, prefill chunks by SDPA."""
    reqs = [(20, 1), (70, 1), (7, 1), (0, 9), (12, 4)]
    batch = make_batch(reqs, 9, 3, 64, 16, dtype=torch.bfloat16, seed=13)
    t = batch.q.shape[0]
    fused = torch.randn(t, (9 + 2 * 3) * 64).to(torch.bfloat16)
    fused[:, : 9 * 64] = batch.q.reshape(t, -1)
    q = fused[:, : 9 * 64].view(t, 9, 64)
    got = paged_attention(q, batch.k_cache, batch.v_cache, batch.meta, 0.125)
    assert batch.meta.cpu_plan[1].decode is not None
    torch.testing.assert_close(got.double(), naive_attention(batch, 0.125), atol=BF16_TOL, rtol=BF16_TOL)
