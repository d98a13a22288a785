"""The AVX-512 VNNI kernel with 16-channel weights (kernels/qgemm_n16.py) against the reference
(dequantize, then matmul), with the same tolerances as tests/kernels/test_qgemm.py; and which
path a process picks."""
from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

from pagedserve.kernels import isa, qgemm, qgemm_n16
from tests.kernels.test_qgemm import RTOL, _check, _poisoned_kernel_output

# skipped only where the CPU lacks the extensions or a path is forced: a failed build fails
needs_n16 = pytest.mark.skipif(isa.choose("qgemm_n16") is None,
                               reason="this CPU (or a PAGEDSERVE_ISA cap) runs the row-layout kernel")


def _unpack_q4_1(words: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Codes [n, k] from the n16 q4_1 bytes, read as csrc/qgemm_n16.c documents them."""
    g = k // 32
    b = words.reshape(-1, g, 4, 32, 2).to(torch.int32)
    w16 = b[..., 0] | (b[..., 1] << 8)  # [NB, G, t, l]
    out = torch.empty(b.shape[0] * 16, k, dtype=torch.int32)
    for s in range(4):
        nib = (w16 >> (4 * s)) & 0xF  # value at input 32 g + 2 (4 t + s) + (l & 1), channel l // 2
        for t in range(4):
            for l in range(32):
                ch = torch.arange(b.shape[0]) * 16 + l // 2
                cols = torch.arange(g) * 32 + 2 * (4 * t + s) + (l & 1)
                out[ch[:, None], cols[None, :]] = nib[:, :, t, l]
    return out[:n]


def test_q4_1_layout_is_the_documented_one():
    gen = torch.Generator().manual_seed(3)
    n, k = 21, 64
    w4, d, mn = qgemm.quantize_int4(torch.randn(n, k, generator=gen))
    words, d16, m16 = qgemm_n16.repack_q4_1(w4, d, mn)
    p = w4.reshape(n, k // 32, 16).to(torch.int32)
    codes = torch.cat([p & 0xF, p >> 4], dim=2).reshape(n, k)
    assert torch.equal(_unpack_q4_1(words, n, k), codes)
    assert d16.shape == (2, 2, 16) and torch.equal(d16[1, :, :5], d[16:].t()) and (d16[1, :, 5:] == 0).all()
    assert torch.equal(m16[0], mn[:16].t())


def test_q8_0_layout_is_the_documented_one():
    gen = torch.Generator().manual_seed(4)
    n, k = 19, 96
    w8, d = qgemm.quantize_q8_0(torch.randn(n, k, generator=gen))
    codes, d16 = qgemm_n16.repack_q8_0(w8, d)
    c = codes.reshape(2, 3, 16, 32)  # [NB, G, j, l]: channel 16 b + l // 2, input 32 g + 2 j + (l & 1)
    for b, g, j, lane in ((0, 0, 0, 0), (0, 2, 15, 31), (1, 1, 7, 5), (1, 0, 3, 6)):
        ch, col = 16 * b + lane // 2, 32 * g + 2 * j + (lane & 1)
        assert c[b, g, j, lane] == (w8[ch, col] if ch < n else 0)
    assert torch.equal(d16[0], d[:16].t())


SHAPES = [(m, k, n) for m in (1, 2, 3, 5, 16) for k, n in ((64, 7), (96, 130), (1536, 33), (8192, 16))]


@needs_n16
@pytest.mark.parametrize("layout", ["q4_1", "q8_0"])
@pytest.mark.parametrize("m,k,n", SHAPES)
def test_n16_matches_dequantize_then_matmul(monkeypatch, layout, m, k, n):
    gen = torch.Generator().manual_seed(m * 1000 + k + n + len(layout))
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(n, k, generator=gen) * 0.05
    bias = torch.randn(n, generator=gen)
    packed = qgemm.quantize(w, layout)
    lin, plain = qgemm.PackedLinear(layout, packed, bias), qgemm.PackedLinear(layout, packed)
    assert lin.n16 is not None
    ref = x @ qgemm.dequantize(layout, packed).t()
    _poisoned_kernel_output(monkeypatch)
    _check(lin(x), ref + bias)
    _check(plain(x), ref)


@needs_n16
@pytest.mark.parametrize("layout", ["q4_1", "q8_0"])
@pytest.mark.parametrize("m", [1, 4, 7, 16])
def test_n16_bf16_activations_in_bf16_out(layout, m):
    """The bound of test_qgemm.test_bf16_activations_in_bf16_out for the fused rows."""
    gen = torch.Generator().manual_seed(m + 7 * len(layout))
    k, n = 576, 97
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    w = torch.randn(n, k, generator=gen) * 0.05
    bias = torch.randn(n, generator=gen)
    packed = qgemm.quantize(w, layout)
    y = qgemm.PackedLinear(layout, packed, bias)(x)
    ref = x.float() @ qgemm.dequantize(layout, packed).t() + bias
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    assert (y.float() - ref).abs().max().item() <= 4e-3 * ref.abs().max().item() + 1e-6


@needs_n16
@pytest.mark.parametrize("layout", ["q4_1", "q8_0"])
def test_n16_more_rows_than_one_pass(layout):
    """70 rows: the kernel's 64-row pass then a 6-row one (called directly: PackedLinear sends
    this many rows to the dequantize-and-matmul path)."""
    gen = torch.Generator().manual_seed(70)
    m, k, n = 70, 128, 40
    x = torch.randn(m, k, generator=gen)
    packed = qgemm.quantize(torch.randn(n, k, generator=gen) * 0.05, layout)
    lin = qgemm.PackedLinear(layout, packed)
    y = torch.full((m, n), math.nan)
    assert lin._mm(x.data_ptr(), m, k, *lin._mmargs, None, y.data_ptr(), n, 2, 0) == 0
    _check(y, x @ qgemm.dequantize(layout, packed).t())


@needs_n16
@pytest.mark.parametrize("layout", ["q4_1", "q8_0"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block", [512, 2048])
def test_n16_large_batch_widens_blocks_into_a_padded_scratch(monkeypatch, layout, dtype, block):
    """Past the fused kernels' rows, W is widened block by block into a scratch whose rows are
    padded off 1 KB multiples (512 and 1024 columns in fp32 / bf16 are such multiples); the last
    block is partial. Same result as widening the whole weight and one matmul."""
    monkeypatch.setattr(qgemm, "_DEQUANT_ROWS", block)
    monkeypatch.setattr(qgemm, "_DEQUANT_BYTES", 0)
    gen = torch.Generator().manual_seed(block + len(layout))
    m, k, n = max(qgemm_n16.FUSED_MAX_M, qgemm_n16.FUSED_MAX_M_AMX) + 10, 64, block + 48
    x = torch.randn(m, k, generator=gen).to(dtype)
    packed = qgemm.quantize(torch.randn(n, k, generator=gen) * 0.05, layout)
    lin = qgemm.PackedLinear(layout, packed)
    lin._fused_max = min(lin._fused_max, m - 1)  # the AVX2 build takes every M itself
    ref = x @ qgemm.dequantize(layout, packed).to(dtype).t()
    y = lin(x)
    assert y.dtype == dtype and y.shape == (m, n)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5) if dtype is torch.float32 else \
        torch.testing.assert_close(y.float(), ref.float(), rtol=1e-2, atol=1e-2)


@needs_n16
@pytest.mark.parametrize("layout", ["q4_1", "q8_0"])
def test_n16_nan_row_and_zero_row(layout):
    x = torch.randn(4, 64)
    x[1, 5] = math.nan
    x[2] = 0.0
    x[3, 0] = math.inf
    bias = torch.randn(20)
    y = qgemm.PackedLinear(layout, qgemm.quantize(torch.randn(20, 64), layout), bias)(x)
    assert torch.isnan(y[1]).all() and torch.isnan(y[3]).all()
    assert torch.isfinite(y[0]).all() and torch.equal(y[2], bias)


def test_the_n16_path_follows_the_cpu_and_the_forced_path():
    def build(cpu: set[str], cap: str | None) -> str | None:
        choice = isa.choose("qgemm_n16", cpu, cap=cap)
        return None if choice is None else choice.level

    box = {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni"}
    assert build(box, None) == build(box, "vnni") == "vnni"
    for forced in ("avx2", "avx512"):  # below VNNI: the AVX2 build of the same layout
        assert build(box, forced) == "avx2"
    assert build(box, "scalar") is None  # the scalar row-layout kernel
    assert build(box - {"avx512_vnni"}, None) == "avx2"  # AVX-512 without VNNI (Skylake-SP)
    assert build({"avx2", "fma", "f16c"}, None) == "avx2"
    assert build({"avx2", "fma"}, None) is None  # no F16C: the fp16 scales need it
    assert build({"avx2", "fma", "f16c"}, "vnni") == "avx2"  # never beyond the CPU


@pytest.mark.parametrize("path", ["avx2", "scalar", "vnni", "amx"])
def test_forced_paths_pick_their_kernel(tmp_path, path):
    """A fresh process: PAGEDSERVE_ISA=scalar runs the row-layout kernel, avx2 the n16 layout's AVX2
    build (CI boxes without VNNI), vnni the VNNI build without AMX, amx both, where the CPU has them;
    each gives the reference's result."""
    has = isa.choose("qgemm_n16", cap=path) is not None
    amx = isa.choose("qgemm_amx", cap=path) is not None
    if path == "avx2" and not {"avx2", "fma"} <= isa.cpu_flags():
        pytest.skip("no AVX2 here")
    code = (
        "import torch\n"
        "from pagedserve.kernels import qgemm\n"
        "g = torch.Generator().manual_seed(5)\n"
        "x = torch.randn(3, 96, generator=g); w = torch.randn(20, 96, generator=g)\n"
        "for lay in ('q4_1', 'q8_0'):\n"
        "    p = qgemm.quantize(w, lay); lin = qgemm.PackedLinear(lay, p)\n"
        f"    assert (lin.n16 is not None) == {has!r}, lin.n16\n"
        f"    assert (lin._amx is not None) == {amx!r}\n"
        "    ref = x @ qgemm.dequantize(lay, p).t()\n"
        f"    assert (lin(x) - ref).abs().max() <= {RTOL} * max(1.0, ref.abs().max())\n"
        "    xb = x.bfloat16(); refb = xb.float() @ qgemm.dequantize(lay, p).t()\n"
        "    assert (lin(xb).float() - refb).abs().max() <= 4e-3 * refb.abs().max()\n"
        "print('ok')\n"
    )
    env = {**os.environ, "PAGEDSERVE_ISA": path, "PAGEDSERVE_KERNEL_CACHE": str(tmp_path)}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                          cwd=root)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr


@pytest.mark.parametrize("layout", ["q4_1", "q8_0"])
@pytest.mark.parametrize("n", [16, 21, 50])
def test_unrepack_gives_the_row_layout_back(layout, n):
    packed = qgemm.quantize(torch.randn(n, 96), layout)
    back = qgemm_n16.unrepack(layout, qgemm_n16.repack(layout, packed), n, 96)
    assert all(torch.equal(a, b) for a, b in zip(back, packed))


@needs_n16
@pytest.mark.parametrize("layout", ["q4_1", "q8_0"])
def test_only_the_n16_copy_is_kept_and_it_dequantizes_and_looks_up_rows(layout):
    """One copy of the weight in memory (a 7B GGUF must fit in about its file size): the row
    lookup and the prefill's dequantize read the n16 layout."""
    from pagedserve.gpu.models.quantization import QuantizedWeight

    n, k = 37, 128
    packed = qgemm.quantize(torch.randn(n, k), layout)
    qw = QuantizedWeight(layout, packed)
    lin = qw._linear
    assert lin.tensors is lin.n16
    assert all(torch.equal(a, b) for a, b in zip(qw.tensors, packed))
    full = qgemm.dequantize(layout, packed)
    for dt in (torch.float32, torch.bfloat16):
        flags = qgemm.Y_BF16 if dt is torch.bfloat16 else 0
        out = torch.full((k, n - 16), math.nan, dtype=dt)  # W^T of rows 16..36
        lin._dequant(*lin._wargs, k, 16, n, out.data_ptr(), 0, 2, flags)
        assert torch.equal(out, full[16:].t().to(dt))
        padded = torch.full((k, n + 5), math.nan, dtype=dt)  # the same into rows n + 5 apart
        lin._dequant(*lin._wargs, k, 16, n, padded.data_ptr(), n + 5, 2, flags)
        assert torch.equal(padded[:, : n - 16], full[16:].t().to(dt)) and padded[:, n - 16:].isnan().all()
        ids = torch.tensor([0, 36, 17, -1, 37])
        rows = lin.rows(ids, dt)
        assert torch.equal(rows[:3], full[[0, 36, 17]].to(dt)) and (rows[3:] == 0).all()


needs_amx = pytest.mark.skipif(isa.choose("qgemm_amx") is None,
                               reason="no AMX bf16 here (or a PAGEDSERVE_ISA cap below it)")


def _amx_linear(layout: str, m: int, k: int, n: int, seed: int):
    """bf16 rows, a weight quantized to layout, a bias; the PackedLinear sends every M to the AMX kernel."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    w = torch.randn(n, k, generator=gen) * 0.05
    bias = torch.randn(n, generator=gen)
    packed = qgemm.quantize(w, layout)
    lin = qgemm.PackedLinear(layout, packed, bias)
    lin._fused_max = 1 << 30  # the kernel itself at every M here
    assert lin._amx is not None
    return x, lin, qgemm.dequantize(layout, packed), bias


@needs_amx
@pytest.mark.parametrize("layout", ["q4_1", "q8_0"])
@pytest.mark.parametrize("m,k,n", [(2, 64, 7), (5, 96, 130), (16, 576, 97), (17, 1536, 33), (40, 160, 48)])
def test_amx_bf16_batches_match_the_reference(layout, m, k, n):
    """bf16 rows through the AMX tiles (odd group counts, partial 16-row tiles, N not a multiple
    of 16), within test_qgemm's bf16 bound; the codes and bf16 activations multiply exactly."""
    x, lin, w, bias = _amx_linear(layout, m, k, n, seed=m * 7 + k + n)
    y = lin(x)
    ref = x.float() @ w.t() + bias
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    assert (y.float() - ref).abs().max().item() <= 4e-3 * ref.abs().max().item() + 1e-6


@needs_amx
def test_amx_nan_row_stays_in_its_row():
    x = torch.randn(3, 64).to(torch.bfloat16)
    x[1, 5] = math.nan
    lin = qgemm.PackedLinear("q4_1", qgemm.quantize(torch.randn(20, 64), "q4_1"))
    y = lin(x)
    assert torch.isnan(y[1]).all() and torch.isfinite(y[0]).all() and torch.isfinite(y[2]).all()


@needs_amx
@pytest.mark.parametrize("layout", ["q4_1", "q8_0"])
@pytest.mark.parametrize("m,k,n", [(24, 64, 7), (33, 96, 130), (47, 576, 97), (64, 1536, 33), (100, 160, 48),
                                   (320, 576, 192)])
def test_amx_widened_form_rounds_each_weight_to_bf16_once(layout, m, k, n):
    """From qa_wide_min_m rows the kernel widens each group to bf16(d * code + m) once and sums
    whole rows in fp32 (odd group counts, a lone last 16-row chunk, N not a multiple of 16, a
    bias): it matches x @ bf16(W)^T to the output's own bf16 rounding, a bound the exact products
    of the smaller batches would miss (checked below on the same weights)."""
    lib = qgemm_n16.amx_library()
    assert m >= lib.qa_wide_min_m()
    x, lin, w, bias = _amx_linear(layout, m, k, n, seed=m * 7 + k + n)
    y = lin(x).float()
    ref = x.float() @ w.to(torch.bfloat16).float().t() + bias
    exact = x.float() @ w.t() + bias
    tight = 2.0 ** -8 * ref.abs() + 1e-5 * ref.abs().max()
    assert ((y - ref).abs() <= tight).all(), (y - ref).abs().max()
    assert not ((exact.to(torch.bfloat16).float() - ref).abs() <= tight).all()  # the exact form would miss it


@needs_amx
@pytest.mark.parametrize("layout", ["q4_1", "q8_0"])
def test_amx_below_the_widened_form_multiplies_the_codes_exactly(layout):
    """One row fewer than qa_wide_min_m: the exact form (codes times bf16 activations, fp32 group
    sums scaled in fp32) matches the fp32 reference to the output's bf16 rounding."""
    m = qgemm_n16.amx_library().qa_wide_min_m() - 1
    x, lin, w, bias = _amx_linear(layout, m, 576, 97, seed=5)
    y = lin(x).float()
    exact = x.float() @ w.t() + bias
    assert ((y - exact).abs() <= 2.0 ** -8 * exact.abs() + 1e-5 * exact.abs().max()).all()


@needs_n16
@pytest.mark.parametrize("layout", ["q4_1", "q8_0"])
@pytest.mark.parametrize("n,k", [(16, 32), (21, 96), (50, 1536), (576, 576)])
def test_c_repack_equals_the_torch_reference(layout, n, k):
    """repack() runs the library's C loop (torch's permutes took ~8 s for the default model at load
    time); it must give the documented layout's bytes exactly, padding channels included."""
    packed = qgemm.quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(n + k)), layout)
    ref = qgemm_n16.repack_q4_1(*packed) if layout == "q4_1" else qgemm_n16.repack_q8_0(*packed)
    got = qgemm_n16.repack(layout, packed)
    assert len(got) == len(ref)
    assert all(a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b) for a, b in zip(got, ref))
