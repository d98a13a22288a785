"""The decoder layer's small elementwise steps as one Triton kernel each (the CUDA path): the
residual add with RMSNorm, the rotary embedding of q and k in place, and SiLU(gate) * up.

Why: on an H200 a batch-1 decode step of a 1.2B Llama ran 340 kernels in 1.25 ms, about 560 us
of it outside the matmuls: rotary alone was five torch kernels a layer (clone, mul, addcmul,
mul, addcmul: ~170 us a step), the residual add and torch's RMSNorm two more (~155 us), SiLU
and mul two (loadtest/PERF.md, "GPU check on an H200"). Each kernel here reads and writes its
data once and computes in fp32, rounding once to the activations' dtype, as the CPU's fused C
ops do (kernels/fused.py), so the two devices share their arithmetic.

Tested under ``TRITON_INTERPRET=1`` against torch (tests/kernels/test_triton_elementwise.py)
and compiled for sm_80 in tests/kernels/test_triton_compile.py.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(out_ptr, x_ptr, residual_ptr, weight_ptr, n, eps, stride_out, stride_x, stride_res,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    """One row: (x + residual -> residual, rounded to its dtype), then its RMSNorm times the fp32
    weight -> out."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_res + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(r.dtype)  # rounded as torch's add rounds it
        tl.store(residual_ptr + row * stride_res + cols, x, mask=mask)
    v = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(v * v, 0) / n + eps)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_out + cols, (v * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight_f32: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm of the rows of ``x [T, N]`` (last dim contiguous) into a new tensor; with
    ``residual`` ([T, N], contiguous), first ``residual += x`` in place, normalising the sum (the
    decoder layer's pre-norm: the caller keeps ``residual``)."""
    rows, n = x.shape
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if rows:
        res = residual if residual is not None else x
        _rms_norm_kernel[(rows,)](out, x, res, weight_f32, n, eps, out.stride(0), x.stride(0), res.stride(0),
                                  HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(n),
                                  num_warps=4 if n <= 4096 else 8)
    return out


@triton.jit
def _rotary_neox_kernel(x_ptr, cos_sin_ptr, positions_ptr, num_heads, max_position, stride_t, stride_h,
                        HALF: tl.constexpr, HALF_PAD: tl.constexpr, HEADS_PAD: tl.constexpr):
    """One token, every head: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) in fp32, in place."""
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token)
    pos = tl.minimum(tl.maximum(pos, 0), max_position - 1).to(tl.int64)  # the table's rows only
    j = tl.arange(0, HALF_PAD)
    h = tl.arange(0, HEADS_PAD)
    jm = j < HALF
    cos = tl.load(cos_sin_ptr + pos * 2 * HALF + j, mask=jm, other=0.0)
    sin = tl.load(cos_sin_ptr + pos * 2 * HALF + HALF + j, mask=jm, other=0.0)
    mask = (h < num_heads)[:, None] & jm[None, :]
    first = x_ptr + token * stride_t + h[:, None] * stride_h + j[None, :]
    x1 = tl.load(first, mask=mask, other=0.0)
    x2 = tl.load(first + HALF, mask=mask, other=0.0)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    tl.store(first, (a * cos[None, :] - b * sin[None, :]).to(x1.dtype), mask=mask)
    tl.store(first + HALF, (b * cos[None, :] + a * sin[None, :]).to(x1.dtype), mask=mask)


def rotary_neox_(x: torch.Tensor, cos_sin_cache: torch.Tensor, positions: torch.Tensor, rotary_dim: int) -> None:
    """Rotate ``x [T, H, D]`` in place (neox layout, the first ``rotary_dim`` of each head) at
    ``positions [T]``; ``cos_sin_cache [P, rotary_dim]`` (cos half, sin half) in fp32. x may be a
    strided view (q and k heads of a fused qkv output) with a contiguous last dim. Positions
    outside the table are clamped to it (no device assert mid-step)."""
    tokens, heads, _ = x.shape
    if tokens == 0:
        return
    half = rotary_dim // 2
    _rotary_neox_kernel[(tokens,)](x, cos_sin_cache, positions, heads, cos_sin_cache.shape[0], x.stride(0),
                                   x.stride(1), HALF=half, HALF_PAD=triton.next_power_of_2(half),
                                   HEADS_PAD=triton.next_power_of_2(heads))


@triton.jit
def _silu_and_mul_kernel(out_ptr, x_ptr, n, stride_out, stride_x, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + n + cols, mask=mask, other=0.0).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


SILU_BLOCK = 1024


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up over the halves of ``x [T, 2I]`` (last dim contiguous) -> ``[T, I]``."""
    rows, two_n = x.shape
    n = two_n // 2
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if rows:
        _silu_and_mul_kernel[(rows, triton.cdiv(n, SILU_BLOCK))](out, x, n, out.stride(0), x.stride(0),
                                                                BLOCK=SILU_BLOCK)
    return out
