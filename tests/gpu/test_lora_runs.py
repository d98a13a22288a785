"""The per-run LoRA delta of long runs (prefill): runs found from the step's sequences, and the
delta run by run equal to the dense masked form (every slot's A and B over every row, then the mask)."""
from __future__ import annotations

import torch

from gpu.models.lora_layers import RUN_MIN_ROWS, LoRABatch, LoRALinear, slot_runs


def test_runs_merge_neighbours_of_one_slot_and_skip_base_rows():
    assert slot_runs([0, 0, -1, 1, 1, 2], [8, 8, 9, 10, 0, 12]) == [(0, 16, 0), (25, 35, 1), (35, 47, 2)]


def test_short_runs_keep_the_dense_form():
    assert slot_runs([0, 1, 2, 3] * 4, [1] * 16) is None  # a decode step: single-row runs
    assert slot_runs([0], [RUN_MIN_ROWS - 1]) is None
    assert slot_runs([0], [RUN_MIN_ROWS]) == [(0, RUN_MIN_ROWS, 0)]
    assert slot_runs([-1, -1], [40, 40]) is None  # no adapter rows


def _holder(g, slots: int, width: int, n_in: int, n_out: int, dtype) -> LoRALinear:
    h = LoRALinear.__new__(LoRALinear)  # the slots alone: delta_into reads nothing else
    h.in_local, h.out_local = n_in, n_out
    h.a = (torch.randn(slots, width, n_in, generator=g) * 0.3).to(dtype)
    h.b = (torch.randn(slots, width, n_out, generator=g) * 0.3).to(dtype)
    return h


def test_the_delta_run_by_run_equals_the_dense_masked_delta():
    g = torch.Generator().manual_seed(3)
    seq_slots, query_lens = [2, -1, 0, 0, 1], [9, 12, 8, 10, 11]
    rows = torch.repeat_interleave(torch.tensor(seq_slots, dtype=torch.int32), torch.tensor(query_lens))
    k = max(seq_slots) + 1
    x = torch.randn(int(rows.numel()), 40, generator=g)
    for dtype in (torch.float32, torch.bfloat16):  # fp32 and bf16 slots under fp32 activations
        h = _holder(g, 4, 24, 40, 56, dtype)
        runs = slot_runs(seq_slots, query_lens)
        assert runs is not None
        y0 = torch.randn(x.shape[0], 56, generator=g)
        got, dense = y0.clone(), y0.clone()
        h.delta_into(x, got, LoRABatch(None, k, rows, runs))
        h.delta_into(x, dense, LoRABatch((rows.unsqueeze(1) == torch.arange(k)).float(), k, rows))
        torch.testing.assert_close(got, dense, rtol=1e-5, atol=1e-5)
        base = rows < 0
        assert torch.equal(got[base], y0[base])  # base rows untouched
        assert not torch.allclose(got[~base], y0[~base])
