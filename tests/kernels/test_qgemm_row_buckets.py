"""The quantized matmul's many-row path (W widened for torch's matmul) runs padded to row buckets,
all built at start-up: oneDNN caches a primitive per row count, and one per prompt length grew
the default-model worker ~0.35 MiB per finished sequence (issue 35)."""
from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import qgemm
from pagedserve.kernels.row_buckets import buckets_upto


@pytest.mark.parametrize("layout", ["int8c", "q8_0", "q4_1"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_after_the_warm_up_no_row_count_reaches_the_matmul_unseen(layout, dtype, monkeypatch):
    gen = torch.Generator().manual_seed(7)
    k, n = 256, 80
    w = torch.randn(n, k, generator=gen) * 0.05
    bias = torch.randn(n, generator=gen)
    packed = qgemm.quantize(w, layout)
    linear = qgemm.PackedLinear(layout, packed, bias)
    many_rows = [r for r in (70, 100, 129, 257, 299, 300) if r > linear._fused_max]
    if not many_rows:
        pytest.skip("this CPU's quantized kernel takes every row count itself (no widened matmul)")
    rows_seen: set[int] = set()
    real = torch.matmul

    def recording(a, b, *args, **kw):
        rows_seen.add(a.shape[0])
        return real(a, b, *args, **kw)

    monkeypatch.setattr(torch, "matmul", recording)
    built = linear.warm(300, dtype)
    warmed = set(rows_seen)
    assert warmed == {b for b in buckets_upto(300) if b > linear._fused_max} and built == len(warmed)
    ref_w = qgemm.dequantize(layout, packed)
    for rows in many_rows:
        x = torch.randn(rows, k, generator=gen).to(dtype)
        y = linear(x)
        assert y.shape == (rows, n) and y.is_contiguous()
        ref = x.float() @ ref_w.t() + bias
        assert (y.float() - ref).abs().max().item() <= 1e-2 * ref.abs().max().item() + 1e-5
    assert rows_seen == warmed  # padded to buckets already built: no new primitive
