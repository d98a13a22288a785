"""A LoRA layer's delta on CPU goes through the C delta (kernels/fused.py lora_add) for every step,
prefill chunks included, and equals the dense masked torch form (every slot's A and B over every row,
then the mask) that CUDA and a CPU without the C library run."""
from __future__ import annotations

import pytest
import torch

from pagedserve.gpu.models.lora_layers import LoRABatch, LoRALinear
from pagedserve.kernels import abi, fused

pytestmark = pytest.mark.skipif(not fused.available(), reason="no C compiler for the fused ops")


def _holder(g, slots: int, rank: int, cols: list[int], n_in: int, dtype) -> LoRALinear:
    """The slots alone (delta_into reads nothing else), laid out as LoRALinear lays them out: A of the
    sections stacked, B^T block-diagonal."""
    h = LoRALinear.__new__(LoRALinear)
    sections = len(cols) - 1
    h.in_local, h.out_local = n_in, cols[-1]
    h.a = (torch.randn(slots, sections * rank, n_in, generator=g) * 0.3).to(dtype)
    b = torch.zeros(slots, sections * rank, cols[-1])
    for i in range(sections):
        b[:, i * rank:(i + 1) * rank, cols[i]:cols[i + 1]] = torch.randn(slots, rank, cols[i + 1] - cols[i],
                                                                          generator=g) * 0.3
    h.b = b.to(dtype)
    h.spec = abi.LinearSpec()
    fused.attach_lora(h.spec, h.a, h.b, rank, cols)
    return h


def _dense(h: LoRALinear, x, y, batch: LoRABatch) -> None:
    spec, h.spec = h.spec, None
    try:
        h.delta_into(x, y, batch)
    finally:
        h.spec = spec


@pytest.mark.parametrize("lora_dtype", [torch.float32, torch.bfloat16])
def test_a_prefill_steps_delta_runs_in_c_and_equals_the_dense_form(lora_dtype, monkeypatch):
    g = torch.Generator().manual_seed(3)
    seq_slots, query_lens = [2, -1, 0, 0, 1], [9, 12, 8, 10, 11]
    rows = torch.repeat_interleave(torch.tensor(seq_slots, dtype=torch.int32), torch.tensor(query_lens))
    k = max(seq_slots) + 1
    h = _holder(g, 4, 8, [0, 24, 40, 56], 40, lora_dtype)
    x = torch.randn(int(rows.numel()), 40, generator=g)
    y0 = torch.randn(x.shape[0], 56, generator=g)
    batch = LoRABatch((rows.unsqueeze(1) == torch.arange(k)).float(), k, rows)
    calls = []
    real = fused.lora_add
    monkeypatch.setattr(fused, "lora_add", lambda *a: (calls.append(a), real(*a)))
    got, dense = y0.clone(), y0.clone()
    h.delta_into(x, got, batch)
    assert len(calls) == 1
    _dense(h, x, dense, batch)
    assert len(calls) == 1
    torch.testing.assert_close(got, dense, rtol=1e-5, atol=1e-5)
    base = rows < 0
    assert torch.equal(got[base], y0[base])  # base rows untouched
    assert not torch.allclose(got[~base], y0[~base])


def test_a_step_without_host_slots_keeps_the_dense_form():
    g = torch.Generator().manual_seed(4)
    h = _holder(g, 2, 4, [0, 16], 12, torch.float32)
    x = torch.randn(3, 12, generator=g)
    mask = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]])
    got, want = torch.zeros(3, 16), torch.zeros(3, 16)
    h.delta_into(x, got, LoRABatch(mask, 2, None))
    want[0] = (x[0] @ h.a[0].t()) @ h.b[0]
    want[1] = (x[1] @ h.a[1].t()) @ h.b[1]  # row 2 is a base row: zeros
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
