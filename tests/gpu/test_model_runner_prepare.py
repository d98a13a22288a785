"""ModelRunner.prepare: the all-decode fast path builds the same tensors as the general path."""
from __future__ import annotations

import random

import torch

from gpu.config import EngineConfig
from gpu.model_runner import BatchRequest, ModelRunner


def _runner(block_size: int = 4) -> ModelRunner:
    return ModelRunner(EngineConfig.from_options(device="cpu", block_size=block_size))


def test_decode_slots_and_tables_match_the_definition():
    rng = random.Random(0)
    r = _runner()
    reqs = []
    for _ in range(9):
        table = rng.sample(range(1, 200), rng.randint(1, 7))
        pos = rng.randrange(len(table) * 4)
        reqs.append(BatchRequest([rng.randrange(100)], pos, table))
    b = r.prepare(reqs)
    assert b.meta.num_decodes == 9
    assert b.meta.slot_mapping.dtype == torch.long
    assert b.meta.slot_mapping.tolist() == [q.block_table[q.start_position // 4] * 4 + q.start_position % 4
                                           for q in reqs]
    width = max(len(q.block_table) for q in reqs)
    assert b.meta.block_tables.dtype == torch.int32
    assert b.meta.block_tables.tolist() == [q.block_table + [0] * (width - len(q.block_table)) for q in reqs]
    assert b.positions.tolist() == [q.start_position for q in reqs]


def test_mixed_batch_slots_unchanged():
    r = _runner()
    reqs = [BatchRequest([5], 6, [3, 9]), BatchRequest([1, 2, 3], 2, [7, 8])]
    b = r.prepare(reqs)
    assert b.meta.num_decodes == 1
    assert b.meta.slot_mapping.tolist() == [9 * 4 + 2, 7 * 4 + 2, 7 * 4 + 3, 8 * 4 + 0]
