"""Issue 35: a worker's memory after many finished sequences through the default model (a 49,152-token
vocabulary, 0.35 MiB KV blocks) is what it was after the first ones. The prefix cache hands out every
free block before it evicts a cached one, so a run whose prompts are all new walks the whole block
pool: the cache's pages must be resident from the start, not come one block at a time."""
from __future__ import annotations

import os

import pytest

from engine.sampling_params import SamplingParams
from tests.gpu.test_kv_alloc import _resident_bytes

WORDS = "river bright cold winter paper engine garden quiet number seven blue market light stone".split()


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _prompts(start: int, count: int) -> list[str]:
    return [" ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(40)) + f" #{i}"
            for i in range(start, start + count)]


@pytest.mark.slow
@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="reads /proc/self/statm")
def test_finished_sequences_leave_the_worker_flat():
    from engine.llm import LLM

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
