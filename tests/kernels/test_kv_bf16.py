"""A bf16 KV cache under fp32 activations (``--kv-cache-dtype bfloat16``, the AVX2 machines' fp32
model): the C writer stores the bits torch's ``.to(bfloat16)`` stores, every decode kernel build
(AVX-512, AVX2, scalar) with fp32 queries widens the cached rows exactly and attends like the
float64 oracle over the same bf16 values, and the torch paths (writer, prefill chunks) agree."""
from __future__ import annotations

import math
import random

import pytest
import torch

from pagedserve.kernels import cpu_attention, fused
from pagedserve.kernels.kv_cache_dtype import FP8, KVCacheDtypeError, auto, readable, resolve, write_kind
from pagedserve.kernels.torch_attention import paged_attention_torch, write_kv_cache_torch
from tests.kernels.paged_batch import make_batch, naive_attention
from tests.kernels.test_cpu_attention import ISAS
from tests.kernels.test_kv_fp8 import assert_prints_zero_in_every_build


def _bf16_caches(batch):
    """The fp32 batch with its caches rounded to bf16 (queries stay fp32)."""
    batch.k_cache, batch.v_cache = batch.k_cache.bfloat16(), batch.v_cache.bfloat16()
    return batch


def _run(isa: str, batch, scale: float, threads: int = 1, part: int = 0) -> torch.Tensor:
    b = batch.meta.num_decodes
    out = torch.full_like(batch.q[:b], float("nan"))
    key = ("c", b, batch.q.shape[1], batch.k_cache.shape[2], batch.k_cache.shape[3], batch.k_cache.shape[1])
    lib = cpu_attention.library(isa)
    cpu_attention.step_call(batch.meta, key, threads, part, None)
    cpu_attention.decode_attention_c(lib, batch.q[:b], batch.k_cache, batch.v_cache, batch.meta, scale, out)
    return out


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("seed", range(3))
def test_fp32_decode_over_bf16_caches_matches_naive(isa: str, seed: int) -> None:
    rng = random.Random(seed * 7 + len(isa))
    num_kv_heads, group = rng.choice([1, 2, 3]), rng.choice([1, 3, 4, 9])
    head_dim, block_size = rng.choice([32, 64, 128]), rng.choice([8, 16, 32])
    lens = [rng.randint(0, 5 * block_size) for _ in range(rng.randint(1, 9))] + [block_size - 1, 2 * block_size]
    batch = _bf16_caches(make_batch([(c, 1) for c in lens], num_kv_heads * group, num_kv_heads, head_dim,
                                    block_size, dtype=torch.float32, seed=seed))
    assert cpu_attention.dtype_code(torch.float32, batch.k_cache) == 4
    scale = 1.0 / math.sqrt(head_dim)
    got = _run(isa, batch, scale, threads=2 if seed == 2 else 1, part=32 if seed == 1 else 0)
    want = naive_attention(batch, scale)[: len(lens)]  # the oracle reads the same bf16 values
    assert got.dtype == torch.float32 and not got.isnan().any()
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("isa", ISAS)
def test_a_one_token_context_returns_its_bf16_row_exactly(isa: str) -> None:
    """Softmax over one token is 1: the output is the cached V row widened, bit for bit."""
    batch = _bf16_caches(make_batch([(0, 1)] * 5, 4, 2, 64, 16, dtype=torch.float32, seed=4))
    got = _run(isa, batch, 0.125)
    flat = batch.v_cache.view(-1, 2, 64)
    want = torch.stack([flat[s[0]].float().repeat_interleave(2, dim=0) for s in batch.slots])
    assert torch.equal(got, want)


def test_writer_rounds_like_torch_in_every_build() -> None:
    """fz_write_kv from fp32 rows into bf16 caches (scalar, AVX2, AVX-512 builds, in fresh processes)
    against torch's .to(bfloat16): random fp32 bit patterns (NaNs left out), ties, infinities,
    subnormals, signed zeros."""
    code = (
        "import torch; from pagedserve.kernels import fused; "
        "g = torch.Generator().manual_seed(6); "
        "bits = torch.randint(-2**31, 2**31, (1 << 16,), generator=g, dtype=torch.int64).to(torch.int32); "
        "x = bits.view(torch.float32); x = torch.where(x.isnan(), torch.zeros_like(x), x); "
        "ties = (torch.randint(0, 2**15, (4096,), generator=g).to(torch.int32) << 16 | 0x8000).view(torch.float32); "
        "edge = torch.tensor([float('inf'), -float('inf'), 1e-40, -1e-45, 0., -0., 3.4e38, 1.00390625], dtype=torch.float32); "
        "src = torch.cat([x, ties, edge, torch.randn(4096, generator=g)]); src = src[~src.isnan()]; "
        "n = src.numel() // 96 * 96; "
        "k = src[:n].view(-1, 3, 32).contiguous(); T = k.shape[0]; "
        "kc = torch.zeros(T // 16 + 1, 16, 3, 32, dtype=torch.bfloat16); vc = torch.zeros_like(kc); "
        "slots = torch.randperm(T, generator=g); "
        "assert fused.can_write_kv(k, -k, kc, slots); fused.write_kv(k, -k, kc, vc, slots); "
        "bad = sum(int((c.view(-1, 3, 32)[slots].view(torch.int16) != w.to(torch.bfloat16).view(torch.int16)).sum()) "
        "for c, w in ((kc, k), (vc, -k))); "
        "print(bad)"
    )
    assert_prints_zero_in_every_build(code)


def test_torch_writer_and_prefill_read_bf16_caches_under_fp32() -> None:
    """The torch writer stores the C writer's bits, and the torch path (prefill chunks, the
    fall-back) attends over bf16 caches with fp32 queries."""
    k_new, v_new = torch.randn(7, 2, 64) * 4, torch.randn(7, 2, 64) * 4
    caches = [torch.zeros(20, 16, 2, 64, dtype=torch.bfloat16) for _ in range(4)]
    slots = torch.tensor([3, 40, -1, 77, 100, 101, 5], dtype=torch.int64)
    write_kv_cache_torch(k_new, v_new, caches[0], caches[1], slots)
    fused.write_kv(k_new, v_new, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert caches[0].view(-1, 2, 64)[40].float().abs().sum() > 0

    batch = _bf16_caches(make_batch([(40, 1), (17, 1), (30, 5)], 6, 2, 64, 16, dtype=torch.float32, seed=9))
    got = paged_attention_torch(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.125)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), naive_attention(batch, 0.125), atol=1e-4, rtol=1e-3)


def test_names_dtypes_and_devices() -> None:
    assert resolve("bfloat16", torch.float32, "cpu") == torch.bfloat16
    assert resolve("bfloat16", torch.bfloat16, "cuda") == torch.bfloat16  # the model's own dtype: anywhere
    with pytest.raises(KVCacheDtypeError, match="needs a float32 model"):
        resolve("bfloat16", torch.float16, "cpu")
    with pytest.raises(KVCacheDtypeError, match="CPU backend only"):
        resolve("bfloat16", torch.float32, "cuda")
    assert resolve("float32", torch.float32, "cpu") == torch.float32
    with pytest.raises(KVCacheDtypeError, match="needs a float32 model"):
        resolve("float32", torch.bfloat16, "cpu")
    assert auto(torch.float32, "cpu", True) == torch.bfloat16 and auto(torch.float32, "cpu", False) == torch.float32
    assert auto(torch.float32, "cuda", True) == torch.float32 and auto(torch.bfloat16, "cpu", True) == torch.bfloat16
    assert readable(torch.bfloat16, torch.float32) and not readable(torch.float32, torch.bfloat16)
    assert readable(FP8, torch.float16) and not readable(torch.bfloat16, torch.float16)
    assert [write_kind(c, torch.float32) for c in (torch.float32, FP8, torch.bfloat16)] == [0, 1, 2]
