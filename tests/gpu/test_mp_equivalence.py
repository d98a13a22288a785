"""The multi-process executor changes nothing but where the model runs: `mp` gives the outputs of
`inproc` (greedy batch, seeded sampling with logprobs, preemption under a tiny KV cache), and
tensor parallelism over gloo gives the greedy tokens of a single rank.

The tiny model here has untied embeddings: with TINY_CONFIG's tied ones a random model just
repeats the last prompt token, which would let a broken attention path pass unnoticed.
"""
from __future__ import annotations

import os
import random

import pytest

from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.contracts.errors import ExecutorError
from tests.tiny import TINY_CONFIG, tiny_llm

UNTIED = {**TINY_CONFIG, "tie_word_embeddings": False}
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def prompts(n: int = 16, seed: int = 11) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(rng.randrange(3, 90))] for _ in range(n)]


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


async def stream_token_ids(engine, prompt_list, params) -> list[list[int]]:
    """Every prompt as its own concurrent stream through an AsyncEngine: the tokens of each."""
    import asyncio

    async def one(i, p):
        toks: list[int] = []
        async for out in engine.generate(p, params, f"r{i}"):
            toks += out.outputs[0].token_ids
        return toks
    return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompt_list)))


def seeded_params() -> list[SamplingParams]:
    """Seeded sampling of several kinds, with logprobs: reproducible in any process."""
    return [
        SamplingParams(n=3, temperature=1.0, seed=1234, max_tokens=10, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=10, ignore_eos=True, logprobs=1),
        SamplingParams(temperature=1.3, top_k=20, seed=99, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=0.7, min_p=0.05, seed=5, max_tokens=10, ignore_eos=True,
                       presence_penalty=0.5),
    ]


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def shutdown_clean(llm) -> None:
    """Shut down; a multi-process executor must leave no worker and no ring segment behind."""
    ex = llm.parts.executor
    names = [r.name for r in (ex._res.step_ring, ex._res.reply_ring)] if hasattr(ex, "_res") else []
    pids = list(getattr(ex, "worker_pids", []))
    llm.shutdown()
    assert all(_gone(p) for p in pids)
    assert not [n for n in names if os.path.exists(f"/dev/shm/{n}")]


@pytest.fixture(scope="module")
def inproc():
    llm = tiny_llm(hf_config=UNTIED, executor="inproc")
    assert llm.config.parallel.executor == "inproc"
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def mp():
    llm = tiny_llm(hf_config=UNTIED, executor="mp")
    assert type(llm.parts.executor).__name__ == "MultiprocExecutor"
    yield llm
    shutdown_clean(llm)


@pytest.fixture(scope="module")
def reference(inproc) -> list[list[int]]:
    out = token_ids(inproc.generate(prompts(), GREEDY, use_tqdm=False))
    assert len({tuple(t) for t in out}) == len(out)  # the model really depends on its input
    assert all(len(set(t)) > 1 for t in out)
    return out


def test_greedy_batch_of_16_mp_equals_inproc(mp, inproc, reference):
    out = mp.generate(prompts(), GREEDY, use_tqdm=False)
    assert token_ids(out) == reference
    ref_text = [o.outputs[0].text for o in inproc.generate(prompts(), GREEDY, use_tqdm=False)]
    assert [o.outputs[0].text for o in out] == ref_text
    assert all(o.outputs[0].finish_reason == "length" for o in out)


def test_seeded_sampling_and_logprobs_mp_equal_inproc(mp, inproc):
    ps = prompts(4, seed=3)
    a = inproc.generate(ps, seeded_params(), use_tqdm=False)
    b = mp.generate(ps, seeded_params(), use_tqdm=False)
    assert len(a[0].outputs) == len(b[0].outputs) == 3
    for ra, rb in zip(a, b):
        for ca, cb in zip(ra.outputs, rb.outputs):
            assert ca.token_ids == cb.token_ids
            assert ca.text == cb.text
            assert (ca.logprobs is None) == (cb.logprobs is None)
            if ca.logprobs is not None:
                assert len(ca.logprobs) == len(cb.logprobs) == 10
                for la, lb in zip(ca.logprobs, cb.logprobs):
                    assert la.keys() == lb.keys()
                    for tok in la:
                        assert la[tok].logprob == pytest.approx(lb[tok].logprob, abs=1e-5)
    # the three seeded samples of one request differ from each other (it is sampling)
    assert len({tuple(c.token_ids) for c in b[0].outputs}) == 3


def test_tiny_kv_cache_preemption_mp_equals_inproc(reference):
    # 13 usable blocks of 16 tokens: one request fits, the batch of 16 cannot.
    outs, preemptions = {}, {}
    for kind in ("inproc", "mp"):
        llm = tiny_llm(hf_config=UNTIED, executor=kind, num_gpu_blocks_override=14, block_size=16,
                       enable_prefix_caching=False)
        try:
            outs[kind] = token_ids(llm.generate(prompts(), GREEDY, use_tqdm=False))
            preemptions[kind] = llm.core.stats().num_preemptions
        finally:
            shutdown_clean(llm)
    assert preemptions["inproc"] > 0 and preemptions["mp"] > 0
    assert outs["mp"] == outs["inproc"] == reference


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory) -> str:
    """A random tiny Llama saved as safetensors, with the default model's tokenizer.json. Dummy
    weights cannot serve here: each rank draws its own shard, so TP=2 would be another model."""
    from pagedserve.engine.tokenizer import Tokenizer
    from tests.gpu.test_models import save_hf_model

    path = tmp_path_factory.mktemp("tiny-llama")
    save_hf_model(UNTIED, path, seed=3)
    Tokenizer.from_model()._tok.save(str(path / "tokenizer.json"))
    return str(path)


def test_tensor_parallel_2_tiny_equals_single_rank(tiny_checkpoint):
    from pagedserve.engine.llm import LLM

    options = {"model": tiny_checkpoint, "dtype": "float32", "kv_cache_memory": 1 / 16}
    single = LLM(executor="inproc", **options)
    try:
        ref = token_ids(single.generate(prompts(), GREEDY, use_tqdm=False))
    finally:
        single.shutdown()
    assert len({tuple(t) for t in ref}) == len(ref) and all(len(set(t)) > 1 for t in ref)
    # No executor chosen: tensor parallelism implies the multi-process executor.
    llm = LLM(tensor_parallel_size=2, **options)
    try:
        assert llm.config.parallel.executor == "mp"
        assert len(llm.parts.executor.worker_pids) == 2
        assert token_ids(llm.generate(prompts(), GREEDY, use_tqdm=False)) == ref
    finally:
        shutdown_clean(llm)


def test_inproc_with_tensor_parallel_is_refused():
    with pytest.raises(ExecutorError, match="needs executor='mp'"):
        tiny_llm(hf_config=UNTIED, tensor_parallel_size=2, executor="inproc")


DEFAULT_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
                   "1, 2, 3, 4,"]
DEFAULT_GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def test_default_model_tensor_parallel_equals_single_rank():
    """SmolLM2-135M has 9 query / 3 kv heads: 2 ranks cannot split it (a clear error), 3 can."""
    from pagedserve.engine.llm import LLM

    with pytest.raises(ExecutorError, match="not divisible by the tensor-parallel size"):
        LLM(dtype="float32", tensor_parallel_size=2, executor="mp", kv_cache_memory=0.25)
    single = LLM(dtype="float32", executor="inproc", kv_cache_memory=0.25)
    try:
        ref = single.generate(DEFAULT_PROMPTS, DEFAULT_GREEDY, use_tqdm=False)
    finally:
        single.shutdown()
    assert ref[0].outputs[0].text.startswith(" Paris.")
    tp = LLM(dtype="float32", tensor_parallel_size=3, executor="mp", kv_cache_memory=0.25)
    try:
        out = tp.generate(DEFAULT_PROMPTS, DEFAULT_GREEDY, use_tqdm=False)
    finally:
        shutdown_clean(tp)
    assert token_ids(out) == token_ids(ref)
