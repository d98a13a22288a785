"""pagedserve:event_loop_lag_seconds: how late the event loop wakes a sleeping task (issue 22):
anything synchronous on the loop (a route, the engine step) shows up there."""
from __future__ import annotations

import asyncio
import time

import httpx

from pagedserve.app.server import build_app
from tests.app.fake_engine import FakeAsyncEngine
from tests.app.test_auth_metrics import samples

LAG = "pagedserve:event_loop_lag_seconds"
LAG_MAX = "pagedserve:event_loop_lag_max_seconds"


def _value(text: str, name: str) -> float:
    [v] = [v for (n, _), v in samples(text).items() if n == name]
    return v


async def test_the_gauge_is_in_metrics_and_reacts_to_a_block():
    app = build_app(FakeAsyncEngine(), served_model_name="fake-model")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        first = (await c.get("/metrics")).text  # the first request starts the monitor
        assert LAG in first and LAG_MAX in first
        await asyncio.sleep(0.3)  # a few ticks of an idle loop
        idle = _value((await c.get("/metrics")).text, LAG)
        assert 0 <= idle < 0.25
        time.sleep(0.6)  # noqa: ASYNC251 - the deliberate block
        await asyncio.sleep(0.2)  # the monitor wakes (late) and records it
        text = (await c.get("/metrics")).text
        assert _value(text, LAG) >= 0.4
        assert _value(text, LAG_MAX) >= 0.4
        app.state.metrics.loop_lag.stop()


async def test_a_block_in_progress_is_seen_by_the_scrape_that_waited_for_it():
    """The scrape queued behind a block may run before the monitor's own wake-up: the gauge still
    counts how overdue that wake-up is."""
    app = build_app(FakeAsyncEngine(), served_model_name="fake-model")
    monitor = app.state.metrics.loop_lag
    monitor.start()
    await asyncio.sleep(0.12)
    time.sleep(0.5)  # noqa: ASYNC251
    assert monitor.current() >= 0.35  # read before the monitor task got to run again
    monitor.stop()
