"""The workloads' prompts have the requested token lengths under the default model's tokenizer."""
from __future__ import annotations

import random

import pytest

from pagedserve.loadtest import workloads

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def smollm_tokenizer():
    from pagedserve.contracts.config import ConfigError, default_model_path

    try:
        path = default_model_path()
    except ConfigError as e:
        pytest.skip(str(e))
    # transformers reads the GGUF's tokenizer: used as a local tokenizer through the adapter.
    return workloads.LocalTokenizer(path)


@pytest.mark.parametrize("length", [1, 3, 17, 128, 256, 1024])
def test_random_prompts_tokenize_to_requested_length(smollm_tokenizer, length):
    reqs = workloads.random_requests(smollm_tokenizer, 12, length, 32, seed=length)
    assert len(reqs) == 12
    for r in reqs:
        n = len(smollm_tokenizer.encode(r.prompt))
        assert abs(n - length) <= 1, (length, n, r.prompt[:80])
        assert r.prompt_len == n and r.output_len == 32
    assert len({r.prompt for r in reqs}) == 12  # random, not one prompt repeated


def test_range_ratio_and_seed(smollm_tokenizer):
    reqs = workloads.random_requests(smollm_tokenizer, 40, 100, 50, range_ratio=0.5, seed=3)
    for r in reqs:
        assert abs(len(smollm_tokenizer.encode(r.prompt)) - r.prompt_len) <= 1
        assert 49 <= r.prompt_len <= 151 and 25 <= r.output_len <= 75
    assert len({r.prompt_len for r in reqs}) > 10
    again = workloads.random_requests(smollm_tokenizer, 40, 100, 50, range_ratio=0.5, seed=3)
    assert [r.prompt for r in again] == [r.prompt for r in reqs]


def test_prefix_workload_shares_a_long_prefix(smollm_tokenizer):
    reqs = workloads.prefix_requests(smollm_tokenizer, 6, 300, 20, 16, seed=2)
    prefix = reqs[0].system_prompt
    assert all(r.system_prompt == prefix for r in reqs)
    assert abs(len(smollm_tokenizer.encode(prefix)) - 300) <= 1
    for r in reqs:
        assert len(smollm_tokenizer.encode(r.completion_prompt())) == r.prompt_len
        assert abs(r.prompt_len - (300 + 20 + 1)) <= 2  # prefix + "\n" + suffix
        assert [m["role"] for m in r.chat_messages()] == ["system", "user"]


def test_make_prompt_is_exact_for_the_approximate_tokenizer():
    tok = workloads.ApproxTokenizer()
    pool = workloads._token_pool(tok)
    text, n = workloads.make_prompt(tok, pool, 50, random.Random(0))
    assert n == 50 and len(text.split()) == 50


def test_sharegpt_dataset(tmp_path):
    import json

    conv = lambda q, a: {"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]}  # noqa: E731
    data = [conv("tell me a story about a river", "once upon a time there was a river"),
            conv("hi", "hello there my friend"),  # prompt too short: dropped
            conv("what is the best way to learn", "practice every day with care and patience")]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(data))
    reqs = workloads.build_requests("sharegpt", workloads.ApproxTokenizer(), 5, dataset_path=str(path))
    assert sorted(r.prompt_len for r in reqs) == [7, 7]
    assert sorted(r.output_len for r in reqs) == [7, 8]
    with pytest.raises(ValueError, match="dataset-path"):
        workloads.build_requests("sharegpt", workloads.ApproxTokenizer(), 5)
