"""The AVX-512 VNNI matmul for q8_0 / q4_1 weights (csrc/qgemm_n16.c) and its weight layout.

Why: the row-layout kernel (csrc/qgemm.c) spends ~12 instructions per 32 multiply-adds on a
per-group horizontal sum and scale, so it is instruction-bound at M=1 and slower than oneDNN's
bf16 matmul at M=16 (loadtest/PERF.md). Re-laying 16 output channels side by side lets one
vpdpwssd do 32 multiply-adds straight into per-channel sums, and widens each group of weights
once for all rows of x.

Used where the CPU has AVX-512 F+BW+VNNI and F16C (kernels/isa.py), unless ``PAGEDSERVE_ISA``
caps the kernels below ``vnni`` (``avx512``, ``avx2``, ``scalar``: the row-layout kernels, for tests
and comparisons). The repacked weights are made once per layer at load time.
"""
from __future__ import annotations

import ctypes
import functools
import logging

import torch

from pagedserve.kernels import abi, cbuild, isa

logger = logging.getLogger(__name__)

BLOCK = 16  # output channels per vector
GROUP = 32
# Above this many rows qgemm.PackedLinear widens blocks of W for the BLAS matmul instead (measured
# on the default model's shapes, loadtest/PERF.md: VNNI beats dequantize + matmul to 64 rows; the
# AMX kernel, whose widened form reuses each widened group for every 16 rows, to 320-384 rows).
FUSED_MAX_M = 64
ALL_ROWS = 1 << 62  # "no limit" for the rows a kernel takes
FUSED_MAX_M_AMX = 320


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled n16 kernel (the VNNI build, else the AVX2 one), or None where it is not wanted or
    cannot be built (the row-layout kernel then runs; a build failure is logged, never raised)."""
    choice = isa.choose("qgemm_n16")
    if choice is None:
        return None
    lib = cbuild.build_or_none("qgemm_n16", choice, "the row-layout quantized kernel")
    if lib is None:
        return None
    abi.bind(lib, "qgemm_n16")
    logger.info("quantized kernel: %s path (16-channel layout)", "AVX-512 VNNI" if choice.level == "vnni" else "AVX2")
    return lib


@functools.cache
def fused_max_m() -> int:
    """The most rows the n16 kernel takes before qgemm.PackedLinear widens W for torch's matmul.
    The AVX2 build takes every M (ALL_ROWS): its many-row path widens each group once for all rows,
    and one kernel for every M keeps a row's result independent of the batch (design invariant)."""
    choice = isa.choose("qgemm_n16")
    return ALL_ROWS if choice is not None and choice.level == "avx2" else FUSED_MAX_M


AMX_MIN_M = 10  # bf16 batches of this many rows or more go to AMX (VNNI won at 8, AMX at 16: PERF.md)


@functools.cache
def amx_library() -> ctypes.CDLL | None:
    """The AMX bf16 kernel on the n16 layout (csrc/qgemm_amx.c), or None where the CPU lacks AMX,
    Linux refuses the tile state, or ``PAGEDSERVE_ISA`` caps the kernels below AMX."""
    choice = isa.choose("qgemm_amx")
    if library() is None or choice is None:
        return None
    lib = cbuild.build_or_none("qgemm_amx", choice, "the VNNI quantized kernel")
    if lib is None:
        return None
    if not cbuild.amx_tiles_granted():
        logger.warning("quantized kernel: Linux refused the AMX tile state, the VNNI path runs")
        return None
    abi.bind(lib, "qgemm_amx")
    logger.info("quantized kernel: AMX bf16 tiles for batches of %d+ rows", AMX_MIN_M)
    return lib


def _blocks(t: torch.Tensor, n: int) -> torch.Tensor:
    """[n, ...] -> [NB, 16, ...], padding rows with zeros up to a multiple of 16."""
    nb = -(-n // BLOCK)
    if nb * BLOCK != n:
        t = torch.cat([t, t.new_zeros((nb * BLOCK - n, *t.shape[1:]))])
    return t.reshape(nb, BLOCK, *t.shape[1:])


def _scales(s: torch.Tensor, n: int) -> torch.Tensor:
    """[n, G] fp16 -> [NB, G, 16]."""
    return _blocks(s, n).permute(0, 2, 1).contiguous()


def repack_q4_1(w4: torch.Tensor, d: torch.Tensor, mn: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Row-layout q4_1 (kernels/qgemm.py) -> (codes [NB, G*256] uint8, d, m [NB, G, 16] fp16);
    see csrc/qgemm_n16.c for the byte order."""
    n, half = w4.shape
    g = half // 16
    p = w4.reshape(n, g, 16)
    q = torch.cat([p & 0x0F, p >> 4], dim=2)  # [n, G, 32] codes in input order
    q = _blocks(q, n)  # [NB, 16 ch, G, 32]
    nb = q.shape[0]
    # [NB, G, 16 pairs j, 16 ch, 2] -> lanes l = 2 ch + e; j = 4 t + s
    q = q.reshape(nb, BLOCK, g, 16, 2).permute(0, 2, 3, 1, 4).reshape(nb, g, 4, 4, 32)
    lo = q[:, :, :, 0] | (q[:, :, :, 1] << 4)  # byte 0 of word (t, l): nibbles s = 0, 1
    hi = q[:, :, :, 2] | (q[:, :, :, 3] << 4)  # byte 1: s = 2, 3
    words = torch.stack([lo, hi], dim=-1)  # [NB, G, 4 t, 32 l, 2 bytes]
    return words.reshape(nb, g * 256).contiguous(), _scales(d, n), _scales(mn, n)


def repack_q8_0(w8: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Row-layout q8_0 -> (codes [NB, G*512] int8, d [NB, G, 16] fp16)."""
    n, k = w8.shape
    g = k // GROUP
    q = _blocks(w8.reshape(n, g, GROUP), n)  # [NB, 16 ch, G, 32]
    nb = q.shape[0]
    q = q.reshape(nb, BLOCK, g, 16, 2).permute(0, 2, 3, 1, 4)  # [NB, G, 16 j, 16 ch, 2]
    return q.reshape(nb, g * 512).contiguous(), _scales(d, n)


def repack(mode: str, tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """``repack_q4_1`` / ``repack_q8_0`` (the reference forms, kept for the tests), done by the
    library's C loop where it is loaded: torch's permutes took ~8 s for the default model."""
    lib = library()
    if lib is None:
        return repack_q4_1(*tensors) if mode == "q4_1" else repack_q8_0(*tensors)
    w, d = tensors[0], tensors[1]
    n, g = d.shape
    nb, nt = -(-n // BLOCK), torch.get_num_threads()
    d_out = torch.empty(nb, g, BLOCK, dtype=torch.float16)  # (the C loop writes every byte)
    if mode == "q4_1":
        words = torch.empty(nb, g * 256, dtype=torch.uint8)
        mn_out = torch.empty_like(d_out)
        lib.qn_q4_repack(w.data_ptr(), d.data_ptr(), tensors[2].data_ptr(), n, g * GROUP, words.data_ptr(),
                         d_out.data_ptr(), mn_out.data_ptr(), nt)
        return words, d_out, mn_out
    codes = torch.empty(nb, g * 512, dtype=torch.int8)
    lib.qn_q8_repack(w.data_ptr(), d.data_ptr(), n, g * GROUP, codes.data_ptr(), d_out.data_ptr(), nt)
    return codes, d_out


def _unscales(s: torch.Tensor, n: int) -> torch.Tensor:
    return s.permute(0, 2, 1).reshape(-1, s.shape[1])[:n].contiguous()


def unrepack(mode: str, tensors: tuple[torch.Tensor, ...], n: int, k: int) -> tuple[torch.Tensor, ...]:
    """The row-layout tensors (kernels/qgemm.py) back from n16 ones: exact inverse of ``repack``."""
    g = k // GROUP
    if mode == "q8_0":
        codes, d = tensors
        q = codes.reshape(-1, g, 16, BLOCK, 2).permute(0, 3, 1, 2, 4).reshape(-1, k)[:n]
        return q.contiguous(), _unscales(d, n)
    words, d, mn = tensors
    b = words.reshape(-1, g, 4, 32, 2)
    q = torch.stack([b[..., 0] & 0x0F, b[..., 0] >> 4, b[..., 1] & 0x0F, b[..., 1] >> 4], dim=3)  # [NB, G, t, s, l]
    q = q.reshape(-1, g, 16, BLOCK, 2).permute(0, 3, 1, 2, 4).reshape(-1, g, GROUP)[:n]  # codes in input order
    packed = q[..., :16] | (q[..., 16:] << 4)
    return packed.reshape(n, k // 2).contiguous(), _unscales(d, n), _unscales(mn, n)
