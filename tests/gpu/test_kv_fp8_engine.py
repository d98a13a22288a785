"""--kv-cache-dtype fp8 through the engine: the cache is allocated in fp8 (half the bytes a block,
twice the blocks a budget holds), preemption by swapping round-trips fp8 blocks, the default model's
greedy tokens stay close to the bf16 cache's (threshold from loadtest/PERF.md's measurement), and
names the engine cannot serve are refused before it starts."""
from __future__ import annotations

import pytest
import torch

from pagedserve.contracts.config import ConfigError
from pagedserve.kernels.kv_cache_dtype import FP8
from tests.gpu.test_mp_equivalence import GREEDY, UNTIED, prompts, token_ids
from tests.tiny import tiny_llm


def _runner(llm):
    return llm.parts.executor.runner if hasattr(llm.parts.executor, "runner") else None


def test_fp8_cache_holds_twice_the_blocks_and_swaps_exactly():
    """Same KV budget: fp8 blocks are a quarter of the fp32 model's bytes. Swap preemption (exact byte copies) gives the
    tokens of a run without preemption, both over fp8 caches."""
    auto, fp8 = tiny_llm(), tiny_llm(kv_cache_dtype="fp8")
    try:
        assert fp8.core.block_manager.num_blocks == 4 * auto.core.block_manager.num_blocks
        runner = _runner(fp8)
        if runner is not None:
            assert all(k.dtype == FP8 and v.dtype == FP8 for k, v in runner.kv_caches)
        reference = token_ids(fp8.generate(prompts(), GREEDY, use_tqdm=False))
        assert fp8.core.stats().num_preemptions == 0
    finally:
        auto.shutdown()
        fp8.shutdown()
    assert_swap_preemption_is_exact("fp8")
    assert reference  # (the first run's tokens: the fp8 engine ran)


def assert_swap_preemption_is_exact(kv_cache_dtype: str) -> None:
    """Swap preemption (exact byte copies of the blocks) gives the tokens of a run without it."""
    llm = tiny_llm(hf_config=UNTIED, kv_cache_dtype=kv_cache_dtype, preemption_mode="swap", num_swap_blocks=64,
                   num_gpu_blocks_override=14, block_size=16)
    ref_llm = tiny_llm(hf_config=UNTIED, kv_cache_dtype=kv_cache_dtype)
    try:
        want = token_ids(ref_llm.generate(prompts(), GREEDY, use_tqdm=False))
        assert token_ids(llm.generate(prompts(), GREEDY, use_tqdm=False)) == want
        swap = llm.core.block_manager.swap
        assert llm.core.stats().num_preemptions > 0 and swap.num_swapped_out > 0
    finally:
        llm.shutdown()
        ref_llm.shutdown()


@pytest.mark.parametrize("name, message", [("fp8_e5m2", "not supported"), ("int3", "not one of")])
def test_unservable_names_are_refused_before_start(name, message):
    with pytest.raises(ConfigError, match=message):
        tiny_llm(kv_cache_dtype=name)


def test_default_model_greedy_agreement_with_the_bf16_cache():
    """16 prompts x 32 greedy tokens, bf16 model, fp8 cache against bf16 cache, position by position
    (strict: one flip changes the rest of a continuation). Measured 0.574 on the AVX-512 machine
    (the bf16 model against fp32 agrees 0.697; PERF.md); below 0.5 fails. A cache read wrongly
    agrees near 0."""
    from pagedserve.engine.llm import LLM
    from pagedserve.loadtest.micro.quant_accuracy import PROMPTS, agreement, greedy_tokens

    out = {}
    for kv in ("auto", "fp8"):
        llm = LLM(dtype="bfloat16", quantization="none", kv_cache_memory=0.25, kv_cache_dtype=kv)
        try:
            out[kv] = greedy_tokens(llm, PROMPTS, 32)
        finally:
            llm.shutdown()
    same, _ = agreement(out["auto"], out["fp8"])
    assert same >= 0.5, same
    assert torch.tensor([len(t) for t in out["fp8"]]).eq(32).all()
