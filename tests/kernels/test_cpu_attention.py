"""The C decode kernel (kernels/csrc/paged_attn.c) against the float64 oracle, in every build this
CPU runs (AVX-512, AVX2, scalar), fp32 and bf16, with NaN in every cache slot no request owns."""
from __future__ import annotations

import math
import random

import pytest
import torch

from pagedserve.kernels import cpu_attention, isa
from pagedserve.kernels.attention import paged_attention
from tests.kernels.paged_batch import make_batch, naive_attention

ISAS = isa.levels_here("paged_attn")


def _poison_unused(batch) -> None:
    """NaN in every K/V slot outside the requests' tokens: the kernel must never read them."""
    num_blocks, block_size, hkv, d = batch.k_cache.shape
    used = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    for slots in batch.slots:
        used[torch.tensor(slots, dtype=torch.int64)] = True
    batch.k_cache.view(-1, hkv, d)[~used] = float("nan")
    batch.v_cache.view(-1, hkv, d)[~used] = float("nan")


def _decode(isa: str, batch, scale: float, threads: int = 1, part: int = 0) -> torch.Tensor:
    """Run the kernel of build ``isa`` on the batch's decodes with explicit threads / part size."""
    lib = cpu_attention.library(isa)
    assert lib is not None
    b = batch.meta.num_decodes
    out = torch.full_like(batch.q[:b], float("nan"))
    cpu_attention.step_call(batch.meta, ("c", b, batch.q.shape[1], batch.k_cache.shape[2], batch.k_cache.shape[3],
                                         batch.k_cache.shape[1]), threads, part)
    cpu_attention.decode_attention_c(lib, batch.q[:b], batch.k_cache, batch.v_cache, batch.meta, scale, out)
    return out


def _decode_requests(rng: random.Random, n: int, block_size: int, longest: int) -> list[tuple[int, int]]:
    lens = [rng.randint(0, longest) for _ in range(n)]
    lens += [block_size - 1, block_size, 2 * block_size - 1][: max(0, 4 - n)]  # block boundaries
    return [(c, 1) for c in lens]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", range(4))
def test_decode_matches_naive(isa: str, dtype: torch.dtype, seed: int) -> None:
    rng = random.Random(seed * 7 + len(isa))
    num_kv_heads = rng.choice([1, 2, 3])
    group = rng.choice([1, 2, 3, 4, 7, 9])  # 9: past the specialised group sizes
    head_dim = rng.choice([16, 32, 64, 128])
    block_size = rng.choice([8, 16, 32])
    reqs = _decode_requests(rng, rng.randint(1, 9), block_size, 5 * block_size)
    batch = make_batch(reqs, num_kv_heads * group, num_kv_heads, head_dim, block_size, dtype=dtype, seed=seed)
    _poison_unused(batch)
    scale = 1.0 / math.sqrt(head_dim)
    got = _decode(isa, batch, scale)
    want = naive_attention(batch, scale)[: len(reqs)]
    assert got.dtype == dtype and not got.isnan().any()
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=1e-4)
    else:  # inputs are the same bf16 values; the kernel computes in fp32 and rounds the output once
        torch.testing.assert_close(got.double(), want, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("threads,part", [(2, 0), (1, 16), (2, 16), (2, 48), (3, 32)])
def test_threads_and_split_parts(isa: str, threads: int, part: int) -> None:
    """Parts of a request's tokens are combined exactly (flash-decoding), with any thread count."""
    rng = random.Random(threads * 100 + part)
    reqs = [(rng.randint(0, 150), 1) for _ in range(5)] + [(0, 1), (15, 1), (16, 1)]
    for dtype, tol in ((torch.float32, 2e-5), (torch.bfloat16, 1e-2)):
        batch = make_batch(reqs, 6, 2, 32, 16, dtype=dtype, seed=part)
        _poison_unused(batch)
        got = _decode(isa, batch, 0.2, threads, part)
        torch.testing.assert_close(got.double(), naive_attention(batch, 0.2)[: len(reqs)], atol=tol, rtol=tol * 5)


def test_dispatch_mixed_batch_strided_query_and_padding() -> None:
    """Through kernels.attention: decodes by the kernel, prefill chunks by SDPA, padding zeroed."""
    reqs = [(20, 1), (33, 1), (7, 1), (0, 7), (12, 4)]
    batch = make_batch(reqs, 6, 2, 16, 8, seed=11, pad_tokens=2)
    t = batch.q.shape[0]
    fused = torch.randn(t, 6 * 16 + 2 * 2 * 16)
    fused[:, : 6 * 16] = batch.q.reshape(t, -1)
    q = fused[:, : 6 * 16].view(t, 6, 16)
    out = torch.full_like(batch.q, float("nan"))
    got = paged_attention(q, batch.k_cache, batch.v_cache, batch.meta, 0.25, out=out)
    assert got.data_ptr() == out.data_ptr()
    n = batch.meta.num_tokens
    torch.testing.assert_close(got[:n], naive_attention(batch, 0.25).float()[:n], atol=2e-5, rtol=1e-4)
    assert (got[n:] == 0).all()
    assert cpu_attention.isa() in ISAS  # this machine has a compiler: the kernel ran, not torch


def test_plan_threads_and_parts(monkeypatch) -> None:
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    # tiny work: one thread, no split
    assert cpu_attention._threads_and_parts([10, 12], 9, 3, 64, 16) == (1, 0)
    # many requests: every thread busy without splitting
    assert cpu_attention._threads_and_parts([500] * 48, 9, 3, 64, 16) == (2, 0)
    # one request of the default model at ~320 tokens (single-stream decode): both threads, two halves
    threads, part = cpu_attention._threads_and_parts([320], 9, 3, 64, 16)
    assert threads == 2 and part == 160
    # one long request on two threads: two halves of whole blocks (three parts left a thread idle a third)
    threads, part = cpu_attention._threads_and_parts([2000], 9, 3, 64, 16)
    assert threads == 2 and part % 16 == 0 and -(-2000 // part) == 2
    # three requests on two threads: each in two parts, six items, three per thread
    threads, part = cpu_attention._threads_and_parts([900, 1000, 1000], 9, 3, 64, 16)
    assert threads == 2 and part % 16 == 0 and -(-1000 // part) == 2 and -(-900 // part) == 2


def test_step_call_built_once_per_step() -> None:
    """The int32 tables and lengths are prepared by the first layer's call and reused by the others."""
    batch = make_batch([(40, 1), (17, 1)], 6, 2, 32, 16, seed=5)
    batch.meta.block_tables = batch.meta.block_tables.to(torch.int64)  # needs a conversion
    want = naive_attention(batch, 0.25).float()
    first = paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.25)
    call = batch.meta.cpu_plan[1]
    assert isinstance(call, cpu_attention._StepCall) and call.tables.dtype == torch.int32
    second = paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.25)
    assert batch.meta.cpu_plan[1] is call
    torch.testing.assert_close(first, want, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(second, want, atol=2e-5, rtol=1e-4)


def test_torch_env_selects_the_torch_path(monkeypatch) -> None:
    batch = make_batch([(30, 1), (5, 1)], 4, 2, 16, 8, seed=2)
    monkeypatch.setenv("PAGEDSERVE_CPU_ATTENTION", "torch")
    assert cpu_attention._kernel_for(batch.q.dtype, batch.q.shape[1], batch.k_cache) is None
    got = paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.25)
    torch.testing.assert_close(got, naive_attention(batch, 0.25).float(), atol=2e-5, rtol=1e-4)


def test_unsupported_head_dim_falls_back_to_torch() -> None:
    width = cpu_attention.library().pa_width()
    if width == 1:
        pytest.skip("the scalar build takes any head_dim")
    batch = make_batch([(30, 1), (5, 1)], 4, 2, width + 4, 8, seed=3)
    assert cpu_attention._kernel_for(batch.q.dtype, batch.q.shape[1], batch.k_cache) is None
    got = paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.25)
    torch.testing.assert_close(got, naive_attention(batch, 0.25).float(), atol=2e-5, rtol=1e-4)


def test_scalar_build_any_head_dim() -> None:
    batch = make_batch([(40, 1), (3, 1), (17, 1)], 6, 3, 24, 8, seed=4)
    _poison_unused(batch)
    got = _decode("scalar", batch, 0.3)
    torch.testing.assert_close(got.double(), naive_attention(batch, 0.3)[:3], atol=2e-5, rtol=1e-4)
