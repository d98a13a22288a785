"""The quantized matmul kernel against the torch reference (dequantize, then matmul)."""
from __future__ import annotations

import math
import os

import pytest
import torch

from pagedserve.kernels import isa, qgemm

# The kernel rounds activations to 15 bits per row (AVX2 path); the error that adds is about
# 3e-5 of the row's largest value times sqrt(K) terms, far inside this bound.
RTOL = 2e-3


def _check(y: torch.Tensor, ref: torch.Tensor) -> None:
    assert y.shape == ref.shape and y.dtype == torch.float32
    assert torch.isfinite(y).all(), "the kernel left unwritten (poisoned) or non-finite outputs"
    err = (y - ref).abs().max().item()
    assert err <= RTOL * max(1.0, ref.abs().max().item()), f"max error {err}"


def _poisoned_kernel_output(monkeypatch):
    """Make every output buffer the kernel writes start as NaN: a skipped element shows."""
    real_empty = torch.empty

    def empty(*shape, **kw):
        t = real_empty(*shape, **kw)
        if t.dtype == torch.float32:
            t.fill_(math.nan)
        return t

    monkeypatch.setattr(qgemm.torch, "empty", empty)


SHAPES = [(m, k, n) for m in (1, 3, 16, 33) for k, n in ((64, 7), (577, 33), (96, 130), (1536, 9), (8200, 5))]


@pytest.mark.parametrize("m,k,n", SHAPES)
def test_int8_matches_dequantize_then_matmul(monkeypatch, m, k, n):
    _poisoned_kernel_output(monkeypatch)
    gen = torch.Generator().manual_seed(m * 1000 + k + n)
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(n, k, generator=gen) * 0.05
    bias = torch.randn(n, generator=gen)
    w8, scale = qgemm.quantize_int8(w)
    ref = x @ qgemm.dequantize_int8(w8, scale).t() + bias
    _check(qgemm.int8_mm(x, w8, scale, bias), ref)
    _check(qgemm.int8_mm(x, w8, scale), ref - bias)


@pytest.mark.parametrize("m,k,n", [s for s in SHAPES if s[1] % qgemm.GROUP == 0])
def test_q8_0_matches_dequantize_then_matmul(monkeypatch, m, k, n):
    _poisoned_kernel_output(monkeypatch)
    gen = torch.Generator().manual_seed(m * 1000 + k + n + 2)
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(n, k, generator=gen) * 0.05
    bias = torch.randn(n, generator=gen)
    w8, d = qgemm.quantize_q8_0(w)
    ref = x @ qgemm.dequantize_q8_0(w8, d).t() + bias
    _check(qgemm.q8_mm(x, w8, d, bias), ref)
    _check(qgemm.q8_mm(x, w8, d), ref - bias)


@pytest.mark.parametrize("layout", ["int8c", "q8_0", "q4_1"])
@pytest.mark.parametrize("m", [1, 2, 5, 33])
def test_bf16_activations_in_bf16_out(layout, m):
    """bf16 machines hand bf16 activations to the kernel: same sums, output rounded to bf16."""
    gen = torch.Generator().manual_seed(m + len(layout))
    k, n = 576, 97
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    w = torch.randn(n, k, generator=gen) * 0.05
    bias = torch.randn(n, generator=gen)
    packed = qgemm.quantize(w, layout)
    ref = x.float() @ qgemm.dequantize(layout, packed).t() + bias
    y = qgemm.PackedLinear(layout, packed, bias)(x)
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    # bf16 output: 8 bits of mantissa, half an ulp of the largest output plus the kernel's error;
    # above FUSED_MAX_M rows the weights are widened to bf16 for torch's bf16 matmul, as an
    # unquantized bf16 model holds them, which adds their rounding (2^-9 each, summed over K)
    bound = 4e-3 if m <= qgemm.FUSED_MAX_M else 1e-2
    assert (y.float() - ref).abs().max().item() <= bound * ref.abs().max().item() + 1e-6


@pytest.mark.parametrize("layout", ["q8_0", "q4_1"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_lookup_is_the_dequantized_row(layout, dtype):
    w = torch.randn(40, 96)
    packed = qgemm.quantize(w, layout)
    ids = torch.tensor([[3, 0], [39, 40]])
    rows = qgemm.PackedLinear(layout, packed).rows(ids, dtype)
    full = qgemm.dequantize(layout, packed).to(dtype)
    assert rows.shape == (2, 2, 96) and rows.dtype == dtype
    assert torch.equal(rows[0, 0], full[3]) and torch.equal(rows[0, 1], full[0]) and torch.equal(rows[1, 0], full[39])
    assert (rows[1, 1] == 0).all()  # outside the table: zeros


@pytest.mark.parametrize("m,k,n", [s for s in SHAPES if s[1] % qgemm.GROUP == 0])
def test_int4_matches_dequantize_then_matmul(monkeypatch, m, k, n):
    _poisoned_kernel_output(monkeypatch)
    gen = torch.Generator().manual_seed(m * 1000 + k + n + 1)
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(n, k, generator=gen) * 0.05
    bias = torch.randn(n, generator=gen)
    packed = qgemm.quantize_int4(w)
    ref = x @ qgemm.dequantize_int4(*packed).t() + bias
    _check(qgemm.int4_mm(x, *packed, bias), ref)


def test_quantization_error_is_what_the_scheme_allows():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(64, 256, generator=gen)
    w8, scale = qgemm.quantize_int8(w)
    assert ((qgemm.dequantize_int8(w8, scale) - w).abs() <= scale[:, None] / 2 + 1e-6).all()
    w8g, dg = qgemm.quantize_q8_0(w)
    err8 = (qgemm.dequantize_q8_0(w8g, dg) - w).abs().reshape(64, -1, qgemm.GROUP)
    # half a step, plus what rounding the group's largest value against the fp16 scale moves
    assert (err8 <= dg.float()[..., None] * (0.5 + 127 * 2.0**-11)).all()
    # grouped scales fit each group: smaller mean error than one scale per row
    assert err8.mean() < 0.8 * (qgemm.dequantize_int8(w8, scale) - w).abs().mean()
    w4, d, mn = qgemm.quantize_int4(w)
    err = (qgemm.dequantize_int4(w4, d, mn) - w).abs().reshape(64, -1, qgemm.GROUP)
    d, mn = d.float(), mn.float()
    # half a step, plus what storing the scale and minimum in fp16 moves (2^-11 relative)
    assert (err <= d[..., None] / 2 + 1e-3 * (mn.abs() + 16 * d)[..., None]).all()


def test_leading_dims_and_a_zero_row():
    x = torch.randn(2, 3, 64)
    x[1, 2] = 0.0
    w8, scale = qgemm.quantize_int8(torch.randn(10, 64))
    y = qgemm.int8_mm(x, w8, scale)
    assert y.shape == (2, 3, 10)
    assert (y[1, 2] == 0).all()
    _check(y.reshape(6, 10), x.reshape(6, 64) @ qgemm.dequantize_int8(w8, scale).t())


def test_nan_in_a_row_gives_nan_in_that_row_only():
    x = torch.randn(3, 64)
    x[1, 5] = math.nan
    w8, scale = qgemm.quantize_int8(torch.randn(8, 64))
    w4, d, mn = qgemm.quantize_int4(torch.randn(8, 64))
    for y in (qgemm.int8_mm(x, w8, scale), qgemm.int4_mm(x, w4, d, mn)):
        assert torch.isnan(y[1]).all()
        assert torch.isfinite(y[0]).all() and torch.isfinite(y[2]).all()


def test_wrong_input_size_is_refused():
    w8, scale = qgemm.quantize_int8(torch.randn(8, 64))
    with pytest.raises(ValueError, match="expects 64"):
        qgemm.int8_mm(torch.randn(1, 63), w8, scale)
    with pytest.raises(ValueError, match="multiple of 32"):
        qgemm.quantize_int4(torch.randn(8, 48))


def test_missing_compiler_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("PAGEDSERVE_KERNEL_CACHE", str(tmp_path))  # nothing cached: must build
    monkeypatch.setenv("CC", "no-such-compiler-xyz")
    qgemm.library.cache_clear()
    try:
        with pytest.raises(qgemm.QuantKernelError, match="needs a C compiler"):
            qgemm.library()
    finally:
        qgemm.library.cache_clear()


def test_the_build_on_this_machine_uses_simd_when_the_cpu_has_it():
    flags = isa.cpu_flags()
    if os.environ.get("PAGEDSERVE_ISA"):
        pytest.skip("a path is forced")
    assert qgemm.isa() == ("avx2" if {"avx2", "fma"} <= flags else "scalar")


AVX2_BOX = {"avx2", "fma", "f16c", "sse4_2"}
AVX512_BOX = AVX2_BOX | {"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "amx_bf16"}


def build_flags(cpu: set[str], forced: str | None = None) -> tuple[str, list[str]]:
    build = isa.choose("qgemm", cpu, cap=forced)
    return build.level, isa.KERNELS["qgemm"].flags(build)


def test_the_path_follows_the_cpu_and_is_never_forced_beyond_it():
    # AVX-512 boxes run the AVX2 path unless asked (measured no faster: loadtest/PERF.md)
    assert build_flags(AVX512_BOX) == ("avx2", ["-mavx2", "-mfma", "-mf16c"])
    assert build_flags(AVX512_BOX, "avx512") == ("avx512", ["-mavx2", "-mfma", "-mf16c", "-mavx512f",
                                                                  "-mavx512bw"])
    assert build_flags(AVX2_BOX) == ("avx2", ["-mavx2", "-mfma", "-mf16c"])
    assert build_flags(AVX2_BOX, "avx512")[0] == "avx2"  # never a path the CPU lacks
    assert build_flags({"sse4_2", "avx"}) == ("scalar", [])
    assert build_flags({"sse4_2", "avx"}, "avx2") == ("scalar", [])
    assert build_flags({"avx512f", "avx512bw"}) == ("scalar", [])  # no FMA/AVX2 flags: no SIMD build
    assert build_flags(AVX512_BOX, "scalar") == ("scalar", [])


def check_half_conversion() -> None:
    """The kernel's fp16 -> fp32 for every one of the 65536 half values (via int4 dequantize:
    codes all 1, minimum 0, so each group's first value is its scale)."""
    n, g = 2048, 32
    d = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.float16).reshape(n, g).contiguous()
    mn = torch.zeros(n, g, dtype=torch.float16)
    w4 = torch.full((n, g * 16), 0x11, dtype=torch.uint8)
    out = torch.empty(n, g * 32)
    qgemm.library().qg_int4_dequant(w4.data_ptr(), d.data_ptr(), mn.data_ptr(), g * 32, 0, n, out.data_ptr(), 1, 0)
    got, want = out[:, ::32], d.float()
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    finite = ~torch.isnan(want)
    assert torch.equal(got[finite], want[finite])


def test_fp16_scales_convert_exactly():
    check_half_conversion()


@pytest.mark.parametrize("path", ["scalar", "avx2", "avx512"])
def test_every_path_is_right(tmp_path, path):
    """Each build (no SIMD, AVX2, opt-in AVX-512) checked in a fresh process where the CPU has it."""
    if path != "scalar" and isa.choose("qgemm", cap=path).level != path:
        pytest.skip(f"this CPU cannot run the {path} path")
    import subprocess
    import sys

    code = (
        "import torch\n"
        "from pagedserve.kernels import qgemm\n"
        f"assert qgemm.isa() == {path!r}, qgemm.isa()\n"
        "g = torch.Generator().manual_seed(1)\n"
        "def close(y, ref, rel): return (y.float() - ref).abs().max() <= rel * max(1.0, ref.abs().max())\n"
        "for m, k, n in ((1, 577, 33), (3, 64, 7), (16, 96, 130)):\n"
        "    x = torch.randn(m, k, generator=g); w = torch.randn(n, k, generator=g); b = torch.randn(n, generator=g)\n"
        "    w8, s = qgemm.quantize_int8(w)\n"
        "    ref = x @ qgemm.dequantize_int8(w8, s).t() + b\n"
        "    assert close(qgemm.int8_mm(x, w8, s, b), ref, 2e-3)\n"
        "    for lay in (('q8_0', 'q4_1') if k % 32 == 0 else ()):\n"
        "        p = qgemm.quantize(w, lay)\n"
        "        ref = x @ qgemm.dequantize(lay, p).t() + b\n"
        "        assert close(qgemm.PackedLinear(lay, p, b)(x), ref, 2e-3)\n"
        "        yb = qgemm.PackedLinear(lay, p, b)(x.bfloat16())\n"
        "        refb = x.bfloat16().float() @ qgemm.dequantize(lay, p).t() + b\n"
        "        assert yb.dtype == torch.bfloat16 and close(yb, refb, 8e-3)\n"
        "from tests.kernels.test_qgemm import check_half_conversion\n"
        "check_half_conversion()\n"
        "print('ok')\n"
    )
    env = {**os.environ, "PAGEDSERVE_ISA": path, "PAGEDSERVE_KERNEL_CACHE": str(tmp_path)}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                          cwd=root)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr


@pytest.mark.parametrize("path", ["scalar", "avx2", "avx512"])
def test_every_path_of_the_row_layout_is_right(tmp_path, path):
    """The row layout's own q8_0 / q4_1 code in each build, in a fresh process with the n16 kernel
    off. Where the n16 kernel builds (every AVX2 CPU with F16C) it takes q8_0 / q4_1 instead, so
    nothing else reaches this code there: the AVX-512 build's (QG_AVX512 loops) on any CPU, the
    AVX2 one on AVX2 CPUs. Against the reference (dequantize, then matmul), fp32 and bf16
    activations, every row count up to the kernel's most and past it (the blocked path), the
    row lookup and the dequantization."""
    if path != "scalar" and isa.choose("qgemm", cap=path).level != path:
        pytest.skip(f"this CPU cannot run the {path} path")
    import subprocess
    import sys

    code = (
        "import math, torch\n"
        "from pagedserve.kernels import qgemm, qgemm_n16\n"
        "qgemm_n16.library = lambda: None  # as where the n16 kernel cannot be built\n"
        f"assert qgemm.isa() == {path!r}, qgemm.isa()\n"
        "g = torch.Generator().manual_seed(2)\n"
        "def close(y, ref, rel): return (y.float() - ref).abs().max() <= rel * max(1.0, ref.abs().max())\n"
        "for m, k, n in ((1, 64, 7), (3, 96, 33), (16, 1536, 9), (5, 8192, 5), (33, 96, 130)):\n"
        "    x = torch.randn(m, k, generator=g); w = torch.randn(n, k, generator=g) * 0.05\n"
        "    b = torch.randn(n, generator=g)\n"
        "    for lay in ('q8_0', 'q4_1'):\n"
        "        p = qgemm.quantize(w, lay); full = qgemm.dequantize(lay, p)\n"
        "        for bias in (b, None):\n"
        "            lin = qgemm.PackedLinear(lay, p, bias)\n"
        "            assert lin.n16 is None and lin.tensors is p\n"
        "            ref = x @ full.t() + (0 if bias is None else bias)\n"
        f"            assert close(lin(x), ref, {RTOL}), (m, k, n, lay)\n"
        "            xb = x.bfloat16(); refb = xb.float() @ full.t() + (0 if bias is None else bias)\n"
        "            yb = lin(xb)\n"
        "            assert yb.dtype == torch.bfloat16 and close(yb, refb, 8e-3), (m, k, n, lay)\n"
        "        ids = torch.tensor([n - 1, 0, -1, n])\n"
        "        for dt in (torch.float32, torch.bfloat16):\n"
        "            rows = lin.rows(ids, dt)\n"
        "            assert torch.equal(rows[:2], full[[n - 1, 0]].to(dt)) and (rows[2:] == 0).all()\n"
        "            out = torch.full((n, k), math.nan, dtype=dt)\n"
        "            flags = qgemm.Y_BF16 if dt is torch.bfloat16 else 0\n"
        "            lin._dequant(*lin._wargs, k, 0, n, out.data_ptr(), 2, flags)\n"
        "            assert torch.equal(out, full.to(dt))\n"
        "print('ok')\n"
    )
    env = {**os.environ, "PAGEDSERVE_ISA": path, "PAGEDSERVE_KERNEL_CACHE": str(tmp_path)}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                          cwd=root)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr


def test_unwritable_cache_is_a_clear_error(monkeypatch, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("PAGEDSERVE_KERNEL_CACHE", str(blocker / "cache"))
    qgemm.library.cache_clear()
    try:
        with pytest.raises(qgemm.QuantKernelError, match="PAGEDSERVE_KERNEL_CACHE"):
            qgemm.library()
    finally:
        qgemm.library.cache_clear()


@pytest.mark.parametrize("layout", ["q8_0", "q4_1"])
def test_a_rows_result_does_not_depend_on_the_batch(layout):
    """Batch invariance (DESIGN.md): where one kernel takes every M (the AVX2 builds: the n16
    layout's, or the row layout's where that one runs), a row's sequence of operations is the same
    whatever M is and whichever chunk or path (1 row, 2-4, many) it falls in, so each row of an
    M-row call equals the same row computed alone, bit for bit."""
    g = torch.Generator().manual_seed(7)
    k, n = 576, 97
    lin = qgemm.PackedLinear(layout, qgemm.quantize(torch.randn(n, k, generator=g) * 0.05, layout))
    if lin._fused_max != qgemm.ALL_ROWS:
        pytest.skip("large batches widen W for torch's matmul on this CPU's kernel")
    x = torch.randn(300, k, generator=g)
    alone = torch.cat([lin(x[i:i + 1]) for i in range(300)])
    for m in (1, 2, 3, 4, 5, 15, 16, 17, 24, 64, 65, 300):
        assert torch.equal(lin(x[:m]), alone[:m]), m
        assert torch.equal(lin(x[300 - m:]), alone[300 - m:]), m  # other chunk boundaries
