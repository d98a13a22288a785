"""Multi-LoRA against transformers + peft: the same tiny random Llama and random PEFT adapters
(B != 0, several target modules, rsLoRA), fp32 greedy tokens equal and logprobs within 1e-4;
a step mixing adapters and base rows gives each row its solo result."""
from __future__ import annotations

import pytest
import torch

from pagedserve.engine.lora_request import LoRARequest
from pagedserve.engine.sampling_params import SamplingParams
from tests.lora_fixtures import peft_model, reference_greedy, save_adapter, save_base

N_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=N_TOKENS, ignore_eos=True, logprobs=5)
PROMPTS = [[1, 520, 3311, 42, 9001, 77, 1204, 5, 88, 301, 12, 4000, 17, 2, 999, 31, 8, 650, 44, 21],
           [1, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23],
           [1, 4242, 4243, 300, 12000]]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    base = save_base(root / "base")
    adapters = {
        "all": save_adapter(base, root / "a-all", r=8, alpha=16, seed=1),
        "attn-rs": save_adapter(base, root / "a-attn-rs", r=16, alpha=8, rslora=True, seed=2,
                                targets=["q_proj", "v_proj", "o_proj"]),
        "mlp": save_adapter(base, root / "a-mlp", r=4, alpha=4, seed=3, targets=["gate_proj", "down_proj", "k_proj"]),
    }
    return root, base, adapters


def _llm(root, **options):
    from pagedserve.engine.llm import LLM

    return LLM(model=str(root / "base"), dtype="float32", kv_cache_memory=1 / 16, enable_lora=True,
               max_loras=3, max_lora_rank=16, **options)


def _requests(adapters) -> dict[str, LoRARequest]:
    return {name: LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(adapters.items())}


def _check_against_reference(outs, refs):
    for out, (ref_tokens, ref_lps) in zip(outs, refs):
        c = out.outputs[0]
        assert c.token_ids == ref_tokens
        for pos, (entry, lp) in enumerate(zip(c.logprobs, ref_lps)):
            for token, got in entry.items():
                assert abs(got.logprob - float(lp[token])) < 1e-4, (pos, token, got.logprob, float(lp[token]))


@pytest.fixture(scope="module")
def references(models):
    root, base, adapters = models
    refs = {None: [reference_greedy(base, p, N_TOKENS) for p in PROMPTS]}
    for name, path in adapters.items():
        ref_model = peft_model(base, path)
        refs[name] = [reference_greedy(ref_model, p, N_TOKENS) for p in PROMPTS]
    return refs


def test_each_adapter_alone_matches_peft(models, references):
    root, _, adapters = models
    loras = _requests(adapters)
    llm = _llm(root)
    try:
        for name, lora in loras.items():
            outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=lora)
            _check_against_reference(outs, references[name])
            assert [o.outputs[0].token_ids for o in outs] != [r[0] for r in references[None]], name
        _check_against_reference(llm.generate(PROMPTS, GREEDY, use_tqdm=False), references[None])
    finally:
        llm.shutdown()


@pytest.mark.parametrize("options", [
    {},
    {"max_num_batched_tokens": 7, "max_num_seqs": 16},  # chunked prefill, chunks mixed with decodes
])
def test_mixed_batch_equals_each_alone(models, references, options):
    """3 adapters and base rows in every step (prefix caching on: equal prompts per adapter)."""
    root, _, adapters = models
    loras = _requests(adapters)
    names = [None, *loras]
    prompts, lora_list, expected = [], [], []
    for p_i, prompt in enumerate(PROMPTS):
        for name in names:
            prompts.append(prompt)
            lora_list.append(None if name is None else loras[name])
            expected.append(references[name][p_i])
    llm = _llm(root, **options)
    try:
        step_mixes = []
        execute = llm.parts.executor.execute

        def spy(step):  # which adapters' rows share a step
            if step.lora_slots_buf:
                step_mixes.append(set(step.lora_slots.tolist()))
            return execute(step)

        llm.parts.executor.execute = spy
        outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=lora_list)
        _check_against_reference(outs, expected)
        assert any(len(mix) == 4 for mix in step_mixes), step_mixes  # slots 0, 1, 2 and base (-1)
    finally:
        llm.shutdown()


def test_more_adapters_than_slots_rotate_through_them(models, references):
    root, _, adapters = models
    loras = _requests(adapters)
    from pagedserve.engine.llm import LLM

    llm = LLM(model=str(root / "base"), dtype="float32", kv_cache_memory=1 / 16, enable_lora=True,
              max_loras=1, max_cpu_loras=2, max_lora_rank=16)
    try:
        names = list(loras)
        outs = llm.generate([PROMPTS[0]] * 3, GREEDY, use_tqdm=False, lora_request=[loras[n] for n in names])
        _check_against_reference(outs, [references[n][0] for n in names])
    finally:
        llm.shutdown()


def test_tensor_parallel_2_matches_peft(models, references):
    root, _, adapters = models
    loras = _requests(adapters)
    llm = _llm(root, tensor_parallel_size=2)
    try:
        names = list(loras)
        outs = llm.generate([PROMPTS[0]] * 3 + [PROMPTS[1]], GREEDY, use_tqdm=False,
                            lora_request=[loras[n] for n in names] + [None])
        _check_against_reference(outs, [references[n][0] for n in names] + [references[None][1]])
    finally:
        llm.shutdown()


def _count_fused_lora_steps(monkeypatch):
    """Record (rows, taken) of every FastDecodeStack call made in a step with adapter rows."""
    from pagedserve.gpu.forward_context import current_lora
    from pagedserve.gpu.models import fast_decode

    calls = []
    real = fast_decode.FastDecodeStack.forward

    def counting(self, rope, x, residual):
        out = real(self, rope, x, residual)
        if current_lora() is not None:
            calls.append((x.shape[0], out is not None))
        return out

    monkeypatch.setattr(fast_decode.FastDecodeStack, "forward", counting)
    return calls


def test_lora_decode_steps_stay_on_the_fused_stack_and_match_peft(models, references, monkeypatch):
    """One stream per adapter (fp32 plain weights: the stack takes 1-row steps): every decode step
    with an adapter row runs the one-call C stack, LoRA deltas inside it, and still == peft."""
    from pagedserve.gpu.models.fast_decode import FastDecodeStack

    root, _, adapters = models
    loras = _requests(adapters)
    calls = _count_fused_lora_steps(monkeypatch)
    llm = _llm(root)
    try:
        body = llm.parts.executor.runner.model.model
        assert isinstance(body.fast_stack, FastDecodeStack)  # not wrapped to step aside for LoRA
        for name, lora in loras.items():
            outs = llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=lora)
            _check_against_reference(outs, [references[name][0]])
    finally:
        llm.shutdown()
    assert calls.count((1, True)) >= 3 * (N_TOKENS - 1) and (1, False) not in calls, calls  # (prompts: declined)


def test_mixed_adapters_in_the_fused_stack_equal_the_per_linear_path(models, monkeypatch):
    """int8 weights (the fp32 stack takes up to 64 rows): 3 adapters and base rows, 12 streams in each
    decode step, through the C stack and through the per-linear torch path
    (PAGEDSERVE_FAST_DECODE=0): same greedy tokens, logprobs within 1e-3 (the deltas sum in another
    order, and the quantized kernels round activations to int8 blocks, which spreads a last-bit
    difference: 1.2e-4 seen)."""
    from pagedserve.gpu.models import fast_decode

    root, _, adapters = models
    loras = _requests(adapters)
    prompts = [p for p in PROMPTS for _ in range(4)]
    lora_list = [None, *loras.values()] * len(PROMPTS)
    results = {}
    for mode in ("0", "1"):
        monkeypatch.setenv(fast_decode.ENV, mode)
        calls = _count_fused_lora_steps(monkeypatch)
        llm = _llm(root, quantization="int8")
        try:
            results[mode] = [o.outputs[0] for o in llm.generate(prompts, GREEDY, use_tqdm=False,
                                                                lora_request=lora_list)]
        finally:
            llm.shutdown()
        assert (12, True) in calls if mode == "1" else calls == []
    for eager, fused_ in zip(results["0"], results["1"]):
        assert fused_.token_ids == eager.token_ids
        for le, lf in zip(eager.logprobs, fused_.logprobs):
            for tok, entry in le.items():
                assert abs(lf[tok].logprob - entry.logprob) < 1e-3


def test_fused_paths_step_aside_for_lora_only_where_unsupported(models):
    """Unit check of the remaining guard (a fused path that cannot carry the adapter slots): a
    LoRA step runs the per-linear path, a base step the fused one."""
    from pagedserve.gpu.forward_context import forward_context
    from pagedserve.gpu.models.lora_layers import LoRABatch, SkipFastPathForLoRA

    class Fast:
        max_rows = 4

        def forward(self, rope, x, residual):
            return "fast"

    guard = SkipFastPathForLoRA(Fast())
    assert guard.max_rows == 4
    with forward_context(None, []):
        assert guard.forward(None, None, None) == "fast"
    with forward_context(None, [], LoRABatch(torch.ones(1, 1), 1)):
        assert guard.forward(None, None, None) is None
