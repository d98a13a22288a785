"""Weight-only int8 / int4 matmul on CPU: the C kernel in csrc/qgemm.c, built with the system C
compiler on first use and called through ctypes on torch tensors' memory.

Why a kernel of our own: on AVX2 machines PyTorch's packed int8/int4 CPU ops are several times
slower than an fp32 GEMV, while decode is bound by the bytes of weights read per token; this
kernel keeps the weights packed and widens them in registers (figures in loadtest/PERF.md).

kernels/cbuild.py builds it and caches the shared library under ``$PAGEDSERVE_KERNEL_CACHE``
(default ``~/.cache/pagedserve/kernels``), keyed by the source, the flags and the compiler, so a
second process (or a tensor-parallel worker) loads it without compiling. kernels/isa.py chooses the
build: AVX2+FMA, else the portable scalar build, with a warning; ``PAGEDSERVE_ISA=avx512`` builds
the AVX-512 path where the CPU has it (opt-in: measured no faster), ``avx2|scalar`` a lower one.

On CPUs with AVX-512 VNNI, q8_0 / q4_1 layers are instead re-laid 16 output channels side by side
and computed by kernels/qgemm_n16.py (VNNI, and AMX bf16 tiles for batches of bf16 rows): 2x the
row kernel's speed for one row of q4_1, 3.8x (VNNI) to 6.8x (AMX) for 16 rows (loadtest/PERF.md).
Only that copy is kept; ``PackedLinear.row_tensors()`` gives the LAYOUTS form back.
"""
from __future__ import annotations

import ctypes
import functools
import logging

import torch

from pagedserve.kernels import abi, cbuild, qgemm_n16
from pagedserve.kernels.row_buckets import buckets_upto, row_bucket
from pagedserve.kernels.isa import choose

logger = logging.getLogger(__name__)

GROUP = 32  # values per fp16 scale (and minimum) in q8_0 / q4_1, as in GGUF Q8_0 / Q4_1
FUSED_MAX_M = 16  # above this many rows, dequantize blocks of W and use the BLAS matmul ...
# ... except on the AVX2 builds (the n16 layout's, csrc/qgemm_n16_avx2.c, or where that cannot be
# built the row layout's, csrc/qgemm_avx2.h), which take every M: a row's result then depends on
# that row alone whatever the batch (batch invariance, DESIGN.md); the n16 one is also 1.5-3.6x
# faster than widening W up to 256 rows and level with it at 1024 (loadtest/PERF.md, twelfth session).
ALL_ROWS = qgemm_n16.ALL_ROWS
_DEQUANT_ROWS = 2048  # rows of W widened at a time on the large-M path (bounded scratch) ...
_DEQUANT_BYTES = 4 << 20  # ... or more where they fit in this (one block for the default model's gate_up)


class QuantKernelError(cbuild.KernelBuildError):
    """The quantized kernel cannot be built or loaded; the message says what to install or change."""


_ISA_NAMES = {0: "scalar", 2: "avx2", 3: "avx512"}


@functools.cache
def library() -> ctypes.CDLL:
    """The compiled kernel, built on first use. Raises QuantKernelError without a C compiler."""
    choice = choose("qgemm")  # never None: the scalar build needs nothing
    path_name = choice.level
    try:
        lib = cbuild.build_kernel("qgemm", choice)
    except cbuild.CompilerMissing as e:
        raise QuantKernelError(f"--quantization int8/int4 builds a C kernel on first use: {e}, or use "
                               "--quantization none") from None
    except cbuild.KernelBuildError as e:
        raise QuantKernelError(str(e)) from None
    abi.bind(lib, "qgemm")
    got = _ISA_NAMES.get(lib.qg_isa(), "scalar")
    if got != path_name:
        raise QuantKernelError(f"the quantized kernel built for {path_name} reports {got} ({lib._name})")
    if got == "scalar":
        logger.warning("quantized kernel: this CPU lacks AVX2/FMA, so the portable scalar code runs; "
                       "int8/int4 weights will likely decode slower than --quantization none")
    else:
        logger.info("quantized kernel: %s path", got)
    return lib


def isa() -> str:
    """'avx512', 'avx2' or 'scalar': which path the loaded build runs."""
    return _ISA_NAMES.get(library().qg_isa(), "scalar")


# ------------------------------------------------------------------ quantize / reference

def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8 (layout int8c, for input sizes that are not a multiple
    of 32): (w8 [N, K] int8, scale [N] fp32)."""
    w = w.detach().float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    w8 = torch.clamp(torch.round(w / scale[:, None]), -127, 127).to(torch.int8)
    return w8.contiguous(), scale.contiguous()


def dequantize_int8(w8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return w8.float() * scale[:, None]


def quantize_q8_0(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 in groups of 32 along K with an fp16 scale (GGUF Q8_0: d = amax / 127,
    q = round(w / d), d as stored in fp16): (w8 [N, K] int8, d [N, K/32] fp16). K a multiple of 32."""
    n, k = w.shape
    if k % GROUP:
        raise ValueError(f"q8_0 needs the input size to be a multiple of {GROUP}, got {k}")
    g = w.detach().float().reshape(n, k // GROUP, GROUP)
    d16 = (g.abs().amax(dim=2) / 127.0).half()
    if not torch.isfinite(d16).all():
        raise ValueError("q8_0: a weight group's range does not fit the fp16 scale (|w| > 65504)")
    d = d16.float()  # the codes are chosen against the scale as stored
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.clamp(torch.round(g * inv[..., None]), -127, 127).to(torch.int8)
    return q.reshape(n, k).contiguous(), d16.contiguous()


def dequantize_q8_0(w8: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    n, k = w8.shape
    return (w8.float().reshape(n, k // GROUP, GROUP) * d.float()[..., None]).reshape(n, k)


def quantize_int4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit in groups of 32 along K, an fp16 scale and minimum per group (GGUF Q4_1):
    (w4 [N, K/2] uint8, d [N, K/32] fp16, m [N, K/32] fp16). K must be a multiple of 32."""
    n, k = w.shape
    if k % GROUP:
        raise ValueError(f"int4 needs the input size to be a multiple of {GROUP}, got {k}")
    g = w.detach().float().reshape(n, k // GROUP, GROUP)
    lo, hi = g.amin(dim=2), g.amax(dim=2)
    d16, m16 = ((hi - lo) / 15.0).half(), lo.half()
    if not (torch.isfinite(d16).all() and torch.isfinite(m16).all()):
        raise ValueError("int4: a weight group's range does not fit the fp16 scale (|w| > 65504)")
    d, m = d16.float(), m16.float()  # the codes are chosen against the scale as stored
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.clamp(torch.round((g - m[..., None]) * inv[..., None]), 0, 15).to(torch.uint8)
    packed = q[..., :16] | (q[..., 16:] << 4)  # byte j: value j (low nibble), value j+16 (high)
    return packed.reshape(n, k // 2).contiguous(), d16.contiguous(), m16.contiguous()


def dequantize_int4(w4: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    n, half = w4.shape
    p = w4.reshape(n, half // 16, 16)
    q = torch.cat([p & 0x0F, p >> 4], dim=2).float()
    return (q * d.float()[..., None] + m.float()[..., None]).reshape(n, half * 2)


# Packed layouts: name -> (dtypes of the tensors, the reference dequantize). Every tensor is
# [N, something proportional to K], so a layout can be cut by rows (and by groups of columns).
LAYOUTS = {
    "int8c": ((torch.int8, torch.float32), dequantize_int8),
    "q8_0": ((torch.int8, torch.float16), dequantize_q8_0),
    "q4_1": ((torch.uint8, torch.float16, torch.float16), dequantize_int4),
}


def packed_shapes(layout: str, n: int, k: int) -> list[tuple[int, ...]]:
    """Shapes of ``layout``'s tensors for an [n, k] weight."""
    if layout == "int8c":
        return [(n, k), (n,)]
    if k % GROUP:
        raise ValueError(f"{layout} needs the input size to be a multiple of {GROUP}, got {k}")
    return [(n, k), (n, k // GROUP)] if layout == "q8_0" else [(n, k // 2), (n, k // GROUP), (n, k // GROUP)]


def quantize(w: torch.Tensor, layout: str) -> tuple[torch.Tensor, ...]:
    return {"int8c": quantize_int8, "q8_0": quantize_q8_0, "q4_1": quantize_int4}[layout](w)


def dequantize(layout: str, tensors: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return LAYOUTS[layout][1](*tensors)


# ------------------------------------------------------------------ matmuls

X_BF16, Y_BF16 = 1, 2  # the kernel's flags: activations in / outputs out as bf16 (else fp32)


class PackedLinear:
    """y = x @ W^T + bias for one packed weight, with everything the kernel call needs resolved
    once (pointers, the C function): a decode step makes ~120 of these calls, so the per-call
    Python work is kept to allocating ``y`` and one ctypes call. fp32 and bf16 activations go to
    the kernel as they are and come back in the same dtype; others are computed in fp32."""

    __slots__ = ("mode", "tensors", "bias", "n", "k", "_mm", "_dequant", "_rows", "_wargs", "_bp", "_mmargs",
                 "_fused_max", "n16", "_amx")

    def __init__(self, mode: str, tensors: tuple[torch.Tensor, ...], bias: torch.Tensor | None = None):
        lib = library()
        if mode == "int4":
            mode = "q4_1"
        if mode not in LAYOUTS:
            raise ValueError(f"unknown packed mode {mode!r}")
        if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
            raise ValueError("the bias of a quantized linear must be contiguous float32")
        for t in tensors:
            if not t.is_contiguous() or t.device.type != "cpu":
                raise ValueError("packed weights must be contiguous CPU tensors")
        expected = LAYOUTS[mode][0]
        if tuple(t.dtype for t in tensors) != expected:
            raise ValueError(f"{mode} packed weights must be {expected}, got {tuple(t.dtype for t in tensors)}")
        self.mode, self.tensors, self.bias = mode, tensors, bias
        self._bp = None if bias is None else bias.data_ptr()
        self._wargs = tuple(t.data_ptr() for t in tensors)
        self._rows = None
        if mode == "int8c":
            self.n, self.k = tensors[0].shape
            self._mm, self._dequant = lib.qg_int8_mm, lib.qg_int8_dequant
        elif mode == "q8_0":
            self.n, self.k = tensors[0].shape
            self._mm, self._dequant, self._rows = lib.qg_q8_mm, lib.qg_q8_dequant, lib.qg_q8_rows
        else:
            self.n, self.k = tensors[0].shape[0], tensors[0].shape[1] * 2
            self._mm, self._dequant, self._rows = lib.qg_int4_mm, lib.qg_int4_dequant, lib.qg_int4_rows
        if mode != "int8c" and tuple(tensors[1].shape) != (self.n, self.k // GROUP):
            raise ValueError(f"{mode}: scales of shape {tuple(tensors[1].shape)} for a {self.n}x{self.k} weight")
        self._mmargs, self.n16, self._amx = self._wargs, None, None
        self._fused_max = ALL_ROWS if mode != "int8c" and isa() == "avx2" else FUSED_MAX_M
        n16 = qgemm_n16.library() if mode != "int8c" else None
        if n16 is not None:  # VNNI or AVX2: only the 16-channel layout is kept (memory = the file's)
            self.n16 = self.tensors = qgemm_n16.repack(mode, tensors)
            q4 = mode == "q4_1"
            self._mm = n16.qn_q4_mm if q4 else n16.qn_q8_mm
            self._dequant = n16.qn_q4_dequant_t if q4 else n16.qn_q8_dequant_t  # writes W^T
            self._rows = n16.qn_q4_rows if q4 else n16.qn_q8_rows
            self._mmargs = self._wargs = tuple(t.data_ptr() for t in self.n16)
            self._fused_max = qgemm_n16.fused_max_m()
            amx = qgemm_n16.amx_library()
            if amx is not None:  # bf16 batches: AMX tiles on the same layout
                self._amx = amx.qa_q4_mm if mode == "q4_1" else amx.qa_q8_mm
                self._fused_max = qgemm_n16.FUSED_MAX_M_AMX

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        dt = x.dtype
        if x.dim() == 2 and (dt is torch.float32 or dt is torch.bfloat16) and x.is_contiguous() \
                and x.shape[1] == self.k:
            x2 = x
        else:
            if x.shape[-1] != self.k:
                raise ValueError(f"input has {x.shape[-1]} features, the quantized weight expects {self.k}")
            if dt is not torch.bfloat16:
                dt = torch.float32
            x2 = x.reshape(-1, self.k).to(dt).contiguous()
        flags = X_BF16 | Y_BF16 if dt is torch.bfloat16 else 0
        m = x2.shape[0]
        if m > self._fused_max:
            y = self._blocked(x2)
        else:
            y = torch.empty((m, self.n), dtype=dt)
            mm = self._amx if self._amx is not None and flags and m >= qgemm_n16.AMX_MIN_M else self._mm
            if mm(x2.data_ptr(), m, self.k, *self._mmargs, self._bp, y.data_ptr(), self.n,
                        torch.get_num_threads(), flags):
                raise MemoryError(f"qgemm: no memory for the {self.mode} kernel's activation scratch")
        return y if x2 is x else y.reshape(*x.shape[:-1], self.n)

    def fused_entry(self) -> tuple[tuple[torch.Tensor, ...], int, int | None, int] | None:
        """What the fused decode layer (kernels/abi.py LinearSpec) needs to call this weight's
        kernel itself: (the kernel's weight tensors, small-batch kernel address, AMX kernel address
        or None, the most rows the kernel takes), or None for int8c weights or a bias. The q8_0 and
        q4_1 kernels of both layouts (row and 16-channel) share one signature."""
        if self.mode == "int8c" or self.bias is not None:
            return None
        addr = lambda fn: ctypes.cast(fn, ctypes.c_void_p).value  # noqa: E731
        tensors = self.tensors if self.n16 is None else self.n16
        return tensors, addr(self._mm), None if self._amx is None else addr(self._amx), self._fused_max

    def _blocked(self, x2: torch.Tensor) -> torch.Tensor:
        """Large M (prefill): widen W a block of rows at a time, in x's dtype (bf16 matmuls run on
        AMX / AVX-512 bf16 where the CPU has them), and let torch's matmul do the FLOPs. The rows
        are padded to their bucket (kernels/row_buckets.py): one oneDNN primitive per row count
        would grow the worker with every new prompt length (issue 35)."""
        m = x2.shape[0]
        rows = row_bucket(m)
        if rows != m:
            padded = x2.new_zeros((rows, x2.shape[1]))
            padded[:m].copy_(x2)
            x2 = padded
        n, k = self.n, self.k
        nt = torch.get_num_threads()
        dt = x2.dtype
        flags = Y_BF16 if dt is torch.bfloat16 else 0
        y = torch.empty(rows, n, dtype=dt)
        block = min(n, max(_DEQUANT_ROWS, _DEQUANT_BYTES // (k * x2.element_size())) // 16 * 16)
        # The n16 widening writes W^T, rows ``ld`` apart: not a multiple of 1 KB (csrc/qgemm_n16.c dequant_t).
        ld = block + 16 if (block * x2.element_size()) % 1024 == 0 else block
        scratch = torch.empty(block * k if self.n16 is None else ld * k, dtype=dt)
        for n0 in range(0, n, block):  # (a multiple of 16, as the n16 layout needs)
            n1 = min(n, n0 + block)
            if self.n16 is None:
                self._dequant(*self._wargs, k, n0, n1, scratch.data_ptr(), nt, flags)
                wt = scratch[: (n1 - n0) * k].view(n1 - n0, k).t()
            else:
                self._dequant(*self._wargs, k, n0, n1, scratch.data_ptr(), ld, nt, flags)
                wt = scratch.as_strided((k, n1 - n0), (ld, 1))
            if n1 - n0 == n:
                torch.matmul(x2, wt, out=y)
            else:
                y[:, n0:n1] = x2 @ wt
        if rows != m:
            y = y[:m]
        if self.bias is not None:
            y += self.bias
        return y

    def warm(self, max_rows: int, dtype: torch.dtype) -> int:
        """Run every row bucket of the large-M path up to ``max_rows`` once, so its matmul
        primitives are built at start-up and serving adds none. Returns how many ran."""
        buckets = [b for b in buckets_upto(max_rows) if b > self._fused_max]
        with torch.no_grad():
            for rows in buckets:
                self._blocked(torch.zeros(rows, self.k, dtype=dtype))
        return len(buckets)

    def row_tensors(self) -> tuple[torch.Tensor, ...]:
        """The weight in its LAYOUTS form (rebuilt from the 16-channel copy where that is what is kept)."""
        if self.n16 is None:
            return self.tensors
        return qgemm_n16.unrepack(self.mode, self.n16, self.n, self.k)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Dequantized rows ``ids`` of W (an embedding lookup on a quantized table); ids outside
        [0, N) give zero rows."""
        if self._rows is None:
            raise ValueError(f"{self.mode} weights have no row lookup")
        if dtype is not torch.bfloat16:
            dtype = torch.float32
        flat = ids.reshape(-1).to(torch.int64).contiguous()
        out = torch.empty(flat.numel(), self.k, dtype=dtype)
        self._rows(*self._wargs, self.k, self.n, flat.data_ptr(), flat.numel(), out.data_ptr(),
                   Y_BF16 if dtype is torch.bfloat16 else 0)
        return out.reshape(*ids.shape, self.k)


def int8_mm(x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
            ) -> torch.Tensor:
    """x @ (w8 * scale[:, None]).T + bias (per-channel int8), in x's dtype (fp32 or bf16)."""
    return PackedLinear("int8c", (w8, scale), bias)(x)


def q8_mm(x: torch.Tensor, w8: torch.Tensor, d: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ dequantize_q8_0(w8, d).T + bias."""
    return PackedLinear("q8_0", (w8, d), bias)(x)


def int4_mm(x: torch.Tensor, w4: torch.Tensor, d: torch.Tensor, mn: torch.Tensor,
            bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ dequantize_int4(w4, d, mn).T + bias."""
    return PackedLinear("q4_1", (w4, d, mn), bias)(x)


if __name__ == "__main__":  # `python -m pagedserve.kernels.qgemm`: build now (install step), print the path taken
    logging.basicConfig(level=logging.INFO)
    print(f"qgemm kernel ready: {isa()} path")
