"""Unquantized CPU linear layers on prepacked weights (vLLM's process_weights_after_loading).

``F.linear`` hands the plain ``[out, in]`` weight to the GEMM library, which re-blocks it on every
call; decode steps are little more than that read. After loading, ``pack_model`` reorders each
full-precision linear weight once into the layout the library reads directly:

- bf16: oneDNN (``mkldnn._reorder_linear_weight`` / ``_linear_pointwise``), about 1.45-1.5x
  ``F.linear`` for every batch size on AVX512-BF16 (loadtest/PERF.md);
- fp32: MKL's packed sgemm (``mkl._mkl_reorder_linear_weight`` / ``_mkl_linear``), as fast as
  ``F.linear`` for one row and up to 1.7x for a few rows.

The packed tensor replaces the layer's plain weight (one copy in memory) unless another module
shares that parameter (a tied LM head: the embedding lookup keeps its plain table) or bf16 keeps
it for our GEMV on 1-2 row batches (``GEMV_ROWS``: faster single-stream decode). Quantized
layers (``module.qweight``) are left alone. Off on other devices, where the ops are missing, and
with ``PAGEDSERVE_PACKED_LINEAR=0``.
"""
from __future__ import annotations

import collections
import functools
import logging
import os
import time

import torch
from torch import nn

from kernels import fused

logger = logging.getLogger(__name__)

ENV = "PAGEDSERVE_PACKED_LINEAR"

# oneDNN picks its blocked layout for a batch-size hint; 16 measured as good as 1 or 128 for
# every M from 1 to 300 on the default model's shapes.
_BATCH_HINT = 16


# bf16 batches of up to this many rows run our AVX512-BF16 GEMV (kernels/fused.py) on a kept
# plain copy of the weight: 1-2 rows are where it beats oneDNN's packed matmul (13.1 vs 14.9 ms
# for the default model's linears at one row), and single-stream decode measured ~15-20% faster
# end to end than packed-only, for twice the bf16 weight memory (loadtest/PERF.md, issue 9).
# PAGEDSERVE_PACKED_GEMV_ROWS=0 keeps one (packed) copy.
GEMV_ROWS = 2


def gemv_rows() -> int:
    try:
        return max(0, int(os.environ.get("PAGEDSERVE_PACKED_GEMV_ROWS", GEMV_ROWS)))
    except ValueError:
        return GEMV_ROWS


def enabled() -> bool:
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


@functools.cache
def _onednn_bf16() -> bool:
    ops = torch.ops.mkldnn
    try:
        return (torch.backends.mkldnn.is_available() and hasattr(ops, "_reorder_linear_weight")
                and hasattr(ops, "_linear_pointwise") and bool(ops._is_mkldnn_bf16_supported()))
    except (AttributeError, RuntimeError):
        return False


@functools.cache
def _mkl_fp32() -> bool:
    ops = torch.ops.mkl
    try:
        return (torch.backends.mkl.is_available() and torch.backends.mkldnn.is_available()
                and hasattr(ops, "_mkl_reorder_linear_weight") and hasattr(ops, "_mkl_linear"))
    except (AttributeError, RuntimeError):
        return False


def method_for(weight: torch.Tensor) -> str | None:
    """``onednn`` / ``mkl`` where a packed layout is available for this weight, else None."""
    if weight.device.type != "cpu" or weight.dim() != 2 or weight.numel() == 0 or not enabled():
        return None
    if weight.dtype is torch.bfloat16 and _onednn_bf16():
        return "onednn"
    if weight.dtype is torch.float32 and _mkl_fp32():
        return "mkl"
    return None


class PackedWeight:
    """One layer's weight (this rank's shard) in the GEMM library's own layout, and the matmul
    that reads it."""

    __slots__ = ("method", "packed", "shape_ref", "out_features", "in_features", "dtype", "plain", "gemv_rows")

    def __init__(self, weight: torch.Tensor, method: str, gemv_rows: int = 0):
        w = weight.detach().contiguous()
        self.method, self.dtype = method, w.dtype
        self.out_features, self.in_features = w.shape
        with torch.no_grad():
            if method == "onednn":
                self.packed = torch.ops.mkldnn._reorder_linear_weight(w, _BATCH_HINT)
            elif method == "mkl":
                self.packed = torch.ops.mkl._mkl_reorder_linear_weight(w, _BATCH_HINT)
            else:
                raise ValueError(f"unknown packed-linear method {method!r}")
        # _mkl_linear reads the plain weight only for its shape and dtype when told the packed
        # batch size equals the input's (we always say so): a zero-stride stand-in, no memory.
        self.shape_ref = torch.zeros((), dtype=w.dtype).expand(self.out_features, self.in_features)
        # Optionally keep the plain bf16 weight too, for our GEMV on the smallest batches.
        self.gemv_rows = gemv_rows if gemv_rows and method == "onednn" and fused.has_bf16_gemv() else 0
        self.plain = w if self.gemv_rows else None

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.method == "onednn":
            if self.gemv_rows and x.dim() == 2 and x.shape[0] <= self.gemv_rows and x.dtype is torch.bfloat16:
                y = fused.gemv_bf16(x.contiguous(), self.plain)
                return y if bias is None else y.add_(bias)
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")
        rows = x.numel() // self.in_features if self.in_features else 0
        return torch.ops.mkl._mkl_linear(x, self.packed, self.shape_ref, bias, rows)

    def dense(self) -> torch.Tensor:
        """The plain weight back, read through the packed matmul (exact: x is the identity)."""
        with torch.no_grad():
            return self.linear(torch.eye(self.in_features, dtype=self.dtype)).t().contiguous()


def dense_weight(module: nn.Module) -> torch.Tensor:
    """The ``[out, in]`` weight a linear layer computes with, also once packed (tests, checks)."""
    pweight = getattr(module, "pweight", None)
    if pweight is None or module.weight.numel():
        return module.weight
    return pweight.dense()


def _shared_params(model: nn.Module) -> set[int]:
    """ids of parameters held by more than one module (a tied LM head and embedding)."""
    count = collections.Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    return {pid for pid, n in count.items() if n > 1}


def linear_types():
    from gpu.models.layers import ColumnParallelLinear, ParallelLMHead, RowParallelLinear

    return ColumnParallelLinear, RowParallelLinear, ParallelLMHead


def pack_model(model: nn.Module) -> int:
    """Pack every unquantized linear layer's weight, in place (call once the weights are loaded;
    a packed layer is skipped if called again). Returns the number of layers packed."""
    if not enabled():
        return 0
    t0 = time.perf_counter()
    shared = _shared_params(model)
    rows = gemv_rows()
    packed = plain_bytes = 0
    with torch.no_grad():
        for module in model.modules():
            if not isinstance(module, linear_types()) or module.qweight is not None or module.pweight is not None:
                continue
            weight = module.weight
            method = method_for(weight)
            if method is None:
                continue
            module.pweight = PackedWeight(weight, method, rows)
            packed += 1
            if id(weight) not in shared and module.pweight.plain is None:
                plain_bytes += weight.numel() * weight.element_size()
                module.weight = nn.Parameter(torch.empty(0, dtype=weight.dtype, device=weight.device),
                                             requires_grad=False)
    if packed:
        logger.info("packed %d linear weights for the CPU GEMM (%.0f MB plain copies freed) in %.2f s",
                    packed, plain_bytes / 1e6, time.perf_counter() - t0)
    return packed
