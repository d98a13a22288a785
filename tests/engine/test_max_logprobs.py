"""One name, ``max_logprobs`` (vLLM's), from the config dataclass to the ``--max-logprobs`` flag,
``LLM(max_logprobs=...)`` and the engine's check of a request's logprobs / prompt_logprobs. It
was hard-coded to 20 in SamplingParams, so the flag could only lower it and LLM did not take it."""
from __future__ import annotations

import argparse

import pytest

from pagedserve.engine.errors import RequestRejectedError
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.contracts.config import EngineConfig, ModelConfig
from tests.engine.fakes import FakeExecutor, FakeTokenizer, make_config


def _core(max_logprobs: int | None = None):
    from pagedserve.engine.core import EngineCore

    config = make_config()
    if max_logprobs is not None:
        config.model.max_logprobs = max_logprobs
    executor = FakeExecutor(config.cache.num_gpu_blocks_override, config.cache.block_size, lambda *a: 5)
    return EngineCore(config, executor, FakeTokenizer())


def test_the_config_field_defaults_to_vllms_20():
    assert ModelConfig().max_logprobs == 20
    assert EngineConfig.from_options(max_logprobs=50).model.max_logprobs == 50


def test_sampling_params_do_not_hard_code_the_limit():
    assert SamplingParams(logprobs=50, prompt_logprobs=40).logprobs == 50
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=-2)


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
def test_the_engine_holds_a_request_to_the_configured_limit(field):
    core = _core()
    with pytest.raises(RequestRejectedError, match=rf"{field}.*21.*20.*max_logprobs|max_logprobs.*20"):
        core.add_request("a", None, [1, 2, 3], SamplingParams(max_tokens=2, **{field: 21}))
    core.add_request("b", None, [1, 2, 3], SamplingParams(max_tokens=2, **{field: 20}))
    raised = _core(max_logprobs=50)
    raised.add_request("c", None, [1, 2, 3], SamplingParams(max_tokens=2, **{field: 50}))
    lowered = _core(max_logprobs=2)
    with pytest.raises(RequestRejectedError, match="max_logprobs"):
        lowered.add_request("d", None, [1, 2, 3], SamplingParams(max_tokens=2, **{field: 3}))
    unlimited = _core(max_logprobs=-1)  # vLLM's -1: no cap
    unlimited.add_request("e", None, [1, 2, 3], SamplingParams(max_tokens=2, **{field: 1000}))


def test_the_flag_sets_the_engine_config_and_the_admission_limit():
    from pagedserve.app import serve_cmd
    from pagedserve.app.admission import AdmissionLimits
    from pagedserve.app.engine_args import engine_config_from_args

    parser = argparse.ArgumentParser()
    serve_cmd.add_arguments(parser)
    assert [a.dest for a in parser._actions if "--max-logprobs" in a.option_strings] == ["max_logprobs"]
    assert "--max-logprobs" in parser.format_help()
    args = parser.parse_args(["--max-logprobs", "50"])
    assert engine_config_from_args(args).model.max_logprobs == 50
    assert AdmissionLimits.from_args(args).max_logprobs == 50
    args = parser.parse_args([])
    assert engine_config_from_args(args).model.max_logprobs == 20
    assert AdmissionLimits.from_args(args).max_logprobs == 20
    AdmissionLimits(max_logprobs=50)  # no longer capped at what SamplingParams hard-coded
    AdmissionLimits(max_logprobs=-1)


def test_llm_takes_max_logprobs():
    from tests.tiny import tiny_llm

    llm = tiny_llm(max_logprobs=30)
    try:
        [out] = llm.generate(["Hi"], SamplingParams(max_tokens=2, temperature=0, logprobs=25))
        assert len(out.outputs[0].logprobs[0]) >= 25
    finally:
        llm.shutdown() if hasattr(llm, "shutdown") else None
    with pytest.raises(ValueError, match="max_logprobs"):
        tiny_llm().generate(["Hi"], SamplingParams(max_tokens=2, logprobs=25))
