"""API key, Prometheus metrics and client disconnects."""
from __future__ import annotations

import asyncio

import httpx
import orjson
from prometheus_client.parser import text_string_to_metric_families

from pagedserve.app.server import build_app
from tests.app.conftest import assert_openai_error
from tests.app.fake_engine import FakeAsyncEngine

KEY = "s3cret-key"


async def test_api_key_required_on_api_routes_only():
    engine = FakeAsyncEngine()
    app = build_app(engine, api_key=KEY)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        for method, path, body in [("POST", "/v1/completions", {"prompt": "x"}),
                                   ("POST", "/v1/chat/completions", {"messages": []}),
                                   ("GET", "/v1/models", None),
                                   ("POST", "/tokenize", {"prompt": "x"}),
                                   ("POST", "/detokenize", {"tokens": [1]})]:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                            {"Authorization": f"Basic {KEY}"}):
                r = await c.request(method, path, json=body, headers=headers)
                err = assert_openai_error(r, 401)
                assert err["code"] == "invalid_api_key" and KEY not in r.text
        assert engine.calls == []
        good = {"Authorization": f"Bearer {KEY}"}
        assert (await c.post("/v1/completions", json={"prompt": "x"}, headers=good)).status_code == 200
        assert (await c.get("/v1/models", headers=good)).status_code == 200
        for path in ("/health", "/metrics", "/version"):
            assert (await c.get(path)).status_code == 200, path


def samples(text: str) -> dict[tuple, float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


M = (("model_name", "fake-model"),)


async def test_metrics_move_by_the_right_amounts(client, engine):
    engine.stats_value.num_running = 3
    engine.stats_value.num_waiting = 2
    engine.stats_value.kv_cache_usage = 0.25
    engine.stats_value.prefix_cache_queries = 100
    engine.stats_value.prefix_cache_hits = 40
    engine.stats_value.num_preemptions = 7
    before = samples((await client.get("/metrics")).text)
    assert before[("pagedserve:num_requests_running", M)] == 3
    assert before[("pagedserve:num_requests_waiting", M)] == 2
    assert before[("pagedserve:kv_cache_usage_perc", M)] == 0.25
    assert before[("pagedserve:prefix_cache_queries_total", M)] == 100
    assert before[("pagedserve:prefix_cache_hits_total", M)] == 40
    assert before[("pagedserve:num_preemptions_total", M)] == 7
    assert before[("pagedserve:prompt_tokens_total", M)] == 0
    assert before[("pagedserve:time_to_first_token_seconds_count", M)] == 0

    # one request, two choices of 5 tokens each (length), prompt of 4 tokens
    r = await client.post("/v1/completions", json={"prompt": "abcd", "max_tokens": 5, "n": 2})
    assert r.status_code == 200
    # and one chat request that stops on its own after the whole reply
    r = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Q"}],
                                                        "stream": True})
    chat_prompt = len("<user>Q\n<assistant>")
    reply = len(engine.reply)

    after = samples((await client.get("/metrics")).text)
    assert after[("pagedserve:prompt_tokens_total", M)] == 4 + chat_prompt
    assert after[("pagedserve:generation_tokens_total", M)] == 10 + reply
    assert after[("pagedserve:request_success_total", (("finished_reason", "length"),) + M)] == 2
    assert after[("pagedserve:request_success_total", (("finished_reason", "stop"),) + M)] == 1
    for h in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds"):
        assert after[(f"pagedserve:{h}_count", M)] == 3, h
        assert after[(f"pagedserve:{h}_sum", M)] >= 0
    # one inter-token gap per token after the first
    assert after[("pagedserve:inter_token_latency_seconds_count", M)] == 2 * 4 + (reply - 1)


async def test_each_app_has_its_own_registry():
    a, b = build_app(FakeAsyncEngine(model_name="a")), build_app(FakeAsyncEngine(model_name="b"))
    assert a.state.metrics.registry is not b.state.metrics.registry
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=a), base_url="http://t") as c:
        await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert b"pagedserve:generation_tokens_total{model_name=\"b\"} 0.0" in b.state.metrics.render()
    assert b"pagedserve:generation_tokens_total{model_name=\"a\"} 2.0" in a.state.metrics.render()


async def test_metrics_survive_a_failing_engine(client, engine):
    def broken():
        raise RuntimeError("dead")

    engine.stats = broken
    r = await client.get("/metrics")
    assert r.status_code == 200
    names = {f.name for f in text_string_to_metric_families(r.text)}
    assert "pagedserve:prompt_tokens" in names and "pagedserve:num_requests_running" not in names


async def call_and_disconnect(app, path: str, body: dict, after_chunks: int | None,
                              after_s: float | None = None) -> list[bytes]:
    """Drive the ASGI app by hand: send the body, then disconnect after some chunks or some time."""
    gone = asyncio.Event()
    sent = False
    chunks: list[bytes] = []

    async def receive():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": orjson.dumps(body), "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        if message["type"] == "http.response.body" and message.get("body"):
            chunks.append(message["body"])
            if after_chunks is not None and len(chunks) >= after_chunks:
                gone.set()

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "headers": [(b"content-type", b"application/json")], "server": ("t", 80),
             "client": ("c", 1), "root_path": ""}
    if after_s is not None:
        asyncio.get_running_loop().call_later(after_s, gone.set)
    await asyncio.wait_for(app(scope, receive, send), 5)
    return chunks


async def test_stream_disconnect_aborts_every_engine_request(app, engine):
    engine.delay = 0.01
    chunks = await call_and_disconnect(app, "/v1/chat/completions",
                                       {"messages": [{"role": "user", "content": "Hi"}], "stream": True,
                                        "n": 2}, after_chunks=5)
    assert 5 <= len(chunks) < 20
    await asyncio.sleep(0.05)
    assert sorted(engine.aborted) == sorted(c.request_id for c in engine.calls)
    assert len(engine.aborted) == 2 and not engine.running


async def test_non_stream_disconnect_aborts(app, engine):
    engine.delay = 0.01
    chunks = await call_and_disconnect(app, "/v1/completions", {"prompt": "x", "max_tokens": 30},
                                       after_chunks=None, after_s=0.05)
    assert chunks == []
    assert engine.aborted == [engine.calls[0].request_id] and not engine.running
    samples_ = samples(app.state.metrics.render().decode())
    assert samples_[("pagedserve:request_success_total", (("finished_reason", "length"),) + M)] == 0
    assert samples_[("pagedserve:request_success_total", (("finished_reason", "abort"),) + M)] == 1


async def test_finished_stream_aborts_nothing(client, engine):
    await client.post("/v1/completions", json={"prompt": "x", "stream": True, "n": 3})
    await client.post("/v1/completions", json={"prompt": "x", "n": 2})
    assert engine.aborted == [] and not engine.running
