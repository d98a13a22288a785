"""The fused CPU ops (kernels/fused.py) against the eager torch ops they replace, fp32 and bf16,
in every build (AVX-512, AVX2, portable). fp32 must agree to the last few ulps: the model's fp32
greedy output is tested against transformers with these ops on."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from pagedserve.kernels import fused

pytestmark = pytest.mark.skipif(not fused.available(), reason="no C compiler for the fused ops")

DTYPES = [torch.float32, torch.bfloat16]


def _tol(dtype):
    return dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1.6e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,h", [(1, 576), (3, 64), (17, 1000)])
def test_add_rms_norm_matches_torch(dtype, m, h):
    g = torch.Generator().manual_seed(m * h)
    x = torch.randn(m, h, generator=g).to(dtype)
    res = torch.randn(m, h, generator=g).to(dtype)
    w = (torch.rand(h, generator=g) + 0.5).to(dtype)
    ref_sum = x + res
    ref = F.rms_norm(ref_sum, (h,), w, 1e-5)
    x2, res2 = x.clone(), res.clone()
    fused.add_rms_norm_(x2, res2, w.float().contiguous(), 1e-5)
    assert torch.equal(res2, ref_sum)  # the sum is rounded exactly as torch rounds it
    torch.testing.assert_close(x2, ref, **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_strided_rows(dtype):
    g = torch.Generator().manual_seed(1)
    base = torch.randn(5, 200, generator=g).to(dtype)
    x = base[:, 8:72]  # rows 200 elements apart
    w = torch.rand(64, generator=g).to(dtype)
    out = fused.rms_norm(x, w.float().contiguous(), 1e-6)
    torch.testing.assert_close(out, F.rms_norm(x, (64,), w, 1e-6), **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rot", [64, 32])
def test_rotary_matches_torch_rotate(dtype, rot):
    from pagedserve.gpu.models.rotary import RotaryEmbedding

    rope = RotaryEmbedding(64, rot, 512, 10000.0)
    g = torch.Generator().manual_seed(rot)
    T, H, Hkv = 5, 9, 3
    qkv = torch.randn(T, (H + 2 * Hkv) * 64, generator=g).to(dtype)
    positions = torch.tensor([0, 7, 100, 511, 3])
    ref = qkv.clone()
    cos, sin = rope.cos_sin(positions, dtype)
    rope.rotate_(ref[:, : (H + Hkv) * 64].view(T, H + Hkv, 64), cos, sin)
    got = qkv.clone()
    fused.rotary_neox_(got, H + Hkv, 64, rot, rope.cos_sin_cache, positions)
    # fp32: x1*cos - x2*sin with each product rounded (as transformers computes it); eager
    # addcmul may fuse a multiply-add, so the two differ in the last ulp at most. bf16: ours
    # rounds once from fp32, eager rounds cos/sin and every product to bf16.
    tol = dict(rtol=3e-7, atol=3e-7) if dtype == torch.float32 else _tol(dtype)
    torch.testing.assert_close(got, ref, **tol)
    assert torch.equal(got[:, (H + Hkv) * 64:], qkv[:, (H + Hkv) * 64:])  # v untouched


@pytest.mark.skipif(not fused.has_bf16_gemv(), reason="needs AVX512-BF16")
@pytest.mark.parametrize("m,k,n", [(1, 576, 960), (1, 1536, 576), (3, 576, 7), (16, 100, 33), (2, 31, 5)])
def test_gemv_bf16_matches_fp32_matmul(m, k, n):
    g = torch.Generator().manual_seed(m + k + n)
    x = torch.randn(m, k, generator=g).bfloat16()
    w = torch.randn(n, k, generator=g).bfloat16()
    y = fused.gemv_bf16(x, w)
    ref = x.float() @ w.float().t()  # exact products, fp32 sums: only the final rounding differs
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    torch.testing.assert_close(y.float(), ref, rtol=8e-3, atol=1e-3 * k ** 0.5)


@pytest.mark.skipif(not fused.has_bf16_gemv(), reason="needs AVX512-BF16")
@pytest.mark.parametrize("m,i", [(1, 1536), (5, 7), (300, 1536), (40, 2000)])
def test_silu_and_mul_is_torchs_bit_for_bit(m, i):
    """The eager SiluAndMul's bf16 path: torch's F.silu(gate) * up rounding, on one thread and
    split over threads (the larger shapes), including saturated gates and a masked tail (i % 16)."""
    g = torch.Generator().manual_seed(m + i)
    h = (torch.randn(m, 2 * i, generator=g) * 6).bfloat16()
    h[0, :3] = torch.tensor([-100.0, 100.0, 0.0])
    gate, up = h.chunk(2, dim=-1)
    ref = F.silu(gate) * up
    got = fused.silu_and_mul_bf16(h)
    assert got.shape == (m, i) and torch.equal(got, ref)


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_matches_the_torch_scatter(dtype):
    """Rows of the fused qkv output (strided) land where write_kv_cache_torch puts them; -1 skips."""
    from pagedserve.kernels.torch_attention import write_kv_cache_torch

    g = torch.Generator().manual_seed(7)
    T, hkv, d = 11, 3, 64
    qkv = torch.randn(T, 9 * d + 2 * hkv * d, generator=g).to(dtype)
    k = qkv[:, 9 * d: 9 * d + hkv * d].view(T, hkv, d)
    v = qkv[:, 9 * d + hkv * d:].view(T, hkv, d)
    slots = torch.randperm(40 * 16, generator=g)[:T].to(torch.int64)
    slots[[2, 7]] = -1
    caches = [torch.randn(40, 16, hkv, d, generator=g).to(dtype) for _ in range(2)]
    want = [c.clone() for c in caches]
    assert fused.can_write_kv(k, v, caches[0], slots)
    fused.write_kv(k, v, caches[0], caches[1], slots)
    write_kv_cache_torch(k, v, want[0], want[1], slots)
    assert torch.equal(caches[0], want[0]) and torch.equal(caches[1], want[1])
    before = [c.clone() for c in caches]
    with pytest.raises(IndexError, match="out of range"):
        fused.write_kv(k, v, caches[0], caches[1], torch.full((T,), 40 * 16, dtype=torch.int64))
    assert torch.equal(caches[0], before[0]) and torch.equal(caches[1], before[1])
    assert not fused.can_write_kv(k, v, caches[0], slots.to(torch.int32))  # falls back to torch


def test_portable_and_avx2_builds_agree():
    """The other builds, forced in fresh processes, give the same fp32 results."""
    code = ("import torch; from pagedserve.kernels import fused; assert fused.available(); "
            "g = torch.Generator().manual_seed(0); x = torch.randn(3, 576, generator=g); "
            "r = torch.randn(3, 576, generator=g); w = torch.rand(576, generator=g) + 0.5; "
            "fused.add_rms_norm_(x, r, w, 1e-5); "
            "torch.save((x, r, fused.rms_norm(torch.randn(2, 64, generator=g), w[:64], 1e-5)), sys.argv[1])")
    outs = []
    for isa in ("scalar", "avx2", ""):
        path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"fused-{isa or 'native'}-{os.getpid()}.pt")
        env = dict(os.environ, PAGEDSERVE_ISA=isa)
        subprocess.run([sys.executable, "-c", "import sys; " + code, path], check=True, env=env)
        outs.append(torch.load(path))
        os.unlink(path)
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_disabled_by_env():
    code = "from pagedserve.kernels import fused; print(fused.available())"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True,
                         env=dict(os.environ, PAGEDSERVE_FUSED="0")).stdout.strip()
    assert out == "False"




@pytest.mark.parametrize("m", [1, 2, 3, 8, 16])
@pytest.mark.parametrize("k,n", [(576, 960), (1536, 576), (37, 7)])
def test_fp32_gemv_matches_the_matmul(m, k, n):
    """fz_gemv_f32 (the fused layer's plain fp32 linear): 4 weight rows x 2 activation rows a tile,
    row and K tails, against torch's fp32 matmul."""
    g = torch.Generator().manual_seed(m * 100 + k + n)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    y = fused.gemv_f32(x, w)
    assert torch.allclose(y, x @ w.t(), rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError):
        fused.gemv_f32(torch.randn(17, k), w)
