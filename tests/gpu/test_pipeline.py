"""Pipeline parallelism changes where the layers run, not what comes out: greedy tokens with
pp=2 (and tp=2 x pp=2 on the tiny model, tp=3 x pp=2 on the default one) equal a single
process's, with chunked prefill, preemption and two steps in flight in the mix; a stage holds
only its layers (and KV for them)."""
from __future__ import annotations

import contextlib

import pytest
import torch

from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.contracts.errors import ExecutorError
from pagedserve.gpu.parallel_state import (init_pipeline_parallel, reset_pipeline_parallel, stage_layer_range)
from tests.gpu.test_mp_equivalence import UNTIED, prompts, shutdown_clean, stream_token_ids, token_ids
from tests.tiny import tiny_llm


@pytest.mark.parametrize("layers,stages", [(30, 2), (30, 4), (7, 3), (2, 2), (5, 1)])
def test_stages_cover_every_layer_once_contiguously(layers, stages):
    ranges = [stage_layer_range(layers, s, stages) for s in range(stages)]
    assert ranges[0][0] == 0 and ranges[-1][1] == layers
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    sizes = [e - s for s, e in ranges]
    assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1


def test_more_stages_than_layers_is_refused():
    with pytest.raises(ValueError, match="fewer than the 3 pipeline stages"):
        stage_layer_range(2, 0, 3)


@pytest.fixture
def stage():
    yield init_pipeline_parallel
    reset_pipeline_parallel()


@pytest.mark.parametrize("which", [0, 1])
def test_a_stage_builds_only_its_layers(stage, which):
    from pagedserve.gpu.models.loader import build_model

    cfg = {**UNTIED, "num_hidden_layers": 4}
    stage(which, 2)
    model = build_model(cfg, "cpu", "float32")
    names = {n for n, _ in model.named_parameters()}
    own, other = (range(0, 2), range(2, 4)) if which == 0 else (range(2, 4), range(0, 2))
    assert all(any(n.startswith(f"model.layers.{i}.") for n in names) for i in own)
    assert not any(n.startswith(f"model.layers.{i}.") for i in other for n in names)
    assert any(n.startswith("model.embed_tokens.") for n in names) == (which == 0)
    assert any(n.startswith(("lm_head.", "model.norm.")) for n in names) == (which == 1)
    # The loader skips the other stage's tensors instead of failing on them.
    assert model.map_weight_name(f"model.layers.{other[0]}.mlp.down_proj.weight") is None
    assert model.map_weight_name(f"model.layers.{own[0]}.mlp.down_proj.weight") is not None


def test_a_tied_head_keeps_the_embedding_on_the_last_stage(stage):
    from pagedserve.gpu.models.loader import build_model

    stage(1, 2)
    model = build_model({**UNTIED, "tie_word_embeddings": True}, "cpu", "float32")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.map_weight_name("model.embed_tokens.weight") is not None


def test_inproc_with_pipeline_parallel_is_refused():
    with pytest.raises(ExecutorError, match="pipeline_parallel_size > 1 needs executor='mp'"):
        tiny_llm(hf_config=UNTIED, pipeline_parallel_size=2, executor="inproc")


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory) -> str:
    """Saved weights: dummy ones are drawn per stage, so pp=2 would be another model."""
    from pagedserve.engine.tokenizer import Tokenizer
    from tests.gpu.test_models import save_hf_model

    path = tmp_path_factory.mktemp("tiny-llama-pp")
    save_hf_model(UNTIED, path, seed=3)
    Tokenizer.from_model()._tok.save(str(path / "tokenizer.json"))
    return str(path)


GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@contextlib.contextmanager
def one_thread():
    """The in-process reference on one torch thread, like each stage's worker here: on a busy
    2-core box two threads of one process wait on each other (200 s instead of 10 s)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def test_tp2_x_pp2_tiny_equals_single_process(tiny_checkpoint):
    from pagedserve.engine.llm import LLM

    # 64-token steps split the longer prompts (chunked prefill).
    options = {"model": tiny_checkpoint, "dtype": "float32", "kv_cache_memory": 1 / 16,
               "max_num_batched_tokens": 64}
    assert max(len(p) for p in prompts()) > 64
    single = LLM(executor="inproc", **options)
    try:
        with one_thread():
            ref = token_ids(single.generate(prompts(), GREEDY, use_tqdm=False))
    finally:
        single.shutdown()
    llm = LLM(tensor_parallel_size=2, pipeline_parallel_size=2, **options)
    try:
        assert llm.config.parallel.executor == "mp"
        assert len(llm.parts.executor.worker_pids) == 4
        assert token_ids(llm.generate(prompts(), GREEDY, use_tqdm=False)) == ref
    finally:
        shutdown_clean(llm)


LONG_PROMPTS = [
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type with an oil-based ink and a wooden press adapted from wine making.",
    "def merge_sort(items):\n    if len(items) <= 1:\n        return items\n    middle = len(items) // 2\n",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old clockmaker",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21,",
    "The capital of France is",
    "Photosynthesis is the process by which green plants use sunlight to turn water and carbon dioxide",
]
DEFAULT_GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def test_default_model_pp2_equals_pp1_with_chunked_prefill_and_preemption():
    """fp32 on the default model; 16-token steps chunk every long prompt, and 14 blocks of 16
    tokens cannot hold the six requests at once, so some are preempted and recomputed."""
    from pagedserve.engine.llm import LLM

    options = {"dtype": "float32", "num_gpu_blocks_override": 14, "block_size": 16, "max_num_batched_tokens": 16,
               "enable_prefix_caching": False}
    single = LLM(executor="inproc", **options)
    try:
        assert sum(len(single.tokenizer.encode(p)) > 16 for p in LONG_PROMPTS) >= 4
        with one_thread():
            ref = single.generate(LONG_PROMPTS, DEFAULT_GREEDY, use_tqdm=False)
        assert single.core.stats().num_preemptions > 0
    finally:
        single.shutdown()
    assert ref[4].outputs[0].text.startswith(" Paris.")
    llm = LLM(pipeline_parallel_size=2, **options)
    try:
        assert len(llm.parts.executor.worker_pids) == 2
        ex, in_flight_at_send = llm.parts.executor, []
        send = ex.submit

        def counting_submit(step):
            in_flight_at_send.append(len(llm.core._in_flight))
            send(step)
        ex.submit = counting_submit
        out = llm.generate(LONG_PROMPTS, DEFAULT_GREEDY, use_tqdm=False)
        # Two steps in flight at once (one per stage), never more.
        assert max(in_flight_at_send) == 1
        assert llm.core.stats().num_preemptions > 0
    finally:
        shutdown_clean(llm)
    assert token_ids(out) == token_ids(ref)


def test_async_engine_pp2_keeps_two_steps_in_flight_and_equals_single_process(tiny_checkpoint):
    """The server's engine loop: 16 concurrent streams over pp=2 give the offline single-process
    tokens, with a second step sent while the first is in flight."""
    import asyncio

    from pagedserve.engine.async_engine import AsyncEngine
    from pagedserve.engine.llm import LLM
    from pagedserve.contracts.config import EngineConfig

    options = {"model": tiny_checkpoint, "dtype": "float32", "kv_cache_memory": 1 / 16,
               "max_num_batched_tokens": 64}
    single = LLM(executor="inproc", **options)
    try:
        with one_thread():
            ref = token_ids(single.generate(prompts(), GREEDY, use_tqdm=False))
    finally:
        single.shutdown()

    async def run() -> tuple[list[list[int]], list[int]]:
        engine = AsyncEngine(EngineConfig.from_options(pipeline_parallel_size=2, **options))
        await engine.start()
        ex = engine.parts.executor
        counts = {"sent": 0, "collected": 0}
        in_flight_at_send: list[int] = []
        send, collect = ex.submit_async, ex.collect_async

        async def counting_submit(step):
            in_flight_at_send.append(counts["sent"] - counts["collected"])
            counts["sent"] += 1
            await send(step)

        async def counting_collect(step_id):
            out = await collect(step_id)
            counts["collected"] += 1
            return out
        ex.submit_async, ex.collect_async = counting_submit, counting_collect
        try:
            outs = await stream_token_ids(engine, prompts(), GREEDY)
        finally:
            await engine.shutdown()
        return outs, in_flight_at_send

    outs, in_flight_at_send = asyncio.run(run())
    assert outs == ref
    assert max(in_flight_at_send) == 1  # a second step sent while one was in flight, never a third


def test_default_model_tp3_x_pp2_equals_single_process_with_chunked_prefill():
    """World 6 on the default model in fp32: each of 2 stages splits its 15 layers' 9/3 heads over
    3 ranks; 16-token steps chunk the long prompts."""
    from pagedserve.engine.llm import LLM

    options = {"dtype": "float32", "kv_cache_memory": 0.25, "max_num_batched_tokens": 16,
               "enable_prefix_caching": False}
    prompts_ = LONG_PROMPTS[:3]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    single = LLM(executor="inproc", **options)
    try:
        assert all(len(single.tokenizer.encode(p)) > 16 for p in prompts_)
        with one_thread():
            ref = single.generate(prompts_, greedy, use_tqdm=False)
    finally:
        single.shutdown()
    llm = LLM(tensor_parallel_size=3, pipeline_parallel_size=2, **options)
    try:
        assert len(llm.parts.executor.worker_pids) == 6
        out = llm.generate(prompts_, greedy, use_tqdm=False)
    finally:
        shutdown_clean(llm)
    assert token_ids(out) == token_ids(ref)
