"""A step msgpack cannot encode (an integer past 64 bits in a request's settings) must fail
the requests in that step, never the engine loop: other tenants go on being served."""
from __future__ import annotations

import asyncio

import pytest

from pagedserve.engine.sampling_params import SamplingParams
from tests.engine.fake_async import patch_build_engine, started_engine
from tests.engine.fakes import FakeTokenizer

PROMPT = FakeTokenizer().encode("hello")


async def _collect(stream) -> list:
    return [d async for d in stream]


async def test_the_engine_lives_after_a_step_that_cannot_be_encoded(monkeypatch):
    patch_build_engine(monkeypatch)
    engine = await started_engine()
    try:
        bad_params = SamplingParams(max_tokens=5)
        bad_params.stop_token_ids = [2**64]  # changed after validation
        bad_params.top_k = 2**64
        bad = await asyncio.wait_for(_collect(engine.generate(PROMPT, bad_params, "bad")), 5)
        assert bad[-1].finished and bad[-1].outputs[0].finish_reason == "error"
        assert "cannot be encoded" in bad[-1].error
        assert engine.health_status() == "ok" and engine.num_deaths == 0
        good = await asyncio.wait_for(
            _collect(engine.generate(PROMPT, SamplingParams(max_tokens=4, ignore_eos=True), "good")), 5)
        assert good[-1].finished and sum(len(d.outputs[0].token_ids) for d in good) == 4
    finally:
        await engine.shutdown()


@pytest.mark.parametrize("value", [2**64, -(2**63) - 1])
def test_encode_step_raises_a_typed_error(value):
    from pagedserve.contracts.messages import NewSeq, SamplingOptions, StepEncodeError, StepInput
    from pagedserve.gpu.worker import encode_step

    seq = NewSeq(1, [1, 2], 2, 0, [1], SamplingOptions(seed=value))
    step = StepInput.pack(7, [seq], [1], [2], [], [], [])
    with pytest.raises(StepEncodeError, match="step 7 cannot be encoded"):
        encode_step(step)
