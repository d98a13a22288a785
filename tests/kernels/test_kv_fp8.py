"""The fp8 (e4m3) KV cache in the kernels: the C writer stores the bytes torch's conversion stores,
every decode kernel (AMX, AVX-512, AVX2, scalar; fp32 and bf16 queries) widens every fp8 value
exactly and attends like the float64 oracle over the same fp8 values, and the torch path reads
fp8 caches too (prefill chunks, the fall-back)."""
from __future__ import annotations

import math
import os
import random
import subprocess
import sys

import pytest
import torch

from pagedserve.kernels import attn_amx, cpu_attention, fused
from pagedserve.kernels.kv_cache_dtype import FP8, KVCacheDtypeError, index_copy_rows, resolve
from pagedserve.kernels.torch_attention import paged_attention_torch, write_kv_cache_torch
from tests.kernels.paged_batch import make_batch, naive_attention
from tests.kernels.test_cpu_attention import ISAS

NAN_BYTE = 0x7F


def _to_fp8(batch, poison: bool = True):
    """The batch with fp8 caches; every slot no request owns holds the fp8 NaN byte."""
    for name in ("k_cache", "v_cache"):
        c = getattr(batch, name).float().clamp(-448, 448).to(FP8)
        if poison:
            hkv, d = c.shape[2], c.shape[3]
            used = torch.zeros(c.shape[0] * c.shape[1], dtype=torch.bool)
            for slots in batch.slots:
                used[torch.tensor(slots, dtype=torch.int64)] = True
            c.view(torch.uint8).view(-1, hkv, d)[~used] = NAN_BYTE
        setattr(batch, name, c)
    return batch


def _run(kernel_isa: str, batch, scale: float, threads: int = 1, part: int = 0) -> torch.Tensor:
    """The batch's decodes through decode_attention_c with the kernel of ``kernel_isa`` ('amx' or
    a paged_attn.c build) pinned for the step."""
    b = batch.meta.num_decodes
    out = torch.full_like(batch.q[:b], float("nan"))
    key = ("c", b, batch.q.shape[1], batch.k_cache.shape[2], batch.k_cache.shape[3], batch.k_cache.shape[1])
    lib = cpu_attention.library() if kernel_isa == "amx" else cpu_attention.library(kernel_isa)
    decode = attn_amx.library().pam_decode if kernel_isa == "amx" else None
    cpu_attention.step_call(batch.meta, key, threads, part, decode)
    cpu_attention.decode_attention_c(lib, batch.q[:b], batch.k_cache, batch.v_cache, batch.meta, scale, out)
    return out


KERNELS = (["amx"] if attn_amx.library() is not None else []) + ISAS
CASES = [(k, dt) for k in KERNELS for dt in (torch.float32, torch.bfloat16) if not (k == "amx" and dt == torch.float32)]


@pytest.mark.parametrize("kernel,dtype", CASES)
@pytest.mark.parametrize("seed", range(3))
def test_decode_over_fp8_caches_matches_naive(kernel: str, dtype: torch.dtype, seed: int) -> None:
    rng = random.Random(seed * 11 + len(kernel))
    num_kv_heads = rng.choice([1, 2, 3])
    group = rng.choice([1, 3, 4, 9])
    head_dim = rng.choice([32, 64, 128])
    block_size = rng.choice([8, 16, 32])
    lens = [rng.randint(0, 5 * block_size) for _ in range(rng.randint(1, 9))] + [block_size - 1, 2 * block_size]
    batch = _to_fp8(make_batch([(c, 1) for c in lens], num_kv_heads * group, num_kv_heads, head_dim, block_size,
                               dtype=dtype, seed=seed))
    scale = 1.0 / math.sqrt(head_dim)
    got = _run(kernel, batch, scale, threads=2 if seed == 2 else 1, part=32 if seed == 1 else 0)
    want = naive_attention(batch, scale)[: len(lens)]  # the oracle reads the same fp8 values
    assert got.dtype == dtype and not got.isnan().any()
    tol = 2e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol * 5)


@pytest.mark.parametrize("kernel,dtype", CASES)
def test_every_fp8_value_is_widened_exactly(kernel: str, dtype: torch.dtype) -> None:
    """A one-token context returns its V row: each of the 254 finite fp8 values, bit for bit."""
    codes = torch.tensor([c for c in range(256) if c & 0x7F != NAN_BYTE], dtype=torch.uint8)  # 254 values
    head_dim = 32
    rows = codes.numel() // head_dim + 1
    values = torch.zeros(rows * head_dim, dtype=torch.uint8)
    values[: codes.numel()] = codes
    values = values.view(rows, 1, head_dim).view(FP8)
    batch = make_batch([(0, 1)] * rows, 2, 1, head_dim, 16, dtype=dtype, seed=3)
    _to_fp8(batch, poison=False)
    flat = batch.v_cache.view(-1, 1, head_dim)
    for r in range(rows):
        flat.view(torch.uint8)[batch.slots[r][0]] = values[r].view(torch.uint8)
    got = _run(kernel, batch, 0.125)
    want = values.to(dtype).expand(rows, 2, head_dim)  # fp8 -> fp32 / bf16 is exact in torch too
    assert torch.equal(got, want)


def test_writer_stores_torchs_bytes_in_every_build() -> None:
    """fz_write_kv's encoding (scalar, AVX2, AVX-512 builds, forced in fresh processes) against
    torch's .to(float8_e4m3fn): random fp32 bit patterns, bf16 values (many exact ties), values
    past 448 and infinities (saturate), subnormals, signed zeros."""
    code = (
        "import sys, torch; from pagedserve.kernels import fused; from pagedserve.kernels.kv_cache_dtype import FP8; "
        "g = torch.Generator().manual_seed(5); "
        "bits = torch.randint(-2**31, 2**31, (1 << 16,), generator=g, dtype=torch.int64).to(torch.int32); "
        "x = bits.view(torch.float32); x = torch.where(x.isnan(), torch.zeros_like(x), x); "
        "edge = torch.tensor([448., 464., 465., -480., 1e30, float('inf'), -float('inf'), 2**-10, 3 * 2**-10, "
        "2**-9 * 7.5, 2**-6 * 0.99, 0., -0., 1.0625, 1.1875], dtype=torch.float32); "
        "scaled = torch.randn(1 << 14, generator=g) * torch.tensor([1e-3, 0.1, 3., 300.]).repeat(1 << 12); "
        "bad = 0\n"
        "for src in (torch.cat([x, edge, scaled]), torch.cat([edge, scaled]).bfloat16()):\n"
        "    n = src.numel() // 96 * 96; k = src[:n].view(-1, 3, 32).contiguous(); T = k.shape[0]\n"
        "    kc = torch.zeros(T // 16 + 1, 16, 3, 32, dtype=FP8); vc = torch.zeros_like(kc)\n"
        "    slots = torch.randperm(T, generator=g)\n"
        "    assert fused.can_write_kv(k, -k, kc, slots)\n"
        "    fused.write_kv(k, -k, kc, vc, slots)\n"
        "    for c, want in ((kc, k), (vc, -k)):\n"
        "        got = c.view(-1, 3, 32)[slots].view(torch.uint8)\n"
        "        bad += int((got != want.to(FP8).view(torch.uint8)).sum())\n"
        "print(bad)"
    )
    assert_prints_zero_in_every_build(code)


def assert_prints_zero_in_every_build(code: str) -> None:
    """Run ``code`` (it prints a count of mismatches) in a fresh process per kernel build: scalar,
    AVX2, and the machine's own."""
    for isa in ("scalar", "avx2", ""):
        env = dict(os.environ, PAGEDSERVE_ISA=isa)
        out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, env=env)
        assert out.stdout.strip() == "0", (isa, out.stdout, out.stderr[-2000:])


def test_torch_writer_and_reader_match_the_kernel_path() -> None:
    """The torch writer (used where the C writer does not apply) stores the same bytes, and the
    torch attention path reads fp8 caches in the queries' dtype: decodes and a prefill chunk."""
    reqs = [(40, 1), (17, 1), (30, 5)]
    batch = make_batch(reqs, 6, 2, 64, 16, dtype=torch.bfloat16, seed=9)
    k_new = torch.randn(7, 2, 64).bfloat16() * 4
    v_new = torch.randn(7, 2, 64).bfloat16() * 4
    caches = [torch.zeros(20, 16, 2, 64, dtype=FP8) for _ in range(4)]
    slots = torch.tensor([3, 40, -1, 77, 100, 101, 5], dtype=torch.int64)
    write_kv_cache_torch(k_new, v_new, caches[0], caches[1], slots)
    fused.write_kv(k_new, v_new, caches[2], caches[3], slots)
    assert torch.equal(caches[0].view(torch.uint8), caches[2].view(torch.uint8))
    assert torch.equal(caches[1].view(torch.uint8), caches[3].view(torch.uint8))
    assert caches[0].view(torch.uint8).view(-1, 2, 64)[40].float().abs().sum() > 0

    _to_fp8(batch, poison=False)  # the torch path masks finite junk (saturated to 448), not NaN
    got = paged_attention_torch(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.125)
    want = naive_attention(batch, 0.125)
    torch.testing.assert_close(got.double(), want, atol=1e-2, rtol=5e-2)


def test_block_copies_move_fp8_bytes() -> None:
    cache = torch.randn(6, 16, 2, 8).to(FP8)
    src = cache[torch.tensor([4, 1])].clone()
    index_copy_rows(cache, torch.tensor([0, 5]), src)
    assert torch.equal(cache[0].view(torch.uint8), src[0].view(torch.uint8))
    assert torch.equal(cache[5].view(torch.uint8), cache[1].view(torch.uint8))


def test_names_and_devices() -> None:
    assert resolve("auto", torch.bfloat16, "cpu") == torch.bfloat16
    assert resolve("fp8", torch.float32, "cpu") == FP8 and resolve("fp8_e4m3", torch.bfloat16, "cpu") == FP8
    with pytest.raises(KVCacheDtypeError, match="fp8_e5m2 is not supported"):
        resolve("fp8_e5m2", torch.bfloat16, "cpu")
    with pytest.raises(KVCacheDtypeError, match="not one of"):
        resolve("int3", torch.bfloat16, "cpu")
    with pytest.raises(KVCacheDtypeError, match="CPU backend only"):
        resolve("fp8", torch.bfloat16, "cuda")
