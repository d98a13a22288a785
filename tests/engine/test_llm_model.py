"""The engine with a real (tiny, random, fp32) model: scheduling choices never change greedy
outputs; seeds reproduce; and the default model answers as transformers does."""
from __future__ import annotations

import random

import pytest

from pagedserve.engine.sampling_params import SamplingParams
from tests.tiny import tiny_llm

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def prompts(n: int = 32) -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(100, 40000) for _ in range(rng.randrange(3, 90))] for _ in range(n)]


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    """Each prompt run alone, one at a time, with no prefix caching."""
    llm = tiny_llm(enable_prefix_caching=False)
    try:
        outs = [llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in prompts()]
    finally:
        llm.shutdown()
    # The comparisons below only mean something if the model's outputs depend on its input.
    assert len({tuple(o) for o in outs}) > 16
    assert all(len(set(o)) > 1 for o in outs[:8]) or len({o[0] for o in outs}) > 8
    return outs


def test_batch_of_32_equals_one_at_a_time(reference):
    llm = tiny_llm()
    try:
        assert token_ids(llm.generate(prompts(), GREEDY, use_tqdm=False)) == reference
    finally:
        llm.shutdown()


@pytest.mark.parametrize("chunk", [7, 16, 64])
def test_chunked_prefill_at_several_chunk_sizes(reference, chunk):
    llm = tiny_llm(max_num_batched_tokens=chunk, enable_prefix_caching=False)
    try:
        assert token_ids(llm.generate(prompts(), GREEDY, use_tqdm=False)) == reference
    finally:
        llm.shutdown()


def test_tiny_kv_cache_preempts_and_outputs_stay_identical(reference):
    # 13 usable blocks of 16 tokens: the longest request alone fits, 32 at once cannot.
    llm = tiny_llm(num_gpu_blocks_override=14, block_size=16, enable_prefix_caching=False)
    try:
        assert token_ids(llm.generate(prompts(), GREEDY, use_tqdm=False)) == reference
        assert llm.core.stats().num_preemptions > 0
    finally:
        llm.shutdown()


def test_prefix_caching_hits_and_outputs_unchanged():
    shared = list(range(500, 580))  # 80 shared tokens = 5 full blocks
    ps = [shared + [1000 + i, 2000 + i] for i in range(6)]
    outs = {}
    for caching in (False, True):
        llm = tiny_llm(enable_prefix_caching=caching)
        try:
            # The first request fills the cache; the rest (a later step) can hit it.
            outs[caching] = token_ids(llm.generate(ps[:1], GREEDY, use_tqdm=False)
                                      + llm.generate(ps[1:], GREEDY, use_tqdm=False))
            stats = llm.core.stats()
            assert (stats.prefix_cache_hits > 0) == caching
        finally:
            llm.shutdown()
    assert outs[True] == outs[False]


def test_n3_seeded_is_reproducible_and_independent_of_batch():
    llm = tiny_llm()
    try:
        p = prompts(1)[0]
        params = SamplingParams(n=3, temperature=1.0, seed=1234, max_tokens=10, ignore_eos=True)
        first = llm.generate([p], params, use_tqdm=False)[0]
        assert len(first.outputs) == 3
        assert len({tuple(o.token_ids) for o in first.outputs}) == 3  # three different samples
        others = [SamplingParams(temperature=0.8, max_tokens=10, ignore_eos=True)] * 8
        batch = llm.generate(prompts(8) + [p], others + [params], use_tqdm=False)
        assert [o.token_ids for o in batch[-1].outputs] == [o.token_ids for o in first.outputs]
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def default_llm():
    from pagedserve.engine.llm import LLM

    llm = LLM(dtype="float32", kv_cache_memory=0.25)
    yield llm
    llm.shutdown()


def test_default_model_completes_paris(default_llm):
    out = default_llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=8))
    assert out[0].outputs[0].text.startswith(" Paris.")


def test_default_model_chat_answer_matches_transformers(default_llm):
    out = default_llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                           SamplingParams(temperature=0, max_tokens=64))
    assert out[0].outputs[0].text == "The capital of France is Paris."
    assert out[0].outputs[0].finish_reason == "stop"


def test_logit_bias_and_min_tokens_ids_become_tensors_once_per_sequence():
    """Issue 22: the worker keeps each sequence's bias / min_tokens ids as tensors (built at its
    first sample), and they act: a +100 bias forces its token, min_tokens holds off the stop id."""
    llm = tiny_llm()
    try:
        runner = llm.parts.executor.runner
        forced = 1234
        seen = []
        execute = runner.execute

        def spy(step):
            out = execute(step)
            seen.append({sid: s.logits_prep for sid, s in runner.seqs.items()})
            return out

        runner.execute = spy
        bias = {forced: 100.0, **{t: -1.0 for t in range(10_000, 11_000)}, 10**9: 5.0}
        out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=6, logit_bias=bias,
                                                       min_tokens=3, stop_token_ids=[forced]), use_tqdm=False)[0]
        got = out.outputs[0].token_ids  # blocked for 3 tokens, then forced (and a stop id)
        assert len(got) == 4 and forced not in got[:3] and got[3] == forced
        assert out.outputs[0].finish_reason == "stop"
        preps = [p for step in seen for p in step.values()]
        assert preps and all(p is preps[0] for p in preps)  # one LogitsPrep, kept from step to step
        assert preps[0].bias_ids.shape[0] == 1001 and forced in preps[0].blocked_ids.tolist()  # and EOS
    finally:
        llm.shutdown()
