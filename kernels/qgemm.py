"""Weight-only int8 / int4 matmul on CPU: the C kernel in csrc/qgemm.c, built with the system C
compiler on first use and called through ctypes on torch tensors' memory.

Why a kernel of our own: on AVX2 machines PyTorch's packed int8/int4 CPU ops are several times
slower than an fp32 GEMV, while decode is bound by the bytes of weights read per token; this
kernel keeps the weights packed and widens them in registers (figures in loadtest/PERF.md).

The shared library is cached under ``$PAGEDSERVE_KERNEL_CACHE`` (default
``~/.cache/pagedserve/kernels``), keyed by the source, the flags and the compiler, so a second
process (or a tensor-parallel worker) loads it without compiling. The AVX2+FMA path is compiled
only when this CPU has both (explicit ``-mavx2 -mfma``, not ``-march=native``, so a cached build
stays valid on any AVX2 machine); otherwise the portable scalar build is used, with a warning
(``PAGEDSERVE_QGEMM_ISA=scalar`` forces it, for tests).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

GROUP = 32  # int4: values per fp16 (scale, min) pair, as in GGUF Q4_1
FUSED_MAX_M = 16  # above this many rows, dequantize blocks of W and use the BLAS matmul
_DEQUANT_ROWS = 2048  # rows of W widened at a time on the large-M path (bounded scratch)
_SOURCE = Path(__file__).parent / "csrc" / "qgemm.c"


class QuantKernelError(RuntimeError):
    """The quantized kernel cannot be built or loaded; the message says what to install or change."""


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    cap = torch.backends.cpu.get_cpu_capability()  # no /proc (not Linux): trust torch's dispatch
    return {"avx2", "fma"} if cap in ("AVX2", "AVX512") else set()


def _cache_dir() -> Path:
    env = os.environ.get("PAGEDSERVE_KERNEL_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "pagedserve" / "kernels"


def _compile(cc: str, flags: list[str], out: Path) -> None:
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    except OSError as e:
        raise QuantKernelError(f"cannot write the quantized kernel's build cache {out.parent}: {e} "
                               "(set PAGEDSERVE_KERNEL_CACHE to a writable directory)") from None
    os.close(fd)
    cmd = [cc, *flags, str(_SOURCE), "-o", tmp]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise QuantKernelError(f"building the quantized kernel failed ({' '.join(cmd)}):\n{proc.stderr}")
        os.replace(tmp, out)  # atomic: a concurrent builder or loader sees the whole file or none
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.cache
def library() -> ctypes.CDLL:
    """The compiled kernel, built on first use. Raises QuantKernelError without a C compiler."""
    cc = os.environ.get("CC", "gcc")
    cc_path = shutil.which(cc)
    if cc_path is None:
        raise QuantKernelError(f"--quantization int8/int4 builds a C kernel on first use and needs a C compiler: "
                               f"{cc!r} is not on PATH (install gcc, set CC, or use --quantization none)")
    flags = ["-O3", "-std=c11", "-shared", "-fPIC", "-fopenmp"]
    cpu = _cpu_flags()
    simd = {"avx2", "fma"} <= cpu and os.environ.get("PAGEDSERVE_QGEMM_ISA") != "scalar"  # override: tests
    if simd:
        flags += ["-mavx2", "-mfma"]
        if "f16c" in cpu:  # every AVX2 CPU so far has it: int4's fp16 scales in one instruction
            flags.append("-mf16c")
    src = _SOURCE.read_bytes()
    key = hashlib.sha256(src + " ".join(flags).encode() + cc_path.encode()).hexdigest()[:16]
    path = _cache_dir() / f"qgemm-{key}.so"
    if not path.is_file():
        logger.info("building the quantized kernel: %s %s -> %s", cc, " ".join(flags), path)
        _compile(cc, flags, path)
    lib = ctypes.CDLL(str(path))
    P, I64, I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.qg_isa.restype = I
    lib.qg_isa.argtypes = []
    lib.qg_int8_mm.restype = I
    lib.qg_int8_mm.argtypes = [P, I64, I64, P, P, P, P, I64, I]
    lib.qg_int8_dequant.restype = None
    lib.qg_int8_dequant.argtypes = [P, P, I64, I64, I64, P, I]
    lib.qg_int4_mm.restype = I
    lib.qg_int4_mm.argtypes = [P, I64, I64, P, P, P, P, P, I64, I]
    lib.qg_int4_dequant.restype = None
    lib.qg_int4_dequant.argtypes = [P, P, P, I64, I64, I64, P, I]
    if lib.qg_isa() == 2:
        logger.info("quantized kernel: AVX2+FMA path")
    else:
        logger.warning("quantized kernel: this CPU lacks AVX2/FMA, so the portable scalar code runs; "
                       "int8/int4 weights will likely decode slower than --quantization none")
    return lib


def isa() -> str:
    """'avx2' or 'scalar': which path the loaded build runs."""
    return "avx2" if library().qg_isa() == 2 else "scalar"


# ------------------------------------------------------------------ quantize / reference

def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: (w8 [N, K] int8, scale [N] fp32)."""
    w = w.detach().float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    w8 = torch.clamp(torch.round(w / scale[:, None]), -127, 127).to(torch.int8)
    return w8.contiguous(), scale.contiguous()


def dequantize_int8(w8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return w8.float() * scale[:, None]


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


# ------------------------------------------------------------------ matmuls

class PackedLinear:
    """y = x @ W^T + bias for one packed weight, with everything the kernel call needs resolved
    once (pointers, the C function): a decode step makes ~120 of these calls, so the per-call
    Python work is kept to allocating ``y`` and one ctypes call."""

    __slots__ = ("mode", "tensors", "bias", "n", "k", "_mm", "_dequant", "_wargs", "_bp")

    def __init__(self, mode: str, tensors: tuple[torch.Tensor, ...], bias: torch.Tensor | None = None):
        lib = library()
        if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
            raise ValueError("the bias of a quantized linear must be contiguous float32")
        for t in tensors:
            if not t.is_contiguous() or t.device.type != "cpu":
                raise ValueError("packed weights must be contiguous CPU tensors")
        self.mode, self.tensors, self.bias = mode, tensors, bias
        self._bp = None if bias is None else bias.data_ptr()
        expected = {"int8": (torch.int8, torch.float32), "int4": (torch.uint8, torch.float16, torch.float16)}
        if mode in expected and tuple(t.dtype for t in tensors) != expected[mode]:
            raise ValueError(f"{mode} packed weights must be {expected[mode]}, got {tuple(t.dtype for t in tensors)}")
        if mode == "int8":
            w8, scale = tensors
            self.n, self.k = w8.shape
            self._mm, self._dequant = lib.qg_int8_mm, lib.qg_int8_dequant
            self._wargs = (w8.data_ptr(), scale.data_ptr())
        elif mode == "int4":
            w4, d, mn = tensors
            self.n, self.k = w4.shape[0], w4.shape[1] * 2
            self._mm, self._dequant = lib.qg_int4_mm, lib.qg_int4_dequant
            self._wargs = (w4.data_ptr(), d.data_ptr(), mn.data_ptr())
        else:
            raise ValueError(f"unknown packed mode {mode!r}")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.dtype is torch.float32 and x.is_contiguous() and x.shape[1] == self.k:
            x2 = x
        else:
            if x.shape[-1] != self.k:
                raise ValueError(f"input has {x.shape[-1]} features, the quantized weight expects {self.k}")
            x2 = x.reshape(-1, self.k).to(torch.float32).contiguous()
        m = x2.shape[0]
        if m > FUSED_MAX_M:
            y = self._blocked(x2)
        else:
            y = torch.empty((m, self.n), dtype=torch.float32)
            if self._mm(x2.data_ptr(), m, self.k, *self._wargs, self._bp, y.data_ptr(), self.n,
                        torch.get_num_threads()):
                raise MemoryError(f"qgemm: no memory for the {self.mode} kernel's activation scratch")
        return y if x2 is x else y.reshape(*x.shape[:-1], self.n)

    def _blocked(self, x2: torch.Tensor) -> torch.Tensor:
        """Large M (prefill): widen W a block of rows at a time and let the BLAS matmul do the FLOPs."""
        n, k = self.n, self.k
        nt = torch.get_num_threads()
        y = torch.empty(x2.shape[0], n, dtype=torch.float32)
        scratch = torch.empty(min(n, _DEQUANT_ROWS), k, dtype=torch.float32)
        for n0 in range(0, n, _DEQUANT_ROWS):
            n1 = min(n, n0 + _DEQUANT_ROWS)
            w = scratch[: n1 - n0]
            self._dequant(*self._wargs, k, n0, n1, w.data_ptr(), nt)
            if n1 - n0 == n:
                torch.matmul(x2, w.t(), out=y)
            else:
                y[:, n0:n1] = x2 @ w.t()
        if self.bias is not None:
            y += self.bias
        return y


def int8_mm(x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
            ) -> torch.Tensor:
    """x @ (w8 * scale[:, None]).T + bias, in fp32 (x of any leading shape)."""
    return PackedLinear("int8", (w8, scale), bias)(x)


def int4_mm(x: torch.Tensor, w4: torch.Tensor, d: torch.Tensor, mn: torch.Tensor,
            bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ dequantize_int4(w4, d, mn).T + bias, in fp32."""
    return PackedLinear("int4", (w4, d, mn), bias)(x)


if __name__ == "__main__":  # `python -m kernels.qgemm`: build now (install step), print the path taken
    logging.basicConfig(level=logging.INFO)
    print(f"qgemm kernel ready: {isa()} path")
