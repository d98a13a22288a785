"""The two-call decode layer (gpu/models/fast_decode.py) against the eager layer it
replaces: same greedy tokens and near-identical logprobs, on a random tiny model and on the
default model; it runs only where it may (small batches; bf16 on AVX512-BF16 CPUs, fp32 with
quantized weights on any CPU)."""
from __future__ import annotations

import pytest

from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.gpu.forward_context import get_forward_context
from pagedserve.gpu.models import fast_decode
from pagedserve.kernels import fused, qgemm_n16
from tests.needs import require_library
from tests.tiny import tiny_llm

needs_bf16 = pytest.mark.skipif(not fused.has_bf16_gemv(), reason="no AVX512-BF16 GEMV on this CPU")

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3,"]


def _run(llm, prompts, max_tokens=24):
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=3)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    return [o.outputs[0] for o in outs]


def _compare(make_llm, prompts, monkeypatch, max_tokens=24, mode="layer", counted=fast_decode.FastDecodeLayer,
             exact=False):
    """Greedy outputs with the fast path in ``mode`` ("layer": per-layer calls only; "1": the
    stack for decode-only steps too) against the eager model; returns the (rows, taken) of every
    call to ``counted.forward``. ``exact``: the logprobs must be equal bit for bit (fp32: the fused
    layer and the eager one run the same C pieces, SiLU included)."""
    calls = []
    real = counted.forward

    def counting(self, rope, x, residual):
        out = real(self, rope, x, residual)
        meta = get_forward_context().attn_metadata
        calls.append((x.shape[0], out is not None))
        if counted is fast_decode.FastDecodeStack:  # it takes exactly the decode-only steps it has rows for
            decode_only = meta.num_decodes == meta.num_requests == x.shape[0] <= self.max_rows
            assert (out is not None) == decode_only, meta
        return out

    monkeypatch.setattr(counted, "forward", counting)
    monkeypatch.setenv(fast_decode.ENV, "0")
    eager = _run(make_llm(), prompts, max_tokens)
    assert calls == []
    monkeypatch.setenv(fast_decode.ENV, mode)
    fast = _run(make_llm(), prompts, max_tokens)
    if counted is fast_decode.FastDecodeLayer:
        assert all(done for _, done in calls)  # never fell back once it took a batch
    for e, f in zip(eager, fast):
        assert f.token_ids == e.token_ids
        for le, lf in zip(e.logprobs, f.logprobs):
            if exact:
                assert {t: x.logprob for t, x in lf.items()} == {t: x.logprob for t, x in le.items()}
            for tok, entry in le.items():
                assert abs(lf[tok].logprob - entry.logprob) < 0.05
    return calls


@needs_bf16
def test_tiny_model_one_and_two_rows_match_eager_and_three_rows_stay_eager(monkeypatch):
    make = lambda: tiny_llm(dtype="bfloat16")  # noqa: E731
    calls = _compare(make, PROMPTS[:1], monkeypatch)
    assert {rows for rows, _ in calls} == {1} and len(calls) >= 2 * 23  # 2 layers x 23 decode steps
    calls = _compare(make, PROMPTS[:2], monkeypatch)
    assert {rows for rows, _ in calls} == {2}
    calls = _compare(make, PROMPTS[:3], monkeypatch)  # 3 decode rows: above max_rows, all eager
    assert calls == []


@needs_bf16
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


@needs_bf16
def test_default_model_gguf_q4_1_greedy_tokens_match_eager(monkeypatch):
    if qgemm_n16.library() is None:
        pytest.skip("no AVX-512 VNNI quantized kernel on this CPU")
    from pagedserve.engine.llm import LLM

    make = lambda: LLM(dtype="bfloat16", quantization="auto", kv_cache_memory=0.25)  # noqa: E731
    calls = _compare(make, PROMPTS, monkeypatch, max_tokens=32)
    assert {rows for rows, _ in calls} >= {4}


@needs_bf16
def test_default_model_greedy_tokens_match_eager(monkeypatch):
    from pagedserve.engine.llm import LLM

    make = lambda: LLM(dtype="bfloat16", quantization="none", kv_cache_memory=0.25)  # noqa: E731
    _compare(make, PROMPTS[:2], monkeypatch, max_tokens=32)


def _stack_calls(calls):
    """Rows of the steps the stack ran; it declines (None) only for steps that are not decode-only."""
    return [rows for rows, taken in calls if taken]


@needs_bf16
def test_tiny_model_decode_stack_matches_eager(monkeypatch):
    """All layers of a decode-only step in one C call: same tokens as the eager model, for one and
    for two rows; the prompt steps are declined and run layer by layer."""
    make = lambda: tiny_llm(dtype="bfloat16")  # noqa: E731
    for prompts in (PROMPTS[:1], PROMPTS[:2]):
        calls = _compare(make, prompts, monkeypatch, mode="1", counted=fast_decode.FastDecodeStack)
        assert len(_stack_calls(calls)) >= 23 and set(_stack_calls(calls)) == {len(prompts)}
        assert any(not taken for _, taken in calls)  # the prefill step


@needs_bf16
@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_tiny_quantized_model_decode_stack_matches_eager(monkeypatch, quantization):
    if qgemm_n16.library() is None:
        pytest.skip("no AVX-512 VNNI quantized kernel on this CPU")
    make = lambda: tiny_llm(dtype="bfloat16", quantization=quantization)  # noqa: E731
    prompts = [f"{p} {i}" for i in range(4) for p in PROMPTS]  # 16 decode rows a step (AMX from 10 rows)
    calls = _compare(make, prompts, monkeypatch, max_tokens=12, mode="1", counted=fast_decode.FastDecodeStack)
    assert 16 in _stack_calls(calls)


@needs_bf16
def test_default_model_decode_stack_matches_eager(monkeypatch):
    from pagedserve.engine.llm import LLM

    for quantization, prompts in (("none", PROMPTS[:1]), ("auto", PROMPTS)):
        make = lambda: LLM(dtype="bfloat16", quantization=quantization, kv_cache_memory=0.25)  # noqa: E731
        calls = _compare(make, prompts, monkeypatch, max_tokens=32, mode="1", counted=fast_decode.FastDecodeStack)
        assert len(prompts) in _stack_calls(calls)


@needs_bf16
def test_decode_stack_not_bound_in_layer_mode(monkeypatch):
    monkeypatch.setenv(fast_decode.ENV, "layer")
    body = tiny_llm(dtype="bfloat16").parts.executor.runner.model.model
    assert body.fast_stack is None and all(layer.fast_decode is not None for layer in body.layers)
    monkeypatch.setenv(fast_decode.ENV, "1")
    body = tiny_llm(dtype="bfloat16").parts.executor.runner.model.model
    assert body.fast_stack is not None


def test_not_bound_when_turned_off(monkeypatch):
    monkeypatch.setenv(fast_decode.ENV, "0")
    for options in ({}, {"quantization": "int4"}) + (({"dtype": "bfloat16"},) if fused.has_bf16_gemv() else ()):
        llm = tiny_llm(**options)
        assert all(layer.fast_decode is None for layer in llm.parts.executor.runner.model.model.layers)


def test_fp32_plain_weights_take_one_row_steps_only():
    """Plain fp32 weights: the fused layer reads the plain copy packed_linear keeps for 1-row
    batches (oneDNN's packed copy serves the rest), so the layer and stack take 1 row."""
    body = tiny_llm().parts.executor.runner.model.model
    assert all(layer.fast_decode is not None for layer in body.layers)
    assert body.fast_stack is not None and body.fast_stack.max_rows == 1


# ---- fp32 activations with q8_0 / q4_1 weights: the fused layer and stack on every CPU (AVX2 machines) ----

@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_fp32_quantized_tiny_model_layer_and_stack_match_eager(monkeypatch, quantization):
    """fp32 activations: the fused layer calls the same quantized kernels with fp32 in and out,
    for 1 row and for 16 (the row kernels' chunks of 4), per layer and as one stack call."""
    make = lambda: tiny_llm(quantization=quantization)  # noqa: E731
    calls = _compare(make, PROMPTS[:1], monkeypatch, exact=True)
    assert [rows for rows, _ in calls].count(1) >= 2 * 23
    prompts = [f"{p} {i}" for i in range(4) for p in PROMPTS]  # 16 decode rows a step
    calls = _compare(make, prompts, monkeypatch, max_tokens=12, mode="1", counted=fast_decode.FastDecodeStack,
                     exact=True)
    assert 16 in _stack_calls(calls)
    calls = _compare(make, PROMPTS[:3], monkeypatch, mode="1", counted=fast_decode.FastDecodeStack, exact=True)
    assert 3 in _stack_calls(calls)


def test_fp32_plain_tiny_model_layer_and_stack_match_eager(monkeypatch):
    make = lambda: tiny_llm()  # noqa: E731  (fz_gemv_f32 sums in another order than F.linear: close, not equal)
    calls = _compare(make, PROMPTS[:1], monkeypatch)
    assert [rows for rows, _ in calls].count(1) >= 2 * 23
    calls = _compare(make, PROMPTS[:1], monkeypatch, mode="1", counted=fast_decode.FastDecodeStack)
    assert 1 in _stack_calls(calls)
    calls = _compare(make, PROMPTS[:2], monkeypatch, mode="1", counted=fast_decode.FastDecodeStack)
    assert _stack_calls(calls) == []  # 2 rows: oneDNN's packed weights, layer by layer


def test_fp32_default_model_plain_weights_stack_greedy_tokens_match_eager(monkeypatch):
    from pagedserve.engine.llm import LLM

    make = lambda: LLM(dtype="float32", quantization="none", kv_cache_memory=0.25)  # noqa: E731
    calls = _compare(make, PROMPTS[:1], monkeypatch, max_tokens=32, mode="1", counted=fast_decode.FastDecodeStack)
    assert 1 in _stack_calls(calls)


def test_fp32_stack_over_an_fp8_kv_cache_matches_eager(monkeypatch):
    make = lambda: tiny_llm(quantization="int4", kv_cache_dtype="fp8")  # noqa: E731
    calls = _compare(make, PROMPTS[:2], monkeypatch, mode="1", counted=fast_decode.FastDecodeStack, exact=True)
    assert 2 in _stack_calls(calls)


def test_fp32_stack_over_a_bf16_kv_cache_matches_eager(monkeypatch):
    """--kv-cache-dtype bfloat16 under fp32 activations: the stack's fz_attn_in rounds the new K/V
    rows to bf16 and its attention widens them, as the eager layers' writer and kernel do."""
    make = lambda: tiny_llm(quantization="int4", kv_cache_dtype="bfloat16")  # noqa: E731
    calls = _compare(make, PROMPTS[:2], monkeypatch, mode="1", counted=fast_decode.FastDecodeStack, exact=True)
    assert 2 in _stack_calls(calls)


def test_fp32_default_model_gguf_q4_1_stack_greedy_tokens_match_eager(monkeypatch):
    """The shipped Q4_1 GGUF in fp32 (what --dtype auto picks on AVX2 CPUs): same greedy tokens."""
    from pagedserve.engine.llm import LLM

    make = lambda: LLM(dtype="float32", quantization="auto", kv_cache_memory=0.25)  # noqa: E731
    calls = _compare(make, PROMPTS, monkeypatch, max_tokens=32, mode="1", counted=fast_decode.FastDecodeStack,
                     exact=True)
    assert 4 in _stack_calls(calls)


@needs_bf16
def test_decode_stack_over_an_fp8_kv_cache_matches_eager(monkeypatch):
    """--kv-cache-dtype fp8: the stack's fz_attn_in encodes the new K/V rows and its attention
    call widens them, exactly as the eager layers' writer and kernel do (same greedy tokens), for
    one row (16 rows: the next test)."""
    make = lambda: tiny_llm(dtype="bfloat16", kv_cache_dtype="fp8")  # noqa: E731
    calls = _compare(make, PROMPTS[:1], monkeypatch, mode="1", counted=fast_decode.FastDecodeStack)
    assert 1 in _stack_calls(calls)


@needs_bf16
def test_decode_stack_of_16_rows_over_an_fp8_kv_cache_matches_eager(monkeypatch):
    """As above for 16 rows, which the stack takes with quantized (int4) weights only (the AMX
    kernel where the CPU has it): skipped, not passed, where that kernel is missing."""
    require_library(qgemm_n16.library(), "qgemm_n16", "no 16-row quantized GEMM on this CPU")
    make = lambda: tiny_llm(dtype="bfloat16", quantization="int4", kv_cache_dtype="fp8")  # noqa: E731
    prompts = [f"{p} {i}" for i in range(4) for p in PROMPTS]
    calls = _compare(make, prompts, monkeypatch, max_tokens=12, mode="1", counted=fast_decode.FastDecodeStack)
    assert 16 in _stack_calls(calls)
