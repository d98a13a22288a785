"""Issue 35: a worker's memory after many finished sequences through the default model (a 49,152-token
vocabulary, 0.35 MiB KV blocks) is what it was after the first ones. The prefix cache hands out every
free block before it evicts a cached one, so a run whose prompts are all new walks the whole block
pool: the cache's pages must be resident from the start, not come one block at a time."""
from __future__ import annotations

import os

import pytest

from pagedserve.engine.sampling_params import SamplingParams
from tests.gpu.test_kv_alloc import _resident_bytes

WORDS = "river bright cold winter paper engine garden quiet number seven blue market light stone".split()


def _rss_bytes() -> int:
    """Resident bytes once the C heap's free pages are given back, as the executor does every few
    seconds (gpu/heap_trim.py): what is held, not where the allocator happens to stand."""
    from pagedserve.gpu.heap_trim import glibc_trim

    glibc_trim()
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _prompts(start: int, count: int) -> list[str]:
    return [" ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(40)) + f" #{i}"
            for i in range(start, start + count)]


@pytest.mark.slow
@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="reads /proc/self/statm")
def test_finished_sequences_leave_the_worker_flat():
    from pagedserve.engine.llm import LLM

    llm = LLM(kv_cache_memory=0.0625, executor="inproc")  # ~180 blocks: the run below walks them all
    try:
        runner = llm.parts.executor.runner
        block_bytes = runner.kv_bytes_per_block()
        num_blocks = runner.num_blocks
        kv = [t for pair in runner.kv_caches for t in pair]
        assert sum(_resident_bytes(t) for t in kv) == sum(t.numel() * t.element_size() for t in kv)
        assert block_bytes > 300_000  # the default model's blocks (what made the growth visible)
        sp = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
        llm.generate(_prompts(0, 16), sp, use_tqdm=False)  # warm-up: every kernel, every shape
        before = _rss_bytes()
        finished = 0
        for r in range(6):
            finished += len(llm.generate(_prompts(100 + 32 * r, 32), sp, use_tqdm=False))
        grown = _rss_bytes() - before
        # ~3 full blocks a sequence, all new content: the pool was walked more than twice over
        assert finished * 3 > 2 * num_blocks, (finished, num_blocks)
        # Before the fix: one block's bytes for each block first reached, ~60 MiB here.
        assert grown < 8 * block_bytes, f"the worker grew {grown / 2**20:.1f} MiB over {finished} sequences"
    finally:
        llm.shutdown()


def _every_kind_of_request(llm, rng_seed: int) -> None:
    """n > 1, logprobs and prompt logprobs, stops, logit bias and min tokens, penalties, seeds, beams
    and greedy rows: each keeps state in the worker while it runs (sampler preps, drafts, swap)."""
    from pagedserve.engine.sampling_params import BeamSearchParams

    texts = [f"{w} {i} " * (3 + i % 5) for i, w in enumerate(WORDS)]
    params = [
        SamplingParams(temperature=0, max_tokens=12),
        SamplingParams(temperature=1.0, max_tokens=10, n=3, seed=rng_seed),
        SamplingParams(temperature=0.8, max_tokens=9, logprobs=3, prompt_logprobs=2),
        SamplingParams(temperature=1.0, max_tokens=11, stop=["the", "7"], presence_penalty=0.5),
        SamplingParams(temperature=1.0, max_tokens=8, logit_bias={11: 5.0}, min_tokens=4, top_k=20, top_p=0.9),
    ]
    llm.generate(texts, [params[i % len(params)] for i in range(len(texts))], use_tqdm=False)
    if llm.config.speculative is None:  # (beam search and speculation do not mix)
        llm.beam_search([{"prompt": texts[0]}], BeamSearchParams(beam_width=3, max_tokens=6))


@pytest.mark.parametrize("options", [
    {"preemption_mode": "swap", "swap_space": 0.01, "num_gpu_blocks_override": 24},
    {"preemption_mode": "recompute", "num_gpu_blocks_override": 24,
     "speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
                            "prompt_lookup_min": 1}},
])
def test_the_worker_forgets_every_finished_sequence(options):
    """Issue 35, item 2: whatever a sequence did (preempted by swap or recompute, speculated, beamed,
    sampled with every option), once it finishes no per-sequence state stays in the worker."""
    from tests.tiny import tiny_llm

    llm = tiny_llm(executor="inproc", **options)
    try:
        runner = llm.parts.executor.runner
        for seed in range(2):
            _every_kind_of_request(llm, seed)
        assert llm.core.stats().num_preemptions > 0  # the tiny cache made sequences wait their turn
        llm.generate(["flush"], SamplingParams(max_tokens=1), use_tqdm=False)  # the step that forgets
        # Only the flush itself may remain: the engine tells the worker at its next step.
        pending = set(llm.core.scheduler._finished_ids)
        assert len(pending) == 1 and set(runner.seqs) == pending
        if runner.drafter is not None:
            assert set(runner.drafter.computed) <= pending
        if runner.swap_pool is not None:
            assert llm.core.block_manager.num_free_blocks == llm.core.block_manager.num_usable_blocks
    finally:
        llm.shutdown()
