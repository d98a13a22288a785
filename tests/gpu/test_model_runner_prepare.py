"""ModelRunner.prepare: the all-decode fast path builds the same tensors as the general path."""
from __future__ import annotations

import random

import torch

from pagedserve.contracts.config import EngineConfig
from pagedserve.gpu.batch import BatchRequest
from pagedserve.gpu.model_runner import ModelRunner


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


def test_blocks_to_copy_are_copied_in_every_layer_before_the_new_seqs():
    """Copy-on-write of beam forks (StepInput.blocks_to_copy): dst takes src's K/V, others untouched."""
    from pagedserve.contracts.messages import StepInput, pack_ints

    r = _runner()
    torch.manual_seed(0)
    r.kv_caches = [(torch.randn(6, 4, 2, 3), torch.randn(6, 4, 2, 3)) for _ in range(3)]
    before = [(k.clone(), v.clone()) for k, v in r.kv_caches]
    step = StepInput.pack(step_id=1, new_seqs=[], seq_ids=[], num_new_tokens=[])
    step.blocks_to_copy_buf = pack_ints([2, 5, 3, 1])
    assert step.blocks_to_copy == [(2, 5), (3, 1)]
    r.execute(step)
    for (k, v), (k0, v0) in zip(r.kv_caches, before):
        for cache, old in ((k, k0), (v, v0)):
            assert torch.equal(cache[5], old[2]) and torch.equal(cache[1], old[3])
            for b in (0, 2, 3, 4):
                assert torch.equal(cache[b], old[b])
