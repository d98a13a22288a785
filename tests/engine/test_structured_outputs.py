"""Structured outputs and token masks through the engine, with a tiny random model (real
tokenizer): sampled outputs always fit their schema / choice / regex, free requests in the same
batch are unaffected, a compiling grammar never holds up the others' steps, preemption keeps
the matchers right, and allowed_token_ids / bad_words hold."""
from __future__ import annotations

import json
import re
import threading

import jsonschema
import pytest

from pagedserve.engine.errors import RequestRejectedError
from pagedserve.engine.sampling_params import SamplingParams, StructuredOutputsParams
from tests.tiny import tiny_llm

# Bounded, so a random model always completes it well within max_tokens.
SCHEMA = {
    "type": "object",
    "properties": {
        "label": {"type": "string", "enum": ["positive", "negative", "neutral"]},
        "score": {"type": "integer", "minimum": 0, "maximum": 100},
        "ok": {"type": "boolean"},
        "tag": {"type": "string", "pattern": "^[a-z]{1,6}$"},
    },
    "required": ["label", "score", "ok", "tag"],
    "additionalProperties": False,
}
PROMPT = [1, 504, 2000, 30, 77]


@pytest.fixture(scope="module")
def llm():
    llm = tiny_llm()
    yield llm
    llm.shutdown()


def _texts(outs):
    return [(c.text, c.finish_reason) for o in outs for c in o.outputs]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sampled_json_always_validates(llm, seed):
    p = SamplingParams(n=4, temperature=1.0, seed=seed, max_tokens=120,
                       structured_outputs=StructuredOutputsParams(json=SCHEMA))
    outs = llm.generate([PROMPT], p, use_tqdm=False)
    for text, finish in _texts(outs):
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)


def test_json_with_top_p_top_k_penalties_and_logprobs(llm):
    p = SamplingParams(n=3, temperature=1.5, top_p=0.9, top_k=50, min_p=0.01, repetition_penalty=1.2,
                       presence_penalty=0.5, frequency_penalty=0.3, logprobs=3, seed=5, max_tokens=120,
                       structured_outputs=StructuredOutputsParams(json=json.dumps(SCHEMA)))
    outs = llm.generate([PROMPT], p, use_tqdm=False)
    for c in outs[0].outputs:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.text), SCHEMA)
        assert len(c.logprobs) == len(c.token_ids)


@pytest.mark.parametrize("seed", [3, 4])
def test_choice_and_regex_always_match(llm, seed):
    choices = ["red", "green", "blue sky", "naïve \"quoted\""]
    regex = r"[a-c]{2,5}@(x|y)\.com"
    ps = [SamplingParams(n=4, temperature=1.0, seed=seed, max_tokens=40,
                         structured_outputs=StructuredOutputsParams(choice=choices)),
          SamplingParams(n=4, temperature=1.0, seed=seed, max_tokens=40,
                         structured_outputs=StructuredOutputsParams(regex=regex))]
    outs = llm.generate([PROMPT, PROMPT], ps, use_tqdm=False)
    for c in outs[0].outputs:
        assert c.text in choices and c.finish_reason == "stop"
    for c in outs[1].outputs:
        assert re.fullmatch(regex, c.text) and c.finish_reason == "stop", c.text


def test_grammar_end_stops_even_with_ignore_eos(llm):
    p = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True,
                       structured_outputs=StructuredOutputsParams(grammar='root ::= "yes" | "no"'))
    out = llm.generate([PROMPT], p, use_tqdm=False)[0].outputs[0]
    assert out.text in ("yes", "no") and out.finish_reason == "stop"
    assert len(out.token_ids) < 50


def test_free_requests_get_the_same_greedy_tokens_beside_constrained_ones(llm):
    free = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [[1, 50 + i, 900 + 3 * i, 7] for i in range(4)]
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, free, use_tqdm=False)]
    constrained = SamplingParams(temperature=1.0, seed=1, max_tokens=60,
                                 structured_outputs=StructuredOutputsParams(json=SCHEMA))
    mixed = llm.generate(prompts + [PROMPT, PROMPT], [free] * 4 + [constrained] * 2, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:4]] == alone
    for o in mixed[4:]:
        jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)


def test_preemption_keeps_matchers_right():
    """A KV cache so small that sequences are preempted and recomputed: seeded constrained
    outputs equal the unpreempted run's and still validate."""
    p = SamplingParams(n=6, temperature=1.0, seed=11, max_tokens=60,
                       structured_outputs=StructuredOutputsParams(json=SCHEMA))
    big = tiny_llm()
    try:
        ref = [c.token_ids for c in big.generate([PROMPT], p, use_tqdm=False)[0].outputs]
    finally:
        big.shutdown()
    small = tiny_llm(num_gpu_blocks_override=10, block_size=8, enable_prefix_caching=False)
    try:
        outs = small.generate([PROMPT], p, use_tqdm=False)
        assert small.core.stats().num_preemptions > 0
    finally:
        small.shutdown()
    assert [c.token_ids for c in outs[0].outputs] == ref
    for c in outs[0].outputs:
        jsonschema.validate(json.loads(c.text), SCHEMA)


def test_compiling_grammar_does_not_hold_up_a_running_stream(llm):
    core = llm.core
    backend = core.constraints.manager.backend
    release = threading.Event()
    real_compile = backend.compile

    def slow_compile(grammar):
        assert release.wait(30)
        return real_compile(grammar)

    backend.compile = slow_compile
    try:
        core.add_request("free", None, [1, 2, 3, 4], SamplingParams(temperature=0, max_tokens=30,
                                                                     ignore_eos=True))
        counts = {"free": 0, "json": 0}

        def step():
            for out in core.step():
                counts[out.request_id] += len(out.outputs[0].token_ids)

        step()
        assert counts["free"] == 1
        # A grammar no other test compiled (the compile cache is per spec).
        spec = StructuredOutputsParams(regex=r"(ab|cd){3}")
        core.add_request("json", None, [1, 5, 6], SamplingParams(temperature=0, max_tokens=20,
                                                                  structured_outputs=spec))
        assert core.stats().num_waiting == 1
        for k in range(5):  # one token per step for the running stream while the grammar compiles
            step()
            assert counts == {"free": 2 + k, "json": 0}
        release.set()
        core.constraints.manager.compiled(spec).result(timeout=30)
        step()  # admitted now: its prompt is computed and it samples in this very step
        assert counts["free"] == 7 and counts["json"] == 1
        while core.has_unfinished():
            step()
        assert counts["free"] == 30
    finally:
        backend.compile = real_compile
        release.set()


@pytest.mark.parametrize("spec, fragment", [
    (StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "strin"}}}), "strin"),
    (StructuredOutputsParams(json={"type": "array", "uniqueItems": True}), "uniqueItems"),
    (StructuredOutputsParams(json={"not": {"type": "string"}}), "'not'"),
    (StructuredOutputsParams(regex="a(b"), "regex"),
    (StructuredOutputsParams(grammar="root ::= undefined_rule"), "undefined_rule"),
])
def test_bad_spec_is_rejected_with_the_reason(llm, spec, fragment):
    with pytest.raises(RequestRejectedError, match=re.escape(fragment)):
        llm.core.add_request("bad", None, PROMPT, SamplingParams(structured_outputs=spec))
    assert not llm.core.has_unfinished()


def test_allowed_token_ids(llm):
    allowed = [300, 301, 302, 9000]
    p = SamplingParams(n=3, temperature=1.0, seed=2, max_tokens=24, ignore_eos=True,
                       allowed_token_ids=allowed)
    for c in llm.generate([PROMPT], p, use_tqdm=False)[0].outputs:
        assert set(c.token_ids) <= set(allowed) and len(c.token_ids) == 24
    with pytest.raises(RequestRejectedError, match="past the vocabulary"):
        llm.core.add_request("x", None, PROMPT, SamplingParams(allowed_token_ids=[10**9]))


def test_bad_words(llm):
    tok = llm.tokenizer
    two = tok.encode(" hello world", add_special_tokens=False)
    one = tok.encode(" the", add_special_tokens=False)
    assert len(two) == 2 and len(one) == 1
    allowed = sorted(set(two + one + [300]))
    free = SamplingParams(n=4, temperature=1.0, seed=8, max_tokens=40, ignore_eos=True,
                          allowed_token_ids=allowed)
    banned = SamplingParams(n=4, temperature=1.0, seed=8, max_tokens=40, ignore_eos=True,
                            allowed_token_ids=allowed, bad_words=["hello world", "the"])

    def pairs(ids):
        return sum(1 for a, b in zip(ids, ids[1:]) if [a, b] == two)

    free_out = [c.token_ids for c in llm.generate([PROMPT], free, use_tqdm=False)[0].outputs]
    assert sum(pairs(ids) for ids in free_out) > 0 and any(one[0] in ids for ids in free_out)
    for c in llm.generate([PROMPT], banned, use_tqdm=False)[0].outputs:
        assert pairs(c.token_ids) == 0 and one[0] not in c.token_ids
        assert two[0] in c.token_ids  # the first token alone is still allowed


def test_multiprocess_executor_gives_the_inprocess_outputs(llm):
    """The bitmask travels to worker processes in the StepInput: same seeded tokens as in-process."""
    ps = [SamplingParams(n=3, temperature=1.0, seed=21, max_tokens=80,
                         structured_outputs=StructuredOutputsParams(json=SCHEMA)),
          SamplingParams(n=2, temperature=1.0, seed=22, max_tokens=20, ignore_eos=True,
                         allowed_token_ids=[300, 301, 9000], bad_words=["hello"])]
    ref = [[c.token_ids for c in o.outputs] for o in llm.generate([PROMPT, PROMPT], ps, use_tqdm=False)]
    mp = tiny_llm(executor="mp")
    try:
        outs = mp.generate([PROMPT, PROMPT], ps, use_tqdm=False)
    finally:
        mp.shutdown()
    assert [[c.token_ids for c in o.outputs] for o in outs] == ref
    for c in outs[0].outputs:
        jsonschema.validate(json.loads(c.text), SCHEMA)


def test_a_compile_failure_fails_only_that_request(llm):
    from pagedserve.engine.structured_output import GrammarError

    backend = llm.core.constraints.manager.backend
    real_compile = backend.compile

    def failing(grammar):
        raise GrammarError("the grammar cannot be compiled: boom")

    backend.compile = failing
    try:
        spec = StructuredOutputsParams(regex=r"(x|y){2,4}z")  # not compiled by any other test
        free = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
        outs = llm.generate([PROMPT, PROMPT], [SamplingParams(max_tokens=5, structured_outputs=spec), free],
                            use_tqdm=False)
    finally:
        backend.compile = real_compile
    assert outs[0].outputs[0].finish_reason == "error" and "boom" in outs[0].error
    assert outs[1].outputs[0].finish_reason == "length" and len(outs[1].outputs[0].token_ids) == 5
    assert not llm.core.has_unfinished()
