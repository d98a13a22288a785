"""AsyncEngine.shutdown and dropped streams (review of issue 10): the engine loop must stop when
shutdown cancels it, whatever it was waiting for, and a stream dropped without being closed must
not leave its queue behind (shutdown would wait its whole timeout for a request that can never
finish)."""
from __future__ import annotations

import asyncio
import gc

import pytest

from pagedserve.engine.errors import EngineDeadError
from pagedserve.engine.sampling_params import SamplingParams
from tests.engine.fake_async import patch_build_engine, started_engine
from tests.engine.fakes import FakeTokenizer

PROMPT = FakeTokenizer().encode("stop me")
HANG_GUARD_S = 10.0  # a bound on a hang, not a speed test: shutdown needs milliseconds here


@pytest.fixture
def fake_parts(monkeypatch):
    return patch_build_engine(monkeypatch)


async def until_idle(engine) -> None:
    for _ in range(500):
        if not engine.core.has_unfinished():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the engine did not finish its requests")


async def stop(engine) -> bool:
    """Run shutdown; True if it returned (False: it hung; the loop task is cancelled again so
    the test can end)."""
    stopping = asyncio.ensure_future(engine.shutdown())
    done, _ = await asyncio.wait({stopping}, timeout=HANG_GUARD_S)
    if stopping not in done:
        engine._task.cancel()
        await asyncio.wait({stopping}, timeout=HANG_GUARD_S)
    return stopping in done


async def test_shutdown_stops_an_idle_loop_while_a_finished_output_is_unread(fake_parts):
    """The request finished in the engine; its last output waits for a reader that has not come.
    shutdown wakes the idle loop (aborting the request) and cancels it in the same tick: the
    loop must stop, not swallow the cancellation and wait for work for ever."""
    engine = await started_engine()
    stream = engine.generate(PROMPT, SamplingParams(max_tokens=4, temperature=0.0), "unread")
    await until_idle(engine)
    assert await stop(engine), "shutdown hung: the engine loop did not stop when cancelled"
    assert engine._task.done() and engine.health_status() == "dead"
    outs = [o async for o in stream]  # the tokens produced before shutdown are still delivered
    assert outs and outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 4


async def test_a_dropped_stream_does_not_leave_its_queue_behind(fake_parts):
    """A stream garbage-collected unread aborts its request; its queue must go with it, or
    shutdown waits its whole timeout for a request nobody can finish."""
    engine = await started_engine()
    try:
        stream = engine.generate(PROMPT, SamplingParams(max_tokens=200, temperature=0.0), "dropped")
        del stream
        gc.collect()
        engine._wake.set()  # what any other request would do; the abort is handled at once
        await until_idle(engine)
        await asyncio.sleep(0)
        assert "dropped" not in engine._queues
        # The id can be used again once the dropped request is gone.
        again = engine.generate(PROMPT, SamplingParams(max_tokens=2, temperature=0.0), "dropped")
        outs = [o async for o in again]
        assert outs[-1].finished
    finally:
        await stop(engine)
