"""Preemption by swapping with a real (tiny, random, fp32) model: the host pool round-trips K/V
exactly, and swap, recompute and no preemption at all give the same greedy tokens (in process,
and under tensor parallelism where each rank swaps its own shard)."""
from __future__ import annotations

import pytest
import torch

from pagedserve.gpu.kv_swap import HostSwapPool
from pagedserve.contracts.messages import StepInput, pack_pairs
from tests.gpu.test_mp_equivalence import GREEDY, UNTIED, prompts, shutdown_clean, token_ids
from tests.tiny import tiny_llm

SMALL_CACHE = {"num_gpu_blocks_override": 14, "block_size": 16}  # 13 usable blocks: one request fits, 16 cannot


def test_host_pool_round_trips_blocks_exactly():
    torch.manual_seed(0)
    shape = (10, 4, 3, 8)  # blocks, block size, kv heads, head dim
    caches = [(torch.randn(shape), torch.randn(shape)) for _ in range(3)]
    saved = [(k.clone(), v.clone()) for k, v in caches]
    pool = HostSwapPool(caches, num_blocks=5)
    out = StepInput.pack(1, [], [], [])
    out.blocks_to_swap_out_buf = pack_pairs([(2, 4), (7, 0), (3, 1)])
    pool.apply(out, caches)
    for k, v in caches:  # the device blocks are reused by someone else
        k[[2, 7, 3]] = 0.5
        v[[2, 7, 3]] = -0.5
    back = StepInput.pack(2, [], [], [])
    back.blocks_to_swap_in_buf = pack_pairs([(4, 9), (0, 2), (1, 5)])
    pool.apply(back, caches)
    for (k, v), (k0, v0) in zip(caches, saved):
        assert torch.equal(k[[9, 2, 5]], k0[[2, 7, 3]]) and torch.equal(v[[9, 2, 5]], v0[[2, 7, 3]])
        assert torch.equal(k[[0, 1, 4, 6, 8]], k0[[0, 1, 4, 6, 8]])


def test_swap_out_then_in_of_one_step_reads_before_it_writes():
    # A device block freed by a swap-out may receive a swap-in in the same step.
    caches = [(torch.arange(4.0).view(4, 1, 1, 1).clone(), torch.zeros(4, 1, 1, 1))]
    pool = HostSwapPool(caches, num_blocks=2)
    pool.caches[0][0][1] = 42.0
    step = StepInput.pack(1, [], [], [])
    step.blocks_to_swap_out_buf = pack_pairs([(3, 0)])
    step.blocks_to_swap_in_buf = pack_pairs([(1, 3)])
    pool.apply(step, caches)
    assert pool.caches[0][0][0].item() == 3.0 and caches[0][0][3].item() == 42.0


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    llm = tiny_llm(hf_config=UNTIED)
    try:
        out = token_ids(llm.generate(prompts(), GREEDY, use_tqdm=False))
        assert llm.core.stats().num_preemptions == 0
    finally:
        llm.shutdown()
    assert len({tuple(t) for t in out}) == len(out)
    return out


@pytest.mark.parametrize("mode, swap_blocks, prefix", [
    ("recompute", None, False),
    ("swap", 64, False),  # room for every victim
    ("swap", 64, True),
    ("swap", 4, False),  # a small pool: some victims swap, the others fall back to recompute
])
def test_preemption_modes_give_the_tokens_of_no_preemption(reference, mode, swap_blocks, prefix):
    llm = tiny_llm(hf_config=UNTIED, preemption_mode=mode, num_swap_blocks=swap_blocks,
                   enable_prefix_caching=prefix, **SMALL_CACHE)
    try:
        assert token_ids(llm.generate(prompts(), GREEDY, use_tqdm=False)) == reference
        stats = llm.core.stats()
        swap = llm.core.block_manager.swap
        assert stats.num_preemptions > 0
        if mode == "swap":
            assert swap.num_blocks == swap_blocks and llm.parts.executor.num_swap_blocks == swap_blocks
            assert swap.num_swapped_out > 0 and swap.num_swapped_in == swap.num_swapped_out
            if swap_blocks < 13:
                assert stats.num_preemptions > swap.num_swapped_out, "the full pool never fell back"
        else:
            assert swap.num_blocks == 0
        assert swap.num_free_blocks == swap.num_blocks
    finally:
        llm.shutdown()


def test_swap_space_sizes_the_pool():
    llm = tiny_llm(hf_config=UNTIED, preemption_mode="swap", swap_space=1 / 64)
    try:
        runner = llm.parts.executor.runner
        expected = (1 << 30) // 64 // runner.kv_bytes_per_block()
        assert runner.num_swap_blocks == expected == llm.core.block_manager.swap.num_blocks
        assert runner.swap_pool.caches[0][0].shape[0] == expected
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory) -> str:
    """Real weights on disk (dummy weights would differ per rank under tensor parallelism)."""
    from pagedserve.engine.tokenizer import Tokenizer
    from tests.gpu.test_models import save_hf_model

    path = tmp_path_factory.mktemp("tiny-llama-swap")
    save_hf_model(UNTIED, path, seed=3)
    Tokenizer.from_model()._tok.save(str(path / "tokenizer.json"))
    return str(path)


@pytest.mark.parametrize("parallel", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}],
                         ids=["tp2-each-shard", "pp2-each-stage"])
def test_two_ranks_swap_their_own_kv(tiny_checkpoint, parallel):
    """Under tensor parallelism each rank swaps its own shard; under pipeline parallelism each
    stage holds (and swaps) the KV of its own layers only."""
    from pagedserve.engine.llm import LLM

    options = {"model": tiny_checkpoint, "dtype": "float32", "kv_cache_memory": 1 / 16}
    single = LLM(executor="inproc", **options)
    try:
        ref = token_ids(single.generate(prompts(), GREEDY, use_tqdm=False))
    finally:
        single.shutdown()
    llm = LLM(**parallel, preemption_mode="swap", num_swap_blocks=64, **SMALL_CACHE, **options)
    try:
        assert llm.parts.executor.num_swap_blocks == 64
        assert token_ids(llm.generate(prompts(), GREEDY, use_tqdm=False)) == ref
        assert llm.core.block_manager.swap.num_swapped_out > 0
    finally:
        shutdown_clean(llm)
