"""Failures are visible in /metrics (issue 10, fault 9): aborts (the `abort` finish reason),
engine errors, 4xx by status code, overload 503s, engine deaths and worker restarts. Each test
causes the failure, then scrapes /metrics."""
from __future__ import annotations

import asyncio

import httpx
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagedserve.app.server import build_app
from tests.app.test_auth_metrics import call_and_disconnect
from tests.engine.fake_async import patch_build_engine, started_engine

CHAT = {"messages": [{"role": "user", "content": "Hi"}]}


async def scrape(client: httpx.AsyncClient) -> dict[tuple, float]:
    r = await client.get("/metrics")
    assert r.status_code == 200
    out = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            labels = {k: v for k, v in s.labels.items() if k != "model_name"}
            out[(s.name, tuple(sorted(labels.items())))] = s.value
    return out


def success(m: dict, reason: str) -> float:
    return m.get(("pagedserve:request_success_total", (("finished_reason", reason),)), 0.0)


def errors(m: dict, reason: str) -> float:
    return m.get(("pagedserve:request_errors_total", (("reason", reason),)), 0.0)


def http(m: dict, status: int) -> float:
    return m.get(("pagedserve:http_error_responses_total", (("status_code", str(status)),)), 0.0)


async def test_all_failure_series_are_exported_at_zero(client):
    m = await scrape(client)
    for reason in ("stop", "length", "abort"):
        assert success(m, reason) == 0 and ("pagedserve:request_success_total",
                                            (("finished_reason", reason),)) in m
    for reason in ("engine_error", "engine_dead", "internal_error"):
        assert ("pagedserve:request_errors_total", (("reason", reason),)) in m
    assert m[("pagedserve:request_overloaded_total", ())] == 0


async def test_stream_disconnect_counts_abort_per_sequence(app, engine):
    engine.delay = 0.01
    await call_and_disconnect(app, "/v1/chat/completions", {**CHAT, "stream": True, "n": 2},
                              after_chunks=5)
    await asyncio.sleep(0.05)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        m = await scrape(c)
    assert success(m, "abort") == 2
    assert success(m, "stop") == 0 and success(m, "length") == 0
    assert sum(errors(m, r) for r in ("engine_error", "engine_dead", "internal_error")) == 0


async def test_non_stream_disconnect_counts_abort_and_499(app, engine):
    engine.delay = 0.01
    await call_and_disconnect(app, "/v1/completions", {"prompt": "x", "max_tokens": 30},
                              after_chunks=None, after_s=0.05)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        m = await scrape(c)
    assert success(m, "abort") == 1 and success(m, "length") == 0
    assert http(m, 499) == 1


async def cancel_mid_request(app, path: str, body: dict, after_s: float) -> tuple[int, dict]:
    """Drive the ASGI app by hand and cancel its task midway, as uvicorn does to the requests still
    running when --shutdown-timeout runs out; the client stays connected. Returns what was sent."""
    sent: list[dict] = []
    body_read = False

    async def receive():
        nonlocal body_read
        if not body_read:
            body_read = True
            return {"type": "http.request", "body": orjson.dumps(body), "more_body": False}
        await asyncio.Event().wait()  # the client never leaves

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "headers": [(b"content-type", b"application/json")], "server": ("t", 80),
             "client": ("c", 1), "root_path": ""}
    task = asyncio.ensure_future(app(scope, receive, send))
    await asyncio.sleep(after_s)
    task.cancel()
    await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), 5)
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return status, orjson.loads(body)


async def test_non_stream_cut_by_shutdown_is_503_engine_dead(app, engine):
    """A non-streaming request still running when the server shuts down answers as a cut stream
    ends: 503, OpenAI format, code engine_dead (not 499: the client did not leave)."""
    engine.delay = 0.01
    status, body = await cancel_mid_request(app, "/v1/completions", {"prompt": "x", "max_tokens": 30},
                                            after_s=0.05)
    assert status == 503, body
    assert body["error"]["code"] == "engine_dead" and body["error"]["type"] == "server_error"
    assert "shutting down" in body["error"]["message"]
    assert engine.aborted == [c.request_id for c in engine.calls] and not engine.running
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        m = await scrape(c)
    assert errors(m, "engine_dead") == 1 and success(m, "abort") == 0
    assert http(m, 503) == 1 and http(m, 499) == 0


async def test_finished_requests_are_not_aborts(client):
    await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3, "n": 2})
    await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3, "stream": True})
    m = await scrape(client)
    assert success(m, "length") == 3 and success(m, "abort") == 0


async def test_engine_error_is_counted(client, engine):
    real = engine.script

    def script(call):
        outs = real(call)[:2]
        outs[1].outputs[0].finish_reason = "error"
        outs[1].finished = True
        outs[1].error = "worker crashed"
        return outs

    engine.script = script
    r = await client.post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == 500
    await client.post("/v1/completions", json={"prompt": "x", "stream": True})
    m = await scrape(client)
    assert errors(m, "engine_error") == 2
    assert http(m, 500) == 1  # the streamed one failed after its 200
    assert success(m, "stop") == 0 and success(m, "abort") == 0


async def test_engine_dead_mid_stream_is_counted(client, engine):
    engine.fail_after = 3
    r = await client.post("/v1/chat/completions", json={**CHAT, "stream": True, "n": 2})
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
    m = await scrape(client)
    assert errors(m, "engine_dead") == 2
    assert success(m, "abort") == 0


async def test_4xx_responses_by_status_code(engine):
    app = build_app(engine, served_model_name="fake-model", max_body_bytes=4096, api_key="k")
    good = {"Authorization": "Bearer k"}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        assert (await c.post("/v1/completions", json={"prompt": "x"})).status_code == 401
        assert (await c.post("/v1/completions", content=b"{nope",
                             headers={**good, "content-type": "application/json"})).status_code == 400
        assert (await c.post("/v1/completions", json={"prompt": "x", "temperature": -1},
                             headers=good)).status_code == 400
        assert (await c.post("/v1/completions", json={"prompt": "x", "model": "other"},
                             headers=good)).status_code == 404
        assert (await c.get("/v1/nothing-here", headers=good)).status_code == 404
        assert (await c.get("/v1/completions", headers=good)).status_code == 405
        assert (await c.post("/v1/completions", json={"prompt": "x" * 5000},
                             headers=good)).status_code == 413
        assert (await c.post("/v1/completions", json={"prompt": "x"}, headers=good)).status_code == 200
        m = await scrape(c)
    assert {code: http(m, code) for code in (400, 401, 404, 405, 413)} == \
           {400: 2, 401: 1, 404: 2, 405: 1, 413: 1}
    assert http(m, 200) == 0 and http(m, 500) == 0


async def test_overload_503s_are_counted_apart_from_a_dead_engine(client, engine):
    engine.overloaded = True
    for _ in range(3):
        r = await client.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 503 and r.headers["retry-after"]
    engine.overloaded = False
    engine.dead = True
    assert (await client.post("/v1/completions", json={"prompt": "x"})).status_code == 503
    engine.dead = False
    m = await scrape(client)
    assert m[("pagedserve:request_overloaded_total", ())] == 3
    assert http(m, 503) == 4


async def test_503_while_restarting_is_not_an_overload(client, engine):
    from pagedserve.engine.errors import EngineRestartingError

    def restarting(*a, **kw):
        raise EngineRestartingError("the engine is restarting its workers; retry shortly")

    engine.generate = restarting
    r = await client.post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == 503
    m = await scrape(client)
    assert m[("pagedserve:request_overloaded_total", ())] == 0 and http(m, 503) == 1


async def test_worker_restarts_come_from_engine_stats(client, engine):
    engine.stats_value.num_worker_restarts = 2
    m = await scrape(client)
    assert m[("pagedserve:worker_restarts_total", ())] == 2


async def test_engine_death_is_counted(monkeypatch):
    """The real AsyncEngine loop dies under a request: the death, and the request it failed,
    show in /metrics (which keeps answering)."""
    built = patch_build_engine(monkeypatch)
    engine = await started_engine()
    try:
        app = build_app(engine, served_model_name="m")
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            m = await scrape(c)
            assert m[("pagedserve:engine_deaths_total", ())] == 0

            async def broken(step):
                raise RuntimeError("worker 0 died (test)")

            built[0].executor.execute_async = broken
            r = await c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 5})
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
            m = await scrape(c)
        assert m[("pagedserve:engine_deaths_total", ())] == 1
        assert errors(m, "engine_dead") == 1
        assert http(m, 503) == 1
    finally:
        await engine.shutdown()


def gauges(m: dict) -> tuple[float, float, float]:
    return (m[("pagedserve:num_requests_running", ())], m[("pagedserve:num_requests_waiting", ())],
            m[("pagedserve:kv_cache_usage_perc", ())])


async def test_gauges_drop_the_requests_an_engine_death_failed(monkeypatch):
    """After the engine dies, /metrics shows no running or waiting request and no KV cache in
    use: the requests it failed are gone (they were shown as running for ever)."""
    from pagedserve.engine.errors import EngineDeadError
    from pagedserve.engine.sampling_params import SamplingParams

    built = patch_build_engine(monkeypatch)
    engine = await started_engine(max_num_seqs=1)  # one runs, the other waits
    try:
        app = build_app(engine, served_model_name="m")
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            params = SamplingParams(max_tokens=100, ignore_eos=True)
            streams = [engine.generate([5, 6, 7, 8] * 10, params, f"r{i}") for i in range(2)]
            await streams[0].__anext__()
            running, waiting, kv = gauges(await scrape(c))
            assert (running, waiting) == (1, 1) and kv > 0

            async def broken(step):
                raise RuntimeError("worker 0 died (test)")

            built[0].executor.execute_async = broken
            for st in streams:
                with pytest.raises(EngineDeadError):
                    async for _ in st:
                        pass
            assert engine.health_status() == "dead"
            assert gauges(await scrape(c)) == (0, 0, 0)
    finally:
        await engine.shutdown()


@pytest.mark.parametrize("stream", [False, True])
async def test_cancelled_before_reading_counts_abort(app, engine, stream):
    """A client gone before the first token is still an abort."""
    engine.delay = 0.5
    await call_and_disconnect(app, "/v1/completions", {"prompt": "x", "stream": stream},
                              after_chunks=None, after_s=0.01)
    await asyncio.sleep(0.05)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        m = await scrape(c)
    assert success(m, "abort") == 1
    assert engine.aborted == [engine.calls[0].request_id]
