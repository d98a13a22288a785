"""Unquantized CPU linear layers on prepacked weights (vLLM's process_weights_after_loading).

``F.linear`` hands the plain ``[out, in]`` weight to the GEMM library, which re-blocks it on every
call; decode steps are little more than that read. After loading, ``pack_model`` reorders each
full-precision linear weight once into oneDNN's blocked layout (``mkldnn._reorder_linear_weight``,
read by ``mkldnn._linear_pointwise``). Measured on the default model's 121 linears
(loadtest/PERF.md, issue 9):

- bf16 (AVX512-BF16/AMX): packed is 1.25-1.5x ``F.linear`` from 3 rows up to a few hundred; for
  1-2 rows our AVX512-BF16 GEMV (kernels/fused.py) on the plain weight is faster still, worth
  15-60% more single-stream decode speed than packed-only, so bf16 keeps the plain weight too;
- fp32: packed is 1.2-1.6x ``F.linear`` from 4 to 64 rows and within ~6% above; for one row it is
  ~20% slower, so fp32 keeps the plain weight for ``F.linear`` on 1-row batches. (MKL's packed
  sgemm, ``mkl._mkl_linear``, was measured too: 1.5x slower than ``F.linear`` from 64 rows up on
  one thread.)

The second copy is kept only while all of them fit in an eighth of the machine's memory
(``plain_copy_budget``): a model that fills the box keeps one packed copy, as with
``PAGEDSERVE_PACKED_SMALL_ROWS=0``. A tied LM
head's plain table always stays (the embedding lookup reads it). Quantized layers
(``module.qweight``) are left alone. Off on other devices and where the ops are missing, and with
``PAGEDSERVE_PACKED_LINEAR=0``. Batch rows are padded to buckets, each built once at start-up
(``enabled`` says why).
"""
from __future__ import annotations

import collections
import functools
import logging
import os
import time

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.contracts import env
from pagedserve.kernels import fused
from pagedserve.kernels.row_buckets import buckets_upto, row_bucket  # noqa: F401  (tests read them here)

logger = logging.getLogger(__name__)

ENV = env.PACKED_LINEAR.name
SMALL_ROWS_ENV = env.PACKED_SMALL_ROWS.name

# oneDNN picks its blocked layout for a batch-size hint; 16 measured as good as 1 or 128 for
# every M from 1 to 300 on the default model's shapes.
_BATCH_HINT = 16

# Batches of at most this many rows read the plain weight: our GEMV (bf16), F.linear (fp32).
SMALL_ROWS = {torch.bfloat16: 2, torch.float32: 1}


def enabled() -> bool:
    """On by default (``PAGEDSERVE_PACKED_LINEAR=0`` turns it off). oneDNN builds and caches one
    primitive per distinct (weight shape, batch rows), ~0.6-1.8 MB each: left alone a server's RSS
    grows with every new step size (the bounded soak caught +25 %), so rows are padded to a few
    buckets (``row_bucket``) and every bucket is built at start-up (``warm_row_buckets``)."""
    return env.PACKED_LINEAR.get()


def small_rows(dtype: torch.dtype) -> int:
    """How many rows still run on the plain weight for this dtype (0: none, one packed copy)."""
    if not env.PACKED_SMALL_ROWS.get():
        return 0
    if dtype is torch.bfloat16 and not fused.has_bf16_gemv():
        return 0  # F.linear on plain bf16 is slower than packed at every size
    return SMALL_ROWS.get(dtype, 0)


@functools.cache
def _onednn(dtype: torch.dtype) -> bool:
    ops = torch.ops.mkldnn
    try:
        # optional: torch builds without these oneDNN ops fall back to plain rows
        if not (torch.backends.mkldnn.is_available() and hasattr(ops, "_reorder_linear_weight")
                and hasattr(ops, "_linear_pointwise")):
            return False
        return dtype is torch.float32 or (dtype is torch.bfloat16 and bool(ops._is_mkldnn_bf16_supported()))
    except (AttributeError, RuntimeError):
        return False


def can_pack(weight: torch.Tensor) -> bool:
    """A packed layout exists for this weight here (CPU, bf16 or fp32, ops in this torch build)."""
    return (enabled() and weight.device.type == "cpu" and weight.dim() == 2 and weight.numel() > 0
            and weight.dtype in (torch.bfloat16, torch.float32) and _onednn(weight.dtype))


def _onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The one call into oneDNN's packed matmul (it builds a primitive per new row count)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _packed_mm(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W^T (+ bias) on the packed weight, the rows padded up to their bucket."""
    x2 = x.reshape(-1, x.shape[-1])
    rows = x2.shape[0]
    bucket = row_bucket(rows)
    if bucket != rows:
        padded = x2.new_zeros((bucket, x2.shape[1]))
        padded[:rows].copy_(x2)
        x2 = padded
    y = _onednn_linear(x2, packed, bias)
    return y[:rows].view(*x.shape[:-1], y.shape[-1])


class PackedWeight:
    """One layer's weight (this rank's shard) in oneDNN's layout, the matmul that reads it, and
    optionally the plain weight for the smallest batches."""

    __slots__ = ("packed", "plain", "small_rows", "out_features", "in_features", "dtype")

    def __init__(self, weight: torch.Tensor, small_rows: int = 0):
        w = weight.detach().contiguous()
        self.dtype = w.dtype
        self.out_features, self.in_features = w.shape
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(w, _BATCH_HINT)
        self.small_rows = small_rows
        self.plain = w if small_rows else None

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.small_rows and x.dim() == 2 and x.shape[0] <= self.small_rows:
            if self.dtype is torch.float32 and (x.shape[0] > fused.GEMV_F32_MAX_M or not fused.has_f32_gemv()):
                return F.linear(x, self.plain, bias)
            # fp32: our GEMV reads the plain weight at ~2.5x torch's rate on the AVX2 box (the tied
            # LM head of the default model: 3.2 against 8.2 ms a row; loadtest/PERF.md)
            y = (fused.gemv_f32 if self.dtype is torch.float32 else fused.gemv_bf16)(x.contiguous(), self.plain)
            return y if bias is None else y.add_(bias)
        return _packed_mm(x, self.packed, bias)

    def dense(self) -> torch.Tensor:
        """The plain weight back, read through the packed matmul (exact: x is the identity)."""
        with torch.no_grad():
            eye = torch.eye(self.in_features, dtype=self.dtype)
            return torch.ops.mkldnn._linear_pointwise(eye, self.packed, None, "none", [], "").t().contiguous()


def dense_weight(module: nn.Module) -> torch.Tensor:
    """The ``[out, in]`` weight a linear layer computes with, also once packed (tests, checks)."""
    pweight = getattr(module, "pweight", None)  # optional: only packed layers have one
    if pweight is None or module.weight.numel():
        return module.weight
    return pweight.dense()


def plain_copy_budget() -> int:
    """Bytes of plain weight copies a process may keep beside the packed ones: 1/8 of RAM (the
    default model's 270 MB of bf16 linears on a 24 GB box, not a 7B model's 14 GB)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 8
    except (ValueError, OSError, AttributeError):
        return 0


def _shared_params(model: nn.Module) -> set[int]:
    """ids of parameters held by more than one module (a tied LM head and embedding)."""
    count = collections.Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    return {pid for pid, n in count.items() if n > 1}


def linear_types():
    from pagedserve.gpu.models.layers import ColumnParallelLinear, ParallelLMHead, RowParallelLinear

    return ColumnParallelLinear, RowParallelLinear, ParallelLMHead


def pack_model(model: nn.Module) -> int:
    """Pack every unquantized linear layer's weight, in place (call once the weights are loaded;
    a packed layer is skipped if called again). Returns the number of layers packed."""
    if not enabled():
        return 0
    from pagedserve.gpu.models.weights import _one_cpu_thread

    t0 = time.perf_counter()
    shared = _shared_params(model)
    packed = plain_bytes = 0
    todo = [m for m in model.modules() if isinstance(m, linear_types()) and m.qweight is None
            and m.pweight is None and can_pack(m.weight)]
    copies = sum(m.weight.numel() * m.weight.element_size() for m in todo)
    keep_plain = copies <= plain_copy_budget()
    if not keep_plain:
        logger.info("one packed copy per linear weight: %.0f MB of weights exceed the plain-copy "
                    "budget of %.0f MB", copies / 1e6, plain_copy_budget() / 1e6)
    # One thread, as for the weight copies: each reorder is a short memory-bound parallel region,
    # and on a busy 2-core box a descheduled thread stalls it (bf16: 0.17 s on 1 thread, 1.2 s on 2).
    with torch.no_grad(), _one_cpu_thread():
        for module in todo:
            weight = module.weight
            module.pweight = PackedWeight(weight, small_rows(weight.dtype) if keep_plain else 0)
            packed += 1
            if id(weight) not in shared and module.pweight.plain is None:
                plain_bytes += weight.numel() * weight.element_size()
                module.weight = nn.Parameter(torch.empty(0, dtype=weight.dtype, device=weight.device),
                                             requires_grad=False)
    if packed:
        logger.info("packed %d linear weights for oneDNN (%.0f MB of plain copies freed) in %.2f s",
                    packed, plain_bytes / 1e6, time.perf_counter() - t0)
    return packed


def warm_row_buckets(model: nn.Module, max_tokens: int, max_seqs: int) -> int:
    """Run every packed weight shape once per row bucket a step can produce (``max_tokens`` rows,
    ``max_seqs`` for the LM head), so oneDNN builds its primitives now: start-up pays ~0.5 s and
    ~100-150 MB once, instead of the RSS growing and the first steps of each size stalling while
    serving. Returns the number of primitives built."""
    from pagedserve.gpu.models.layers import ParallelLMHead

    shapes: dict[tuple, tuple[PackedWeight, torch.Tensor | None, int]] = {}
    for module in model.modules():
        pw = getattr(module, "pweight", None)  # optional: only packed layers have one
        if isinstance(pw, PackedWeight):
            limit = max_seqs if isinstance(module, ParallelLMHead) else max_tokens
            bias = getattr(module, "bias", None)  # optional: layer kinds differ
            key = (pw.out_features, pw.in_features, pw.dtype, bias is None)
            shapes[key] = (pw, bias, max(limit, shapes.get(key, (pw, bias, 0))[2]))
    # Quantized weights widen W for torch's matmul on their many-row path (kernels/qgemm.py):
    # the same primitives per row count, so the same buckets, one weight per shape.
    quantized: dict[tuple, tuple[object, torch.dtype, int]] = {}
    for module in model.modules():
        qw = getattr(module, "qweight", None)  # optional: only quantized layers have one
        if qw is not None and hasattr(qw, "kernel"):
            limit = max_seqs if isinstance(module, ParallelLMHead) else max_tokens
            dtype = qw.dtype if qw.dtype in (torch.bfloat16, torch.float32) else torch.float32
            key = (qw.out_features, qw.in_features, dtype, qw.mode)
            quantized[key] = (qw.kernel, dtype, max(limit, quantized.get(key, (None, dtype, 0))[2]))
    t0, built = time.perf_counter(), 0
    with torch.no_grad():
        for pw, bias, limit in shapes.values():
            for rows in buckets_upto(limit):
                if rows > pw.small_rows:
                    pw.linear(torch.zeros(rows, pw.in_features, dtype=pw.dtype), bias)
                    built += 1
        for kernel, dtype, limit in quantized.values():
            built += kernel.warm(limit, dtype)
    if built:
        logger.info("built %d matmul primitives (%d weight shapes, rows up to %d) in %.2f s",
                    built, len(shapes) + len(quantized), max_tokens, time.perf_counter() - t0)
    return built
