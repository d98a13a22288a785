"""Pooling requests through the engine with a real (tiny, random, fp32) model: the same scheduler
and KV cache as generation. Chunked prefill, batching with decodes, preemption and prefix-cache
hits leave the vectors unchanged; generation beside them keeps its tokens; blocks are freed as
soon as the vector is back."""
from __future__ import annotations

import math
import random

import pytest

from pagedserve.engine.errors import RequestRejectedError
from pagedserve.engine.pooling_outputs import PoolingRequestOutput
from pagedserve.engine.pooling_params import PoolingParams
from pagedserve.engine.sampling_params import SamplingParams
from tests.tiny import TINY_CONFIG, tiny_llm

KINDS = ["last", "mean", "cls"]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def inputs(n: int, lo: int = 3, hi: int = 90, seed: int = 11) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def cos(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    return dot / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))


def assert_same_vectors(got: list[list[float]], want: list[list[float]]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert len(g) == len(w)
        assert cos(g, w) > 0.99999
        assert max(abs(x - y) for x, y in zip(g, w)) < 1e-4


def vectors(outs) -> list[list[float]]:
    return [o.outputs.embedding for o in outs]


@pytest.fixture(scope="module")
def reference() -> dict[str, list[list[float]]]:
    """Each input embedded alone, no prefix caching, the whole prompt in one step."""
    llm = tiny_llm(enable_prefix_caching=False)
    try:
        return {k: [llm.embed([p], PoolingParams(pooling_type=k))[0].outputs.embedding for p in inputs(12)]
                for k in KINDS}
    finally:
        llm.shutdown()


def test_vectors_are_normalised_distinct_and_full_size(reference):
    for kind, vecs in reference.items():
        assert all(len(v) == TINY_CONFIG["hidden_size"] for v in vecs)
        assert all(abs(sum(x * x for x in v) - 1) < 1e-5 for v in vecs)
        assert max(cos(vecs[0], v) for v in vecs[1:]) < 0.9999, kind  # they depend on the input
    assert cos(reference["last"][0], reference["mean"][0]) < 0.9999


@pytest.mark.parametrize("chunk", [8, 32])
def test_chunked_prefill_gives_the_same_vector(reference, chunk):
    # Inputs up to 90 tokens, a budget of 8 or 32 per step: long inputs are split over steps.
    assert max(map(len, inputs(12))) > 2 * chunk
    llm = tiny_llm(max_num_batched_tokens=chunk, enable_prefix_caching=False)
    try:
        for kind in KINDS:
            assert_same_vectors(vectors(llm.embed(inputs(12), PoolingParams(pooling_type=kind))), reference[kind])
    finally:
        llm.shutdown()


def test_tiny_kv_cache_preempts_and_vectors_stay(reference):
    # 13 usable blocks of 16 tokens: each request fits alone, not all of them at once; chunks of
    # 16 tokens keep embeddings holding blocks over several steps while generations grow.
    gen_prompts = inputs(4, lo=40, hi=60, seed=3)
    alone = tiny_llm(enable_prefix_caching=False)
    try:
        expected = [o.outputs[0].token_ids for o in alone.generate(
            [{"prompt_token_ids": p} for p in gen_prompts], SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))]
    finally:
        alone.shutdown()
    llm = tiny_llm(num_gpu_blocks_override=14, block_size=16, max_num_batched_tokens=16, enable_prefix_caching=False)
    core = llm.core
    preempted: list[bool] = []  # whether each victim was a pooling sequence
    preempt = core.scheduler._preempt

    def recording(seq):
        preempted.append(seq.pooling is not None)
        preempt(seq)

    core.scheduler._preempt = recording
    try:
        for kind in KINDS:
            for i, p in enumerate(gen_prompts):
                core.add_request(f"{kind}-g{i}", None, p, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
            for j, p in enumerate(inputs(12)):
                core.add_request(f"{kind}-e{j}", None, p, PoolingParams(pooling_type=kind))
            tokens: dict[str, list[int]] = {}
            pooled: dict[str, list[float]] = {}
            while core.has_unfinished():
                for out in core.step():
                    if isinstance(out, PoolingRequestOutput):
                        pooled[out.request_id] = out.outputs.data
                    else:
                        tokens.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
            assert [tokens[f"{kind}-g{i}"] for i in range(len(gen_prompts))] == expected
            assert_same_vectors([pooled[f"{kind}-e{j}"] for j in range(12)], reference[kind])
        assert any(preempted) and core.stats().num_preemptions > 0
        core.block_manager.check_invariants()
    finally:
        llm.shutdown()


def test_last_pooling_hits_the_prefix_cache_mean_does_not(reference):
    llm = tiny_llm(block_size=16)
    try:
        long = inputs(12)
        first = llm.encode(long, PoolingParams())
        again = llm.encode(long, PoolingParams())
        assert_same_vectors([o.outputs.data for o in again], reference["last"])
        assert all(o.num_cached_tokens == (len(p) - 1) // 16 * 16 for o, p in zip(again, long))
        assert sum(o.num_cached_tokens for o in again) > 0 and all(o.num_cached_tokens == 0 for o in first)
        mean = llm.encode(long, PoolingParams(pooling_type="mean"))
        assert all(o.num_cached_tokens == 0 for o in mean)
        assert_same_vectors([o.outputs.data for o in mean], reference["mean"])
        # and a generation prompt that starts like an embedded input hits the blocks it left
        gen = llm.generate([long[0] + [7, 8]], GREEDY)[0]
        assert gen.num_cached_tokens == len(long[0]) // 16 * 16 > 0
    finally:
        llm.shutdown()


def test_embeddings_mixed_with_streaming_generation(reference):
    """Embeddings join a batch of decoding generations; the generations stream exactly the tokens
    they produce alone, the embeddings come back unchanged, and both share steps."""
    gen_prompts = inputs(3, seed=5)
    alone = tiny_llm()
    try:
        expected = [o.outputs[0].token_ids for o in alone.generate([{"prompt_token_ids": p} for p in gen_prompts], GREEDY)]
    finally:
        alone.shutdown()

    llm = tiny_llm(max_num_batched_tokens=32, enable_prefix_caching=False)
    core = llm.core
    try:
        for i, p in enumerate(gen_prompts):
            core.add_request(f"g{i}", None, p, GREEDY)
        streamed: dict[str, list[int]] = {f"g{i}": [] for i in range(len(gen_prompts))}
        pooled: dict[str, list[float]] = {}
        mixed_steps = 0
        step = 0
        while core.has_unfinished():
            if step == 4:  # the generations are decoding by now
                for j, p in enumerate(inputs(12)):
                    core.add_request(f"e{j}", None, p, PoolingParams())
            scheduled = core.schedule()
            decodes = [s for s, n in zip(scheduled.seqs, scheduled.num_new_tokens) if s.pooling is None and n == 1]
            if decodes and any(s.pooling is not None for s in scheduled.seqs):
                mixed_steps += 1
            outputs = core.process(scheduled, core.executor.execute(scheduled.step_input))
            for out in outputs:
                if isinstance(out, PoolingRequestOutput):
                    assert out.finished and out.finish_reason == "stop"
                    pooled[out.request_id] = out.outputs.data
                    # freed at once: no table left, the worker told to forget it
                    seq_ids = [s for s, seq in core._seqs.items() if seq.request.request_id == out.request_id]
                    assert seq_ids == []
                else:
                    streamed[out.request_id].extend(out.outputs[0].token_ids)
            step += 1
        assert mixed_steps >= 3
        assert [streamed[f"g{i}"] for i in range(len(gen_prompts))] == expected
        assert_same_vectors([pooled[f"e{j}"] for j in range(12)], reference["last"])
        assert core.block_manager.tables == {}
        core.block_manager.check_invariants()
    finally:
        llm.shutdown()


def test_pooled_blocks_are_freed_in_the_step_that_returns_the_vector():
    llm = tiny_llm(block_size=16, enable_prefix_caching=False)
    core = llm.core
    try:
        free = core.block_manager.num_free_blocks
        core.add_request("e", None, list(range(100, 150)), PoolingParams())
        scheduled = core.schedule()
        assert core.block_manager.num_free_blocks == free - 4
        [out] = core.process(scheduled, core.executor.execute(scheduled.step_input))
        assert isinstance(out, PoolingRequestOutput) and len(out.outputs) == TINY_CONFIG["hidden_size"]
        assert core.block_manager.num_free_blocks == free and not core.has_unfinished()
        assert core.scheduler._finished_ids == [scheduled.seqs[0].seq_id]  # the worker forgets it next
    finally:
        llm.shutdown()


def test_refusals_and_abort():
    llm = tiny_llm(max_model_len=64)
    core = llm.core
    try:
        core.add_request("fits", None, list(range(100, 164)), PoolingParams())  # all 64: no token to generate
        with pytest.raises(RequestRejectedError, match="context"):
            core.add_request("long", None, list(range(100, 165)), PoolingParams())
        with pytest.raises(RequestRejectedError, match="dimensions") as e:
            core.add_request("dims", None, [100], PoolingParams(dimensions=TINY_CONFIG["hidden_size"] + 1))
        assert e.value.param == "dimensions"
        with pytest.raises(RequestRejectedError, match="out of range"):
            core.add_request("vocab", None, [10**7], PoolingParams())
        out = core.abort_request("fits")
        assert isinstance(out, PoolingRequestOutput) and out.finish_reason == "abort" and out.outputs is None
        assert not core.has_unfinished() and core.block_manager.tables == {}
        short = llm.embed([[100, 101]], PoolingParams(dimensions=5))[0].outputs.embedding
        assert len(short) == 5 and abs(sum(x * x for x in short) - 1) < 1e-5
    finally:
        llm.shutdown()


def test_score_is_the_cosine_of_the_embeddings(reference):
    llm = tiny_llm()
    try:
        texts = inputs(3)
        scores = llm.score(texts[0], texts)
        assert [round(s.outputs.score, 5) for s in scores] == [
            round(cos(reference["last"][0], reference["last"][i]), 5) for i in range(3)]
        pairwise = llm.score(texts[:2], texts[1:3])
        assert [round(s.outputs.score, 5) for s in pairwise] == [
            round(cos(reference["last"][0], reference["last"][1]), 5),
            round(cos(reference["last"][1], reference["last"][2]), 5)]
        with pytest.raises(ValueError, match="same length"):
            llm.score(texts[:2], texts)
    finally:
        llm.shutdown()
