"""The two-call decode layer (gpu/models/fast_decode.py) against the eager layer it
replaces: same greedy tokens and near-identical logprobs, on a random tiny model and on the
default model; it runs only where it may (small batches, bf16, AVX512-BF16 CPUs)."""
from __future__ import annotations

import pytest

from engine.sampling_params import SamplingParams
from gpu.models import fast_decode
from kernels import fused, qgemm_n16
from tests.tiny import tiny_llm

pytestmark = pytest.mark.skipif(not fused.has_bf16_gemv(), reason="no AVX512-BF16 GEMV on this CPU")

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3,"]


def _run(llm, prompts, max_tokens=24):
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=3)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    return [o.outputs[0] for o in outs]


def _compare(make_llm, prompts, monkeypatch, max_tokens=24):
    calls = []
    real = fast_decode.FastDecodeLayer.forward

    def counting(self, rope, x, residual):
        out = real(self, rope, x, residual)
        calls.append((x.shape[0], out is not None))
        return out

    monkeypatch.setattr(fast_decode.FastDecodeLayer, "forward", counting)
    monkeypatch.setenv(fast_decode.ENV, "0")
    eager = _run(make_llm(), prompts, max_tokens)
    assert calls == []
    monkeypatch.setenv(fast_decode.ENV, "1")
    fast = _run(make_llm(), prompts, max_tokens)
    assert all(done for _, done in calls)  # never fell back once it took a batch
    for e, f in zip(eager, fast):
        assert f.token_ids == e.token_ids
        for le, lf in zip(e.logprobs, f.logprobs):
            for tok, entry in le.items():
                assert abs(lf[tok].logprob - entry.logprob) < 0.05
    return calls


def test_tiny_model_one_and_two_rows_match_eager_and_three_rows_stay_eager(monkeypatch):
    make = lambda: tiny_llm(dtype="bfloat16")  # noqa: E731
    calls = _compare(make, PROMPTS[:1], monkeypatch)
    assert {rows for rows, _ in calls} == {1} and len(calls) >= 2 * 23  # 2 layers x 23 decode steps
    calls = _compare(make, PROMPTS[:2], monkeypatch)
    assert {rows for rows, _ in calls} == {2}
    calls = _compare(make, PROMPTS[:3], monkeypatch)  # 3 decode rows: above max_rows, all eager
    assert calls == []


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_tiny_quantized_model_matches_eager_from_one_row_to_sixteen(monkeypatch, quantization):
    """q8_0 / q4_1 weights: the fused layer calls the VNNI kernel, and from AMX_MIN_M rows the AMX
    one where the CPU has it, exactly as the eager layer would."""
    if qgemm_n16.library() is None:
        pytest.skip("no AVX-512 VNNI quantized kernel on this CPU")
    make = lambda: tiny_llm(dtype="bfloat16", quantization=quantization)  # noqa: E731
    calls = _compare(make, PROMPTS[:1], monkeypatch)  # (the 5-token prompt too: up to 64 rows)
    assert [rows for rows, _ in calls].count(1) >= 2 * 23
    prompts = [f"{p} {i}" for i in range(4) for p in PROMPTS]  # 16 decode rows a step
    calls = _compare(make, prompts, monkeypatch, max_tokens=12)
    assert 16 in {rows for rows, _ in calls}


def test_default_model_gguf_q4_1_greedy_tokens_match_eager(monkeypatch):
    if qgemm_n16.library() is None:
        pytest.skip("no AVX-512 VNNI quantized kernel on this CPU")
    from engine.llm import LLM

    make = lambda: LLM(dtype="bfloat16", quantization="auto", kv_cache_memory_gib=0.25)  # noqa: E731
    calls = _compare(make, PROMPTS, monkeypatch, max_tokens=32)
    assert {rows for rows, _ in calls} >= {4}


def test_default_model_greedy_tokens_match_eager(monkeypatch):
    from engine.llm import LLM

    make = lambda: LLM(dtype="bfloat16", quantization="none", kv_cache_memory_gib=0.25)  # noqa: E731
    _compare(make, PROMPTS[:2], monkeypatch, max_tokens=32)


def test_not_bound_for_fp32_or_when_turned_off(monkeypatch):
    llm = tiny_llm()  # fp32
    layers = llm.parts.executor.runner.model.model.layers
    assert all(layer.fast_decode is None for layer in layers)
    monkeypatch.setenv(fast_decode.ENV, "0")
    llm = tiny_llm(dtype="bfloat16")
    assert all(layer.fast_decode is None for layer in llm.parts.executor.runner.model.model.layers)
