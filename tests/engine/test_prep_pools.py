"""Per-request preparation in bounded pools with deadlines (issue 22 item 6): tokenizing, chat
templates and grammars each have their own threads; one slow or stuck request fails alone, in
time, with a 400 naming the limit, and never starves the others."""
from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

from pagedserve.engine.errors import EngineOverloadedError, RequestRejectedError
from pagedserve.engine.prep_pools import DeadlinePool, PrepBusyError, PrepDeadlineError
from pagedserve.engine.sampling_params import SamplingParams, StructuredOutputsParams
from tests.engine.fake_async import fake_engine  # noqa: F401 (a fixture)
from tests.engine.fakes import FakeTokenizer

# ---- the pool ----------------------------------------------------------------------------------


def _pool(timeout=0.3, workers=1, **kw) -> DeadlinePool:
    return DeadlinePool("test", workers, timeout, what="testing", flag="--test-timeout", **kw)


async def test_a_stuck_task_fails_in_time_and_does_not_starve_the_next():
    pool = _pool()
    release = threading.Event()
    t0 = time.monotonic()
    with pytest.raises(PrepDeadlineError, match=r"limit of 0.3 s \(--test-timeout\)") as e:
        await pool.run(release.wait, 60, param="prompt")
    assert isinstance(e.value, RequestRejectedError) and e.value.param == "prompt"  # a 400
    assert time.monotonic() - t0 < 5  # generous: the deadline is 0.3 s
    assert pool.num_abandoned == 1
    # one worker, and it is stuck: a fresh thread serves the next task anyway
    assert await pool.run(lambda: threading.current_thread().name) == "pagedserve-test"
    release.set()
    for _ in range(100):
        if pool.num_abandoned == 0:
            break
        await asyncio.sleep(0.02)
    assert pool.num_abandoned == 0  # the stuck thread ended and was counted back
    pool.shutdown()


async def test_a_full_queue_refuses_at_once_with_a_503():
    pool = _pool(timeout=None, max_queued=2)
    release = threading.Event()
    running = asyncio.ensure_future(pool.run(release.wait, 60))
    await asyncio.sleep(0.05)
    queued = [asyncio.ensure_future(pool.run(lambda: 1)) for _ in range(2)]
    await asyncio.sleep(0.05)
    with pytest.raises(PrepBusyError) as e:
        await pool.run(lambda: 1)
    assert isinstance(e.value, EngineOverloadedError) and "already waiting" in str(e.value)
    release.set()
    assert await running and await asyncio.gather(*queued) == [1, 1]
    pool.shutdown()


async def test_work_that_never_started_is_cancelled_not_run():
    pool = _pool(timeout=0.2, max_abandoned=0)  # no replacement thread for a stuck one
    release = threading.Event()
    ran = []
    stuck = asyncio.ensure_future(pool.run(release.wait, 60))
    await asyncio.sleep(0.05)
    with pytest.raises(PrepBusyError, match="no thread was free"):
        await pool.run(ran.append, 1)
    with pytest.raises(PrepDeadlineError):
        await stuck
    release.set()
    await asyncio.sleep(0.1)
    assert ran == []
    pool.shutdown()


# ---- the engine's pools -----------------------------------------------------------------------


@pytest.fixture
def engine(fake_engine):
    return fake_engine


async def test_a_stuck_chat_template_does_not_hold_the_tokenizer(engine, monkeypatch):
    engine._template_pool.timeout_s = 0.3
    release = threading.Event()
    tok = engine.tokenizer

    def render(messages, **kw):
        release.wait(60)
        return "x"

    monkeypatch.setattr(tok, "apply_chat_template", render, raising=False)
    stuck = [asyncio.ensure_future(engine.render_chat([{"role": "user", "content": "hi"}]))
             for _ in range(4)]
    await asyncio.sleep(0.05)
    # every template thread is busy, tokenizing is not held up
    assert await asyncio.wait_for(engine.encode("hello"), 2) == FakeTokenizer().encode("hello")
    for s in stuck:
        with pytest.raises((PrepDeadlineError, PrepBusyError)) as e:
            await asyncio.wait_for(s, 5)
        assert "--chat-template-timeout" in str(e.value) or "retry" in str(e.value)
    release.set()


NESTED = ("{% for a in range(100000) %}{% for b in range(100000) %}{{ a }}{% endfor %}{% endfor %}"
          "{% for m in messages %}{{ m.content }}{% endfor %}")


async def test_a_requests_own_template_with_nested_loops_is_stopped_at_its_deadline(monkeypatch):
    """A real jinja render (the sandbox cannot be cancelled): the request fails by the deadline,
    and its thread is freed too, not left looping."""
    from pagedserve.engine.async_engine import AsyncEngine
    from pagedserve.engine.tokenizer import Tokenizer
    from pagedserve.contracts.config import EngineConfig, default_model_path

    engine = AsyncEngine(EngineConfig.from_options(chat_template_timeout=0.5))
    engine.tokenizer = Tokenizer.from_model(default_model_path())
    t0 = time.monotonic()
    with pytest.raises(PrepDeadlineError, match="--chat-template-timeout") as e:
        await engine.render_chat([{"role": "user", "content": "hi"}], chat_template=NESTED)
    assert e.value.param == "chat_template"
    assert time.monotonic() - t0 < 10
    for _ in range(100):  # the line tracer stops the loop soon after the deadline
        if engine._template_pool.num_abandoned == 0:
            break
        await asyncio.sleep(0.05)
    assert engine._template_pool.num_abandoned == 0
    # the model's template still renders (and a request's simple one too)
    assert "hi" in await engine.render_chat([{"role": "user", "content": "hi"}])
    assert await engine.render_chat([{"role": "user", "content": "yo"}],
                                    chat_template="{% for m in messages %}{{ m.content }}{% endfor %}") == "yo"
    engine._template_pool.shutdown()
    engine._tokenizer_pool.shutdown()


async def test_token_strings_are_converted_off_the_loop(engine, monkeypatch):
    threads = []
    tok = engine.tokenizer

    def convert(ids):
        threads.append(threading.current_thread().name)
        return [str(i) for i in ids]

    monkeypatch.setattr(tok, "convert_ids_to_tokens", convert, raising=False)
    assert await engine.convert_ids_to_tokens([1, 2]) == ["1", "2"]
    assert threads == ["pagedserve-tokenizer"]


# ---- grammars ---------------------------------------------------------------------------------


def test_the_spec_key_is_serialised_once(monkeypatch):
    import pagedserve.engine.sampling_params as sp
    spec = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "string"}}})
    calls = []
    real = sp.json.dumps
    monkeypatch.setattr(sp.json, "dumps", lambda *a, **k: calls.append(1) or real(*a, **k))
    keys = {spec.key for _ in range(5)}
    assert len(keys) == 1 and len(calls) == 1


SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


@pytest.fixture
async def grammar_engine(monkeypatch):
    """A real tiny-model engine (xgrammar needs the real tokenizer), its compiles slowed at will."""
    from pagedserve.engine.async_engine import AsyncEngine
    from pagedserve.contracts.config import EngineConfig, default_model_path
    from tests.tiny import TINY_CONFIG

    config = EngineConfig.from_options(model=default_model_path(), load_format="dummy",
                                       hf_config=TINY_CONFIG, dtype="float32",
                                       kv_cache_memory=1 / 16, executor="inproc",
                                       grammar_compile_timeout=1.0)
    eng = AsyncEngine(config)
    await eng.start()
    yield eng
    await eng.shutdown()


def _json(schema) -> SamplingParams:
    return SamplingParams(max_tokens=8, temperature=0,
                          structured_outputs=StructuredOutputsParams(json=schema))


async def test_a_compile_past_its_deadline_is_a_400_and_starves_no_other(grammar_engine):
    eng = grammar_engine
    manager = eng.core.constraints.manager
    backend = manager.backend
    real = backend.compile
    release = threading.Event()
    slow_grammars = []

    def compile_(grammar):
        if "slow" in str(grammar):
            slow_grammars.append(grammar)
            release.wait(60)
        return real(grammar)

    backend.compile = compile_
    slow = {"type": "object", "properties": {"slow": {"type": "integer"}}, "required": ["slow"]}
    try:
        t0 = time.monotonic()
        results = await asyncio.gather(*(eng.check_constraint(_json(slow)) for _ in range(3)),
                                       return_exceptions=True)
        assert time.monotonic() - t0 < 10  # generous: the limit is 1 s
        for r in results:
            assert isinstance(r, PrepDeadlineError), r
            assert "--grammar-compile-timeout" in str(r) and "1 s" in str(r)
            assert r.code == "grammar_compile_timeout"
        assert len(slow_grammars) == 1  # identical specs share one compile
        # another compile gets a thread although the stuck one runs on
        await asyncio.wait_for(eng.check_constraint(_json(SCHEMA)), 10)
        # a request added without the check waits in the core, and fails at the deadline
        other = {"type": "object", "properties": {"slow_too": {"type": "string"}}}
        stream = eng.generate([1, 2, 3], _json(other), "waits")
        deltas = []
        async with asyncio.timeout(10):
            async for d in stream:
                deltas.append(d)
        assert deltas[-1].outputs[0].finish_reason == "error" and deltas[-1].error_from_request
        assert "--grammar-compile-timeout" in deltas[-1].error
        assert deltas[-1].error_code == "grammar_compile_timeout"  # not "constraints unsatisfiable"
        assert eng.health_status() == "ok"
    finally:
        release.set()
        backend.compile = real
