"""A slow reader holds at most one pending output (issue 10, fault 8): deltas merge while the
consumer lags, nothing is lost, errors come after the data, and latency metrics use the times
the engine produced the tokens, not the times a client read them."""
from __future__ import annotations

import asyncio

import pytest

from pagedserve.engine.errors import EngineDeadError
from pagedserve.engine.output_collector import OutputCollector
from pagedserve.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput, merge_delta
from pagedserve.engine.sampling_params import SamplingParams
from tests.engine.fake_async import patch_build_engine, started_engine
from tests.engine.fakes import FakeTokenizer


def delta(k: int, finished: bool = False) -> RequestOutput:
    comp = CompletionOutput(0, f"t{k} ", [100 + k], cumulative_logprob=-0.5 * (k + 1),
                            logprobs=[{100 + k: Logprob(-0.5, 1)}],
                            finish_reason="length" if finished else None, token_times=[float(k)])
    return RequestOutput("r", None, [1, 2], [None, {2: Logprob(-1.0, 1)}] if k == 0 else None,
                         [comp], finished, RequestMetrics(arrival_time=0.0))


def test_collector_merges_pending_deltas_into_one():
    c = OutputCollector()
    for k in range(50):
        c.put_nowait(delta(k, finished=k == 49))
        assert c.qsize() == 1
    assert c.num_merged == 49
    out = c.get_nowait()
    assert c.get_nowait() is None and c.qsize() == 0
    comp = out.outputs[0]
    assert comp.text == "".join(f"t{k} " for k in range(50))
    assert comp.token_ids == [100 + k for k in range(50)]
    assert [list(e) for e in comp.logprobs] == [[100 + k] for k in range(50)]
    assert comp.token_times == [float(k) for k in range(50)]
    assert comp.cumulative_logprob == -25.0  # cumulative: the newest value, not a sum of sums
    assert comp.finish_reason == "length" and out.finished
    assert out.prompt_logprobs is not None  # sent once, with the first delta, and kept


async def test_error_is_delivered_after_pending_data():
    c = OutputCollector()
    c.put_nowait(delta(0))
    c.put_nowait(delta(1))
    c.put_nowait(EngineDeadError("boom"))
    c.put_nowait(EngineDeadError("echo"))
    assert c.qsize() == 2
    first = await c.get()
    assert first.outputs[0].token_ids == [100, 101]
    err = await c.get()
    assert isinstance(err, EngineDeadError) and str(err) == "boom"
    assert c.get_nowait() is None


async def test_get_waits_for_a_put():
    c = OutputCollector()
    waiter = asyncio.ensure_future(c.get())
    await asyncio.sleep(0)
    assert not waiter.done()
    c.put_nowait(delta(3))
    assert (await asyncio.wait_for(waiter, 5)).outputs[0].token_ids == [103]


def test_merge_delta_is_linear_and_does_not_alias_the_newer_delta():
    acc = delta(0)
    newer = delta(1)
    merge_delta(acc, newer)
    acc.outputs[0].token_ids.append(999)
    assert newer.outputs[0].token_ids == [101]


# ---- AsyncEngine over the fake executor -------------------------------------------------------

@pytest.fixture
def fake_parts(monkeypatch):
    return patch_build_engine(monkeypatch)


async def test_a_consumer_that_does_not_read_holds_one_pending_output(fake_parts):
    engine = await started_engine()
    try:
        executor = fake_parts[0].executor
        pending_seen: list[int] = []
        real = executor.execute_async

        async def execute_async(step):
            pending_seen.append(max((q.qsize() for q in engine._queues.values()), default=0))
            return await real(step)

        executor.execute_async = execute_async
        params = SamplingParams(max_tokens=60, temperature=0.0, logprobs=1)
        prompt = FakeTokenizer().encode("a slow reader")
        slow = engine.generate(prompt, params, "slow")
        fast = engine.generate(prompt, params, "fast")
        fast_acc = None
        async for d in fast:  # read as produced
            fast_acc = d if fast_acc is None else merge_delta(fast_acc, d)
        for _ in range(200):  # let the engine finish the slow one too, without reading it
            if not engine.core.has_unfinished():
                break
            await asyncio.sleep(0.01)
        assert not engine.core.has_unfinished()
        collector = engine._queues["slow"]
        assert collector.qsize() == 1 and collector.num_merged >= 50
        assert len(executor.steps) >= 60 and max(pending_seen) <= 1
        outs = [d async for d in slow]
        assert len(outs) == 1 and outs[0].finished
        got, want = outs[0].outputs[0], fast_acc.outputs[0]
        assert got.token_ids == want.token_ids and len(got.token_ids) == 60
        assert got.text == want.text and got.finish_reason == want.finish_reason == "length"
        assert [list(e) for e in got.logprobs] == [list(e) for e in want.logprobs]
        assert [e[t].logprob for e, t in zip(got.logprobs, got.token_ids)] == \
               [e[t].logprob for e, t in zip(want.logprobs, want.token_ids)]
        assert got.cumulative_logprob == want.cumulative_logprob
        # One engine time per token, in production order.
        assert len(got.token_times) == 60 and got.token_times == sorted(got.token_times)
    finally:
        await engine.shutdown()


async def test_latency_metrics_use_engine_times_not_read_times(fake_parts):
    """A consumer that sleeps before and between reads must not show up as TTFT or ITL."""
    from pagedserve.app.server import build_app

    engine = await started_engine()
    try:
        app = build_app(engine, served_model_name="m")
        server, registry = app.state.server, app.state.metrics.registry
        prompt = FakeTokenizer().encode("time me")
        choices = server.fanout.make_choices("cmpl-t", [(None, prompt)], 1, {"temperature": 0.0}, [20], None)
        streams = await server.fanout.start(choices, 0)
        await asyncio.sleep(0.5)  # the client is slow to start reading ...
        n = 0
        async for c, comp, new_ids in server.fanout.run(choices, streams):
            n += len(new_ids)
            await asyncio.sleep(0.05)  # ... and slow to read on
        assert n == 20

        def value(name: str) -> float:
            return registry.get_sample_value("pagedserve:" + name, {"model_name": "m"})

        assert value("time_to_first_token_seconds_count") == 1
        assert value("inter_token_latency_seconds_count") == 19
        # The fake engine makes all 20 tokens in milliseconds; reading took over half a second.
        assert value("time_to_first_token_seconds_sum") < 0.25
        assert value("inter_token_latency_seconds_sum") < 0.25
        assert value("e2e_request_latency_seconds_sum") < 0.25
    finally:
        await engine.shutdown()
