"""Greedy tokens and temperature draws for plain rows in one C pass (csrc/sample_cpu.c).

gpu/sampler.py sends here the rows with nothing that changes their logits, no logprobs and no
top-k / top-p / min-p; everything else, and any row these decline (a NaN, an infinite maximum),
takes its torch path. Optional like every C kernel: built for AVX-512 (16 lanes) or AVX2+FMA (8 lanes)
(kernels/isa.py),
None where the CPU has neither or no compiler is found (``PAGEDSERVE_SAMPLE_C=0`` turns it off).
"""
from __future__ import annotations

import ctypes
import functools

import torch

from pagedserve.contracts import env
from pagedserve.kernels import abi, cbuild, isa

_DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1}


@functools.cache
def library() -> ctypes.CDLL | None:
    choice = isa.choose("sample_cpu")
    if not env.SAMPLE_C.get() or choice is None:
        return None
    lib = cbuild.build_or_none("sample_cpu", choice, "torch's sampling ops")
    return None if lib is None else abi.bind(lib, "sample_cpu")


def _readable(logits: torch.Tensor) -> bool:
    return (logits.device.type == "cpu" and logits.dtype in _DTYPE_CODE and logits.dim() == 2
            and logits.stride(1) == 1 and library() is not None)


def _ids(rows: list[int] | None, logits: torch.Tensor):
    """(count, the C array of row indices or None for every row): ctypes arrays, no torch ops."""
    if rows is None or len(rows) == logits.shape[0] and rows == list(range(len(rows))):
        return logits.shape[0], None
    return len(rows), (ctypes.c_int64 * len(rows))(*rows)


def greedy(logits: torch.Tensor, rows: list[int] | None = None) -> list[int] | None:
    """The first argmax of each of ``rows`` (default: every row) of CPU fp32 / bf16 logits
    ``[rows, vocab]`` with contiguous elements: -1 for a row it declines; None where it cannot run."""
    if not _readable(logits):
        return None
    n, ids = _ids(rows, logits)
    out = (ctypes.c_int64 * n)()
    library().sp_greedy(logits.data_ptr(), n, ids, logits.shape[1], logits.stride(0), _DTYPE_CODE[logits.dtype],
                        out, torch.get_num_threads())
    return list(out)


def draw(logits: torch.Tensor, rows: list[int] | None, temperatures: list[float],
         uniforms: list[float]) -> list[int] | None:
    """One token per row of ``rows`` (default: every row) by inverse CDF over e^((x - max) / T)
    with that row's uniform number in [0, 1): -1 for a row it declines; None where it cannot run."""
    if not _readable(logits):
        return None
    n, ids = _ids(rows, logits)
    out = (ctypes.c_int64 * n)()
    rc = library().sp_draw(logits.data_ptr(), n, ids, logits.shape[1], logits.stride(0), _DTYPE_CODE[logits.dtype],
                           (ctypes.c_float * n)(*temperatures), (ctypes.c_double * n)(*uniforms), out,
                           torch.get_num_threads())
    if rc < 0:
        raise MemoryError("sample_cpu: no memory for the chunk sums")
    return list(out)
