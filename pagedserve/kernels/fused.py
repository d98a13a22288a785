"""Fused CPU ops for small-batch decode (csrc/fused_cpu.c), called through ctypes.

Why: a batch-1 decode step of a 30-layer model runs ~1,800 eager torch ops; rms_norm alone is
five ops (~40 us) per call at batch 1, rotary five more, SiLU-and-mul three. Each op here does
the same arithmetic in one pass over a few KB. The bf16 GEMV (AVX512-BF16 CPUs) streams weights
at about twice the rate of torch's bf16 GEMV there (figures in loadtest/PERF.md).

Everything is optional: without a C compiler, or with ``PAGEDSERVE_FUSED=0``, ``available()`` is
False and the model runs its torch ops. kernels/cbuild.py builds the shared library and caches it
under ``$PAGEDSERVE_KERNEL_CACHE`` (default ``~/.cache/pagedserve/kernels``) keyed by source, flags
and compiler, like every C kernel's.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import subprocess

import torch

from pagedserve.contracts import env
from pagedserve.kernels import abi, cbuild, isa
from pagedserve.kernels import kv_cache_dtype

logger = logging.getLogger(__name__)

# Rows the bf16 GEMV takes. Measured (120 decode GEMVs of the default model, one thread, CPU time,
# vs F.linear): M=1 1.63x, 2 1.57x, 4 1.40x, 8 1.13x, 16 0.81x; past 8 rows oneDNN's tiles win.
GEMV_MAX_M = 8
# Rows the fp32 GEMV (fz_gemv_f32) takes in the fused layer: it reads the plain fp32 weight, which
# gpu/models/packed_linear.py keeps for 1-row batches (oneDNN's packed copy serves the rest).
GEMV_F32_MAX_M = 8


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled library, or None (no compiler, build failure, or PAGEDSERVE_FUSED=0)."""
    choice = isa.choose("fused_cpu")
    if not env.FUSED.get() or choice is None:
        return None
    try:
        lib = cbuild.build_kernel("fused_cpu", choice)
    except cbuild.CompilerMissing as e:
        logger.info("fused CPU ops off: %s", e)
        return None
    except (OSError, cbuild.KernelBuildError, subprocess.SubprocessError) as e:
        logger.warning("fused CPU ops off: building %s failed: %s", isa.KERNELS["fused_cpu"].source, e)
        return None
    return abi.bind(lib, "fused_cpu")


KIND_PLAIN, KIND_Q8_0, KIND_Q4_1 = 0, 1, 2
KERNEL_FAILED = -3  # fz_attn_in / fz_mlp_out: a quantized kernel found no memory for its scratch
ATTN_FAILED = -4  # fz_decode_stack: the attention kernel rejected its arguments or had no memory


def available() -> bool:
    return library() is not None


def has_bf16_gemv() -> bool:
    lib = library()
    return lib is not None and lib.fz_isa() == 2


def has_f32_gemv() -> bool:
    """fz_gemv_f32 is vector code here (an AVX2 or AVX-512 build; the portable build's loop is
    slower than torch's GEMV, so small fp32 batches stay on torch there)."""
    lib = library()
    return lib is not None and lib.fz_isa() >= 1


_DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1}


def supports(t: torch.Tensor) -> bool:
    """Whether the fused ops take this activation (CPU, fp32/bf16, and the library loaded)."""
    return t.device.type == "cpu" and t.dtype in _DTYPE_CODE and library() is not None


def add_rms_norm_(x: torch.Tensor, residual: torch.Tensor, weight_f32: torch.Tensor, eps: float) -> None:
    """In place: ``residual += x``; ``x = rms_norm(residual) * weight``. Both [M, H], contiguous."""
    M, H = x.shape
    if library().fz_add_rms_norm(x.data_ptr(), residual.data_ptr(), weight_f32.data_ptr(), M, H, eps,
                                 _DTYPE_CODE[x.dtype]):
        raise ValueError(f"hidden size {H} too large for the fused rms_norm")


def rms_norm(x: torch.Tensor, weight_f32: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm over the last dim of x [M, H] (rows may be strided, elements contiguous)."""
    M, H = x.shape
    out = torch.empty((M, H), dtype=x.dtype)
    if library().fz_rms_norm(x.data_ptr(), x.stride(0), weight_f32.data_ptr(), out.data_ptr(), M, H, eps,
                             _DTYPE_CODE[x.dtype]):
        raise ValueError(f"hidden size {H} too large for the fused rms_norm")
    return out


def rotary_neox_(x: torch.Tensor, heads: int, head_dim: int, rotary_dim: int, cos_sin_cache: torch.Tensor,
                 positions: torch.Tensor) -> None:
    """Rotate the first ``heads`` heads of each row of x [T, >= heads*head_dim] in place.
    ``cos_sin_cache`` fp32 [P, rotary_dim]; ``positions`` int64 [T]."""
    library().fz_rotary_neox(x.data_ptr(), x.shape[0], x.stride(0), heads, head_dim, rotary_dim,
                             cos_sin_cache.data_ptr(), positions.data_ptr(), _DTYPE_CODE[x.dtype])


def can_write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, slots: torch.Tensor) -> bool:
    """``write_kv`` takes these: CPU, fp32 or bf16 rows (caches of that dtype, fp8, or bf16 for fp32 rows) of contiguous
    heads with one stride for k and v, contiguous caches in host memory, int64 slots."""
    return (k.device.type == "cpu" and k_cache.device.type == "cpu" and library() is not None and k.dtype == v.dtype and k.dtype in _DTYPE_CODE
            and kv_cache_dtype.readable(k_cache.dtype, k.dtype)
            and k.dim() == 3 and k.stride(2) == 1 and k.stride(1) == k.shape[2] and k.stride() == v.stride()
            and k_cache.is_contiguous() and slots.dtype == torch.int64 and slots.is_contiguous())


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slots: torch.Tensor) -> None:
    """Rows ``k, v [T, Hkv, D]`` into caches ``[blocks, block_size, Hkv, D]`` at ``slots[:T]``
    (-1 skips a row), encoded to fp8 / rounded to bf16 for such caches; a slot past the cache raises instead of writing."""
    T = k.shape[0]
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    assert v_cache.shape == k_cache.shape and v_cache.is_contiguous() and slots.shape[0] >= T
    bad = library().fz_write_kv(k.data_ptr(), v.data_ptr(), k.stride(0) * k.element_size(), k_cache.data_ptr(),
                                v_cache.data_ptr(), slots.data_ptr(), T, k.shape[1] * k.shape[2], num_slots,
                                _DTYPE_CODE[k.dtype], kv_cache_dtype.write_kind(k_cache.dtype, k.dtype))
    if bad:
        raise IndexError(f"{bad} KV cache slots out of range (the cache has {num_slots})")


def silu_and_mul_bf16(h: torch.Tensor) -> torch.Tensor:
    """silu(h[:, :I]) * h[:, I:] for a contiguous bf16 h [M, 2I] (AVX512-BF16 builds: has_bf16_gemv)."""
    M, I = h.shape[0], h.shape[1] // 2
    a = h.new_empty((M, I))
    if library().fz_silu_mul_bf16(h.data_ptr(), M, I, a.data_ptr(), torch.get_num_threads()):
        raise ValueError("the fused SiLU-and-mul is not available in this build")
    return a


def silu_and_mul_f32(h: torch.Tensor) -> torch.Tensor:
    """silu(h[:, :I]) * h[:, I:] for a contiguous fp32 h [M, 2I]: the fused layer's SiLU (csrc/exp.h's
    exp256 on AVX2), so an eager step and a fused one give a row the same result."""
    M, I = h.shape[0], h.shape[1] // 2
    a = h.new_empty((M, I))
    library().fz_silu_mul_f32(h.data_ptr(), M, I, a.data_ptr(), torch.get_num_threads())
    return a


def gemv_f32(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T in fp32 for M <= 16 (both contiguous fp32): the fused layer's
    plain fp32 linear, exposed for its tests."""
    M, K = x.shape
    N = weight.shape[0]
    y = torch.empty((M, N), dtype=torch.float32)
    if library().fz_gemv_f32(x.data_ptr(), M, K, weight.data_ptr(), N, y.data_ptr(), torch.get_num_threads()):
        raise ValueError("the fp32 GEMV takes 1 to 16 rows")
    return y


MAX_LORA_SECTIONS = 3  # fz_linear.lora_col holds 4 boundaries: q/k/v is the widest fused layer


def attach_lora(spec: abi.LinearSpec, a: torch.Tensor, b: torch.Tensor, rank: int, cols: list[int]) -> None:
    """Give a fused linear its multi-LoRA slots, so that the fused decode layer adds each row's
    adapter delta after the base GEMV (csrc/fused_lora.h) instead of the step leaving it.
    ``a`` [slots, S*rank, in], ``b`` [slots, S*rank, out] (B^T, block-diagonal, scaling folded in),
    contiguous CPU tensors of one dtype, fp32 or bf16 (the adapter dtype, ``--lora-dtype``: any of the
    two with either activations' dtype; the C delta widens bf16 exactly and sums in fp32); section i's
    rows feed output columns ``cols[i]:cols[i+1]``. The spec keeps their addresses: the caller keeps
    them alive and copies new adapters into them in place."""
    sections = len(cols) - 1
    if not 1 <= sections <= MAX_LORA_SECTIONS or a.shape[1] != sections * rank or b.shape[1] != a.shape[1]:
        raise ValueError(f"LoRA slots of shape {tuple(a.shape)} / {tuple(b.shape)} do not fit {sections} "
                         f"sections of rank {rank}")
    if not (a.is_contiguous() and b.is_contiguous() and a.device.type == b.device.type == "cpu"
            and a.dtype == b.dtype and a.dtype in _DTYPE_CODE and cols[-1] == b.shape[2]):
        raise ValueError("LoRA slots must be contiguous CPU tensors of one fp32/bf16 dtype covering the output")
    spec.lora_a, spec.lora_b = a.data_ptr(), b.data_ptr()
    spec.lora_rank, spec.lora_sections = rank, sections
    spec.lora_dtype = _DTYPE_CODE[a.dtype]
    for i in range(4):
        spec.lora_col[i] = cols[min(i, sections)]


def lora_add(spec: abi.LinearSpec, x: torch.Tensor, y: torch.Tensor, rows: torch.Tensor) -> None:
    """y += the multi-LoRA delta of x's rows (``rows``: int32, each row's slot, -1 = none) through the
    slots ``attach_lora`` gave ``spec``: the fused layer's arithmetic, for steps it does not run.
    x [M, K], y [M, N]: contiguous CPU tensors of the activations' dtype (fp32 or bf16)."""
    M, K = x.shape
    if rows.dtype != torch.int32 or rows.numel() != M or y.shape[0] != M or y.dtype != x.dtype:
        raise ValueError("lora_add takes int32 slots for each of x's rows and y of x's dtype")
    if library().fz_lora_add(ctypes.byref(spec), x.data_ptr(), M, K, y.shape[1], y.data_ptr(), rows.data_ptr(),
                             torch.get_num_threads(), _DTYPE_CODE[x.dtype]):
        raise MemoryError("no memory for the LoRA delta's scratch")


def gemv_bf16(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T in bf16 for M <= 16 (both contiguous bf16; the model routes
    M <= GEMV_MAX_M here)."""
    M, K = x.shape
    N = weight.shape[0]
    y = torch.empty((M, N), dtype=torch.bfloat16)
    if library().fz_gemv_bf16(x.data_ptr(), M, K, weight.data_ptr(), N, y.data_ptr(), torch.get_num_threads()):
        raise ValueError("the bf16 GEMV is not available in this build")
    return y


if __name__ == "__main__":  # `python -m pagedserve.kernels.fused`: build now, print the path taken
    logging.basicConfig(level=logging.INFO)
    lib = library()
    print("fused CPU ops:", "off" if lib is None else {2: "avx512-bf16", 1: "avx2", 0: "portable"}[lib.fz_isa()])
