"""Ollama's API against the fake engine (scripted replies, one byte per token), read with the
official ``ollama`` client: chat and generate streamed (NDJSON) and not, options, format, tools,
thinking, embed, the model routes and the error shape."""
from __future__ import annotations

import json

import httpx
import ollama
import pytest

from pagedserve.app.server import build_app
from pagedserve.app.tools.plan import ToolConfig
from tests.app.fake_engine import FakeAsyncEngine

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def make(reply: str = "Paris is the capital.", parser: str | None = None, api_key: str | None = None):
    engine = FakeAsyncEngine(reply=reply, max_model_len=4096)
    app = build_app(engine, served_model_name="fake-model", max_body_bytes=1 << 20, api_key=api_key,
                    tool_config=ToolConfig(enable_auto_tool_choice=True), reasoning_parser=parser)
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    client = ollama.AsyncClient(host="http://test", transport=httpx.ASGITransport(app=app), headers=headers)
    return engine, http, client


async def test_chat_non_streamed_with_options():
    engine, _, client = make()
    r = await client.chat(model="fake-model:latest", messages=[{"role": "system", "content": "Be brief."},
                                                               {"role": "user", "content": "Capital?"}],
                          options={"temperature": 0.5, "top_k": 5, "top_p": 0.9, "num_predict": 50, "seed": 7,
                                   "repeat_penalty": 1.1, "num_ctx": 8192})
    assert r.done and r.done_reason == "stop" and r.message.role == "assistant"
    assert r.message.content == "Paris is the capital."
    assert r.eval_count == len("Paris is the capital.")
    assert r.prompt_eval_count == len(engine.calls[0].prompt_token_ids)
    assert r.total_duration >= r.eval_duration >= 0 and r.prompt_eval_duration >= 0
    p = engine.calls[0].params
    assert (p.temperature, p.top_k, p.top_p, p.max_tokens, p.seed, p.repetition_penalty) == (0.5, 5, 0.9, 50, 7, 1.1)


async def test_chat_streamed_ndjson():
    _, http, client = make()
    parts = [part async for part in await client.chat(model="fake-model", stream=True,
                                                      messages=[{"role": "user", "content": "Hi"}])]
    assert all(not p.done for p in parts[:-1]) and parts[-1].done and parts[-1].done_reason == "stop"
    assert "".join(p.message.content for p in parts) == "Paris is the capital."
    assert parts[-1].eval_count == len("Paris is the capital.")
    async with http.stream("POST", "/api/chat", json={"model": "fake-model",
                                                      "messages": [{"role": "user", "content": "Hi"}]}) as r:
        assert r.headers["content-type"].startswith("application/x-ndjson")  # streams by default
        lines = [json.loads(line) async for line in r.aiter_lines() if line]
    assert lines[-1]["done"] is True and len(lines) > 2


async def test_num_predict_and_stop():
    _, _, client = make()
    r = await client.chat(model="fake-model", messages=[{"role": "user", "content": "Hi"}],
                          options={"num_predict": 5})
    assert r.done_reason == "length" and r.message.content == "Paris"
    r = await client.generate(model="fake-model", prompt="Hi", options={"stop": ["capital"]})
    assert r.done_reason == "stop" and r.response == "Paris is the "


async def test_generate_streamed_and_not():
    engine, _, client = make()
    r = await client.generate(model="fake-model", prompt="Capital?", system="Be brief.")
    assert r.response == "Paris is the capital." and r.done
    assert engine.chat_calls[-1][0] == [{"role": "system", "content": "Be brief."},
                                        {"role": "user", "content": "Capital?"}]
    parts = [p async for p in await client.generate(model="fake-model", prompt="Capital?", stream=True)]
    assert "".join(p.response for p in parts) == "Paris is the capital." and parts[-1].done
    r = await client.generate(model="fake-model")  # no prompt: Ollama's "load the model" call
    assert r.done and r.done_reason == "load"


async def test_format_json_and_schema_use_structured_outputs():
    engine, _, client = make(reply='{"a": 1}')
    r = await client.chat(model="fake-model", messages=[{"role": "user", "content": "json"}], format="json")
    assert json.loads(r.message.content) == {"a": 1}
    assert engine.calls[-1].params.structured_outputs is not None
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    await client.generate(model="fake-model", prompt="json", format=schema)
    assert engine.calls[-1].params.structured_outputs is not None


async def test_tool_call_round_trip():
    engine, _, client = make(reply=CALL_TEXT)
    r = await client.chat(model="fake-model", messages=[{"role": "user", "content": "Weather in Paris?"}],
                          tools=[WEATHER])
    (call,) = r.message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments == {"city": "Paris"}
    parts = [p async for p in await client.chat(model="fake-model", stream=True, tools=[WEATHER],
                                                messages=[{"role": "user", "content": "Weather?"}])]
    streamed = [c for p in parts for c in (p.message.tool_calls or [])]
    assert [c.function.arguments for c in streamed] == [{"city": "Paris"}]
    engine.reply = "Sunny."
    r2 = await client.chat(model="fake-model", tools=[WEATHER], messages=[
        {"role": "user", "content": "Weather in Paris?"}, r.message,
        {"role": "tool", "content": "Sunny, 21C", "tool_name": "get_weather"}])
    assert r2.message.content == "Sunny."
    sent = engine.chat_calls[-1][0]
    assert sent[-2]["tool_calls"][0]["id"] == sent[-1]["tool_call_id"]
    assert sent[-1]["content"] == "Sunny, 21C"


async def test_thinking_from_the_reasoning_parser():
    _, _, client = make(reply="<think>Paris, surely.</think>Paris.", parser="qwen3")
    r = await client.chat(model="fake-model", messages=[{"role": "user", "content": "Capital?"}], think=True)
    assert r.message.thinking == "Paris, surely." and r.message.content == "Paris."
    parts = [p async for p in await client.generate(model="fake-model", prompt="Capital?", think=True, stream=True)]
    assert "".join(p.thinking or "" for p in parts) == "Paris, surely."
    assert "".join(p.response for p in parts) == "Paris."


async def test_embed():
    _, _, client = make()
    r = await client.embed(model="fake-model", input=["a b", "c"])
    assert len(r.embeddings) == 2 and len(r.embeddings[0]) > 0
    one = await client.embed(model="fake-model", input="a b")
    assert one.embeddings[0] == r.embeddings[0]
    legacy = await client.embeddings(model="fake-model", prompt="a b")
    assert list(legacy.embedding) == list(r.embeddings[0])


async def test_model_routes():
    _, http, client = make()
    tags = await client.list()
    assert [m.model for m in tags.models] == ["fake-model"]
    show = await client.show("fake-model")
    assert "completion" in show.capabilities and "tools" in show.capabilities
    r = await http.get("/api/version")
    assert r.status_code == 200 and r.json()["version"]
    ps = await client.ps()
    assert ps.models[0].model == "fake-model"


async def test_errors_in_ollama_shape():
    _, http, client = make()
    with pytest.raises(ollama.ResponseError) as e:
        await client.chat(model="nope", messages=[{"role": "user", "content": "x"}])
    assert e.value.status_code == 404
    with pytest.raises(ollama.ResponseError) as e:
        await client.show("nope")
    assert e.value.status_code == 404 and "not found" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        await client.pull("llama3")
    assert e.value.status_code == 501 and "not supported" in e.value.error
    for path, method in (("/api/delete", "DELETE"), ("/api/create", "POST"), ("/api/push", "POST"),
                         ("/api/copy", "POST")):
        r = await http.request(method, path, json={"model": "x"})
        assert r.status_code == 501 and set(r.json()) == {"error"}
    r = await http.post("/api/chat", json={"model": "fake-model", "stream": False,
                                           "messages": [{"role": "user", "content": "x", "images": ["AAAA"]}]})
    assert r.status_code == 400 and "images" in r.json()["error"]
    r = await http.post("/api/chat", json={"messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 400 and r.json() == {"error": "model is required"}
    r = await http.post("/api/generate", json={"model": "fake-model", "prompt": "x", "raw": True})
    assert r.status_code == 400 and "raw" in r.json()["error"]


async def test_admission_limits_hold():
    _, http, _ = make()
    r = await http.post("/api/chat", json={"model": "fake-model", "stream": False,
                                           "messages": [{"role": "user", "content": "x"}] * 3000})
    assert r.status_code == 400 and "--max-messages" in r.json()["error"]
    r = await http.post("/api/chat", json={"model": "fake-model", "stream": False, "options": {"stop": ["x"] * 300},
                                           "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 400 and "--max-stop-sequences" in r.json()["error"]


async def test_api_key_protects_api_routes():
    _, http, client = make(api_key="sekrit")
    r = await client.chat(model="fake-model", messages=[{"role": "user", "content": "x"}], options={"num_predict": 2})
    assert r.message.content == "Pa"
    r = await http.get("/api/tags")
    assert r.status_code == 401 and set(r.json()) == {"error"}


async def test_client_gone_mid_stream_aborts_the_request():
    import asyncio

    from tests.app.asgi_stream import AsgiRun

    engine, _, _ = make(reply="x" * 200)
    engine.delay = 0.01
    app = build_app(engine, served_model_name="fake-model", max_body_bytes=1 << 20)
    run = AsgiRun(app, "POST", "/api/chat", {"model": "fake-model", "messages": [{"role": "user", "content": "Hi"}]})
    for _ in range(500):
        if len(run.chunks) >= 3:
            break
        await asyncio.sleep(0.01)
    run._disconnect.set()  # the client hangs up
    await run.finish()
    assert run.status == 200 and run.headers["content-type"].startswith("application/x-ndjson")
    await asyncio.sleep(0)
    assert engine.aborted == [engine.calls[0].request_id]
    assert all(not json.loads(c)["done"] for c in run.chunks)


async def test_engine_failure_mid_stream_is_an_error_line():
    engine, http, client = make()
    engine.fail_after = 3
    async with http.stream("POST", "/api/generate", json={"model": "fake-model", "prompt": "Hi"}) as r:
        lines = [json.loads(line) async for line in r.aiter_lines() if line]
    assert lines[-1] == {"error": "the engine stopped: worker died"} and len(lines) == 4
    engine.fail_after, engine.overloaded = None, True
    with pytest.raises(ollama.ResponseError) as e:
        await client.chat(model="fake-model", messages=[{"role": "user", "content": "x"}])
    assert e.value.status_code == 503
