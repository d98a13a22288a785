import pytest

from pagedserve.engine.errors import SamplingParamsError
from pagedserve.engine.sampling_params import SamplingParams


@pytest.mark.parametrize("kwargs, param, fragment", [
    ({"n": 0}, "n", "[1, 128]"),
    ({"temperature": -0.1}, "temperature", ">= 0"),
    ({"temperature": float("nan")}, "temperature", "finite"),
    ({"top_p": 0.0}, "top_p", "(0, 1]"),
    ({"top_p": 1.5}, "top_p", "(0, 1]"),
    ({"top_k": -2}, "top_k", "-1 or 0"),
    ({"min_p": 1.1}, "min_p", "[0, 1]"),
    ({"presence_penalty": 2.5}, "presence_penalty", "[-2, 2]"),
    ({"frequency_penalty": -3}, "frequency_penalty", "[-2, 2]"),
    ({"repetition_penalty": 0.0}, "repetition_penalty", "> 0"),
    ({"logit_bias": {5: 101}}, "logit_bias", "[-100, 100]"),
    ({"logit_bias": {"x": 1}}, "logit_bias", "integers"),
    ({"seed": -1}, "seed", "[0, 2**63 - 1]"),
    ({"stop": ""}, "stop", "non-empty"),
    ({"stop": 5}, "stop", "string"),
    ({"stop_token_ids": [-1]}, "stop_token_ids", ">= 0"),
    ({"max_tokens": 0}, "max_tokens", ">= 1"),
    ({"min_tokens": -1}, "min_tokens", ">= 0"),
    ({"max_tokens": 4, "min_tokens": 5}, "min_tokens", "<= max_tokens (4)"),
    # no upper bound here: the engine holds logprobs to its max_logprobs (test_max_logprobs.py)
    ({"logprobs": -1}, "logprobs", ">= 0"),
    ({"prompt_logprobs": -1}, "prompt_logprobs", ">= 0"),
    ({"ignore_eos": "yes"}, "ignore_eos", "true or false"),
    ({"n": True}, "n", "integer"),
])
def test_validation_names_field_and_range(kwargs, param, fragment):
    with pytest.raises(SamplingParamsError) as ei:
        SamplingParams(**kwargs)
    assert ei.value.param == param
    assert param in str(ei.value) and fragment in str(ei.value)
    assert isinstance(ei.value, ValueError)


def test_normalisation():
    p = SamplingParams(top_k=-1, stop="END", logit_bias={"7": 5}, stop_token_ids=(9, 10), max_tokens=None)
    assert p.top_k == 0
    assert p.stop == ["END"] and p.stop_strings == ["END"]
    assert p.logit_bias == {7: 5.0}
    assert p.stop_token_ids == [9, 10]
    assert p.max_tokens is None
    assert SamplingParams(stop=["a", "a", "b"]).stop_strings == ["a", "b"]
    assert SamplingParams(temperature=0).greedy


def test_to_sampling_options_seed_and_blocked_ids():
    p = SamplingParams(seed=41, min_tokens=3, stop_token_ids=[9], temperature=0.7, top_k=5, logprobs=2,
                       prompt_logprobs=1, logit_bias={4: -100})
    o0, o2 = p.to_sampling_options(0, [2]), p.to_sampling_options(2, [2])
    assert (o0.seed, o2.seed) == (41, 43)
    assert o0.min_tokens_blocked_ids == (2, 9)
    assert o0.min_tokens == 3 and o0.top_k == 5 and o0.temperature == 0.7 and o0.logprobs == 2
    assert o0.logit_bias == {4: -100.0}
    assert o0.prompt_logprobs == 1 and o2.prompt_logprobs is None  # only the first sequence
    ign = SamplingParams(ignore_eos=True, min_tokens=2, stop_token_ids=[9]).to_sampling_options(0, [2])
    assert ign.min_tokens_blocked_ids == (9,)  # stop tokens stay blocked until min_tokens
    assert SamplingParams(stop_token_ids=[9]).to_sampling_options(0, [2]).min_tokens_blocked_ids == ()
    # unseeded: a random 63-bit seed per sequence
    seeds = {SamplingParams().to_sampling_options(i, []).seed for i in range(20)}
    assert len(seeds) == 20 and all(0 <= s < 2**63 for s in seeds)
    # seed wraps instead of overflowing 63 bits
    assert SamplingParams(seed=2**63 - 1).to_sampling_options(1).seed == 0


_PAST_INT64 = [2**63, 2**64, 10**30]


@pytest.mark.parametrize("value", _PAST_INT64)
@pytest.mark.parametrize("kwargs, param", [
    (lambda v: {"stop_token_ids": [1, v]}, "stop_token_ids"),
    (lambda v: {"logit_bias": {v: 1.0}}, "logit_bias"),
    (lambda v: {"logit_bias": {str(v): 1.0}}, "logit_bias"),  # JSON keys are strings
    (lambda v: {"top_k": v}, "top_k"),
    (lambda v: {"seed": v}, "seed"),
    (lambda v: {"max_tokens": v}, "max_tokens"),
    (lambda v: {"min_tokens": v, "max_tokens": None}, "min_tokens"),
])
def test_integers_past_int64_are_refused_naming_the_field(kwargs, param, value):
    """Every integer travels to the workers as a msgpack int64: one past it failed the encode
    of the whole step and killed the engine loop (offline API; the server's schema refuses it)."""
    with pytest.raises(SamplingParamsError, match=param) as info:
        SamplingParams(**kwargs(value))
    assert info.value.param == param and "2**63" in str(info.value)


def test_the_largest_int64_values_are_accepted():
    top = 2**63 - 1
    p = SamplingParams(stop_token_ids=[top], logit_bias={top: 1.0}, top_k=top, seed=top,
                       max_tokens=top, min_tokens=top)
    assert p.to_sampling_options(0).top_k == top


class _EqCounted(str):
    compares = 0

    def __eq__(self, other):
        _EqCounted.compares += 1
        return str.__eq__(self, other)

    __hash__ = str.__hash__


def test_stop_strings_are_deduplicated_in_linear_time_order_kept():
    """Issue 22: ``if s not in out`` compared every string with every kept one (quadratic on the
    event loop). Equal strings hash alike, so a set finds duplicates without comparing the rest."""
    stops = [_EqCounted(f"s{i}") for i in range(3000)]
    _EqCounted.compares = 0
    p = SamplingParams(stop=stops + [_EqCounted("s7"), _EqCounted("s0")])
    assert _EqCounted.compares <= 10
    assert p.stop_strings == [f"s{i}" for i in range(3000)]


def test_sibling_checks_only_what_it_changes():
    # The choices of one request share its validated lists (issue 22: validating them per choice
    # on the loop was seconds for 1,024 choices); a sibling checks the fields it changes.
    base = SamplingParams(n=1, max_tokens=8, min_tokens=2, seed=1, stop=["x"], allowed_token_ids=[3, 4],
                          prompt_logprobs=1)
    s = base.sibling(max_tokens=5, seed=9, prompt_logprobs=None)
    assert (s.max_tokens, s.seed, s.prompt_logprobs) == (5, 9, None)
    assert (base.max_tokens, base.seed, base.prompt_logprobs) == (8, 1, 1)
    assert s.stop_strings == ["x"] and s.allowed_token_ids == [3, 4] and s.min_tokens == 2
    with pytest.raises(SamplingParamsError, match="min_tokens"):
        base.sibling(max_tokens=1)
    with pytest.raises(SamplingParamsError, match="seed"):
        base.sibling(seed=-1)
    with pytest.raises(TypeError):
        base.sibling(stop=["y"])
