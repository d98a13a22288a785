"""The engine loop survives a request (issue 22 item 7): an exception while one request is
prepared, or while its output is processed or delivered, fails that request only; the others
finish and the engine stays healthy. A MemoryError while admitting a request is a 503 for it."""
from __future__ import annotations

import asyncio

import pytest

from pagedserve.engine.errors import EngineError, EngineOverloadedError
from pagedserve.engine.sampling_params import SamplingParams
from tests.engine.fake_async import fake_engine  # noqa: F401 (a fixture)
from tests.engine.fakes import FakeTokenizer

PROMPT = FakeTokenizer().encode("hello there")
POISON = FakeTokenizer().encode("poison pill")


def _params(n: int = 8) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True, temperature=0)


async def _collect(stream) -> list:
    out = []
    try:
        async for d in stream:
            out.append(d)
    except EngineError as e:
        out.append(e)
    return out


def _tokens(deltas) -> int:
    return sum(len(d.outputs[0].token_ids) for d in deltas if not isinstance(d, BaseException))


@pytest.fixture
def engine(fake_engine):
    return fake_engine


async def _others_finish_and_engine_lives(engine, streams):
    got = await asyncio.wait_for(asyncio.gather(*(_collect(s) for s in streams)), 10)
    for deltas in got:
        assert deltas[-1].finished and deltas[-1].outputs[0].finish_reason == "length"
        assert _tokens(deltas) == 8
    assert engine.health_status() == "ok" and engine.num_deaths == 0
    late = await asyncio.wait_for(_collect(engine.generate(PROMPT, _params(4), "late")), 10)
    assert _tokens(late) == 4
    assert not engine.core.requests


@pytest.mark.parametrize("exc", [KeyError("boom"), RuntimeError("boom")])
async def test_a_fault_while_preparing_one_request_fails_it_alone(engine, monkeypatch, exc):
    import pagedserve.engine.core as core_mod
    real = core_mod.IncrementalDetokenizer

    def detok(tokenizer, prompt_ids, *a, **kw):
        if list(prompt_ids) == POISON:
            raise exc
        return real(tokenizer, prompt_ids, *a, **kw)

    monkeypatch.setattr(core_mod, "IncrementalDetokenizer", detok)
    others = [engine.generate(PROMPT, _params(), f"ok-{i}") for i in range(3)]
    with pytest.raises(EngineError, match="preparing the request failed"):
        engine.generate(POISON, SamplingParams(max_tokens=8, n=3), "bad")
    assert "bad" not in engine.core.requests and "bad" not in engine._queues
    await _others_finish_and_engine_lives(engine, others)


async def test_memory_error_while_admitting_is_a_503_for_that_request(engine, monkeypatch):
    import pagedserve.engine.core as core_mod
    real = core_mod.IncrementalDetokenizer

    def detok(tokenizer, prompt_ids, *a, **kw):
        if list(prompt_ids) == POISON:
            raise MemoryError()
        return real(tokenizer, prompt_ids, *a, **kw)

    monkeypatch.setattr(core_mod, "IncrementalDetokenizer", detok)
    others = [engine.generate(PROMPT, _params(), f"ok-{i}") for i in range(2)]
    with pytest.raises(EngineOverloadedError, match="not enough memory"):
        engine.generate(POISON, _params(), "bad")
    assert "bad" not in engine.core.requests
    await _others_finish_and_engine_lives(engine, others)


async def test_a_fault_while_processing_one_requests_tokens_fails_it_alone(engine, monkeypatch):
    core = engine.core
    real = type(core)._append_token
    calls = {"bad": 0}

    def append(self, seq, token_id, lp):
        if seq.request.request_id == "bad":
            calls["bad"] += 1
            if calls["bad"] == 3:  # a few tokens in: the failure comes mid-stream
                raise ValueError("a bug in this request's output processing")
        return real(self, seq, token_id, lp)

    monkeypatch.setattr(type(core), "_append_token", append)
    others = [engine.generate(PROMPT, _params(), f"ok-{i}") for i in range(3)]
    bad = engine.generate(POISON, _params(), "bad")
    deltas = await asyncio.wait_for(_collect(bad), 10)
    last = deltas[-1]
    assert last.finished and last.outputs[0].finish_reason == "error"
    assert "internal error" in last.error and not last.error_from_request
    await _others_finish_and_engine_lives(engine, others)


async def test_a_fault_while_making_one_requests_output_fails_it_alone(engine, monkeypatch):
    core = engine.core
    real = type(core)._make_output

    def make_output(self, req):
        if req.request_id == "bad":
            raise RuntimeError("a bug in this request's output")
        return real(self, req)

    monkeypatch.setattr(type(core), "_make_output", make_output)
    others = [engine.generate(PROMPT, _params(), f"ok-{i}") for i in range(2)]
    bad = engine.generate(POISON, _params(), "bad")
    deltas = await asyncio.wait_for(_collect(bad), 10)
    assert deltas[-1].finished and deltas[-1].outputs[0].finish_reason == "error"
    await _others_finish_and_engine_lives(engine, others)


async def test_a_fault_while_delivering_one_output_fails_that_stream_alone(engine, monkeypatch):
    from pagedserve.engine.output_collector import OutputCollector

    real = OutputCollector.put_nowait
    bad_queue: list = []

    def put(self, item):
        if bad_queue and self is bad_queue[0] and not isinstance(item, BaseException):
            raise RuntimeError("a bug in delivering this output")
        return real(self, item)

    monkeypatch.setattr(OutputCollector, "put_nowait", put)
    others = [engine.generate(PROMPT, _params(), f"ok-{i}") for i in range(2)]
    bad = engine.generate(POISON, _params(), "bad")
    bad_queue.append(engine._queues["bad"])
    deltas = await asyncio.wait_for(_collect(bad), 10)
    assert isinstance(deltas[-1], EngineError) and "internal error" in str(deltas[-1])
    await _others_finish_and_engine_lives(engine, others)


async def test_a_fault_in_processing_outside_any_request_fails_that_steps_requests(engine, monkeypatch):
    """A fault the core cannot pin on a request (here: in the step's bookkeeping) fails the
    requests of that step; the engine goes on and serves the next ones."""
    core = engine.core
    real = core.scheduler.step_done
    fired = []

    def step_done(scheduled):
        if not fired:
            fired.append(True)
            raise RuntimeError("a bug in the step bookkeeping")
        return real(scheduled)

    monkeypatch.setattr(core.scheduler, "step_done", step_done)
    first = await asyncio.wait_for(_collect(engine.generate(PROMPT, _params(), "first")), 10)
    assert first[-1].outputs[0].finish_reason == "error"
    assert engine.health_status() == "ok" and engine.num_deaths == 0
    again = await asyncio.wait_for(_collect(engine.generate(PROMPT, _params(4), "again")), 10)
    assert _tokens(again) == 4


async def test_a_core_that_keeps_failing_kills_the_loop(engine, monkeypatch):
    """Steps that fail for no request, again and again: the core is broken, and the loop dies
    (every request is told) rather than spinning."""
    core = engine.core

    def broken():
        raise RuntimeError("the scheduler is broken")

    monkeypatch.setattr(core, "schedule", broken)
    deaths = []
    for i in range(5):
        try:
            deltas = await asyncio.wait_for(_collect(engine.generate(PROMPT, _params(), f"r{i}")), 10)
        except EngineError as e:  # dead: refused at once
            deaths.append(e)
            break
        assert isinstance(deltas[-1], BaseException) or deltas[-1].outputs[0].finish_reason == "error"
    assert engine.health_status() == "dead" and deaths


async def test_an_executor_failure_still_kills_the_loop(engine):
    from pagedserve.contracts.errors import ExecutorError

    executor = engine.parts.executor

    async def dead(step):
        raise ExecutorError("worker 0 died")

    executor.execute_async = dead
    deltas = await asyncio.wait_for(_collect(engine.generate(PROMPT, _params(), "x")), 10)
    assert isinstance(deltas[-1], EngineError)
    await asyncio.sleep(0)
    assert engine.health_status() == "dead"
