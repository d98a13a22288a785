"""POST /v1/messages against the fake engine (scripted replies, one byte per token), read with the
official ``anthropic`` client, streamed and not: text, stop reasons, tools, thinking, errors."""
from __future__ import annotations

import json

import anthropic
import anthropic._base_client
import httpx
import pytest

from pagedserve.app.server import build_app
from pagedserve.app.tools.plan import ToolConfig
from tests.app.fake_engine import FakeAsyncEngine

# The HTTP library the SDK is built on: httpx2 in its recent releases, httpx before.
sdk_httpx = getattr(anthropic._base_client, "httpx2", None) or anthropic._base_client.httpx

WEATHER = {"name": "get_weather", "description": "Current weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CALL_TEXT = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def make(reply: str = "Paris is the capital.", parser: str | None = None, api_key: str | None = None,
         max_model_len: int = 4096, engine: FakeAsyncEngine | None = None):
    engine = engine or FakeAsyncEngine(reply=reply, max_model_len=max_model_len)
    app = build_app(engine, served_model_name="fake-model", max_body_bytes=1 << 20, api_key=api_key,
                    tool_config=ToolConfig(enable_auto_tool_choice=True), reasoning_parser=parser)
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")
    sdk_http = sdk_httpx.AsyncClient(transport=sdk_httpx.ASGITransport(app=app), base_url="http://test")
    client = anthropic.AsyncAnthropic(base_url="http://test", api_key=api_key or "x", http_client=sdk_http,
                                      max_retries=0)
    client.sdk_http = sdk_http
    return engine, http, client


async def test_text_message_non_streamed():
    engine, _, client = make()
    m = await client.messages.create(model="fake-model", max_tokens=50, system="Be brief.",
                                     # recent SDK releases have no temperature / top_k arguments: the API takes them
                                     extra_body={"temperature": 0.5, "top_k": 5},
                                     messages=[{"role": "user", "content": "Capital of France?"}])
    assert m.type == "message" and m.role == "assistant" and m.model == "fake-model"
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == "Paris is the capital."
    assert m.stop_reason == "end_turn" and m.stop_sequence is None
    assert m.usage.input_tokens == len(engine.calls[0].prompt_token_ids)
    assert m.usage.output_tokens == len("Paris is the capital.")
    assert engine.chat_calls[-1][0] == [{"role": "system", "content": "Be brief."},
                                        {"role": "user", "content": "Capital of France?"}]
    params = engine.calls[0].params
    assert (params.max_tokens, params.temperature, params.top_k) == (50, 0.5, 5)


async def test_system_blocks_and_max_tokens_stop_reason():
    engine, _, client = make()
    m = await client.messages.create(model="fake-model", max_tokens=5, system=[{"type": "text", "text": "Sys."}],
                                     messages=[{"role": "user", "content": [{"type": "text", "text": "Hi"}]}])
    assert m.stop_reason == "max_tokens" and m.content[0].text == "Paris"
    assert engine.chat_calls[-1][0][0] == {"role": "system", "content": "Sys."}


async def test_stop_sequence_reported():
    _, _, client = make()
    m = await client.messages.create(model="fake-model", max_tokens=50, stop_sequences=["capital"],
                                     messages=[{"role": "user", "content": "Hi"}])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == "capital"
    assert m.content[0].text == "Paris is the "


async def test_streamed_event_sequence_and_accumulated_message():
    _, http, client = make()
    async with client.messages.stream(model="fake-model", max_tokens=50,
                                      messages=[{"role": "user", "content": "Hi"}]) as stream:
        text = "".join([t async for t in stream.text_stream])
        final = await stream.get_final_message()
    assert text == "Paris is the capital." and final.content[0].text == text
    assert final.stop_reason == "end_turn" and final.usage.output_tokens == len(text)
    async with http.stream("POST", "/v1/messages", json={"model": "fake-model", "max_tokens": 50, "stream": True,
                                                         "messages": [{"role": "user", "content": "Hi"}]}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        body = (await r.aread()).decode()
    frames = [f for f in body.split("\n\n") if f.strip()]
    types = []
    for frame in frames:
        event_line, data_line = frame.split("\n")
        payload = json.loads(data_line.removeprefix("data: "))
        assert event_line.removeprefix("event: ") == payload["type"]
        types.append(payload["type"])
    assert types[:4] == ["message_start", "ping", "content_block_start", "content_block_delta"]
    assert types[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    delta = json.loads(frames[-2].split("data: ")[1])
    assert delta["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == len("Paris is the capital.")


async def test_tool_use_round_trip():
    engine, _, client = make(reply=CALL_TEXT)
    m = await client.messages.create(model="fake-model", max_tokens=200, tools=[WEATHER],
                                     messages=[{"role": "user", "content": "Weather in Paris?"}])
    assert m.stop_reason == "tool_use"
    kinds = [b.type for b in m.content]
    assert kinds[-1] == "tool_use" and m.content[0].text.startswith("Let me check.")
    use = m.content[-1]
    assert use.name == "get_weather" and use.input == {"city": "Paris"} and use.id.startswith("toolu_")
    engine.reply = "It is sunny in Paris."
    m2 = await client.messages.create(
        model="fake-model", max_tokens=200, tools=[WEATHER],
        messages=[{"role": "user", "content": "Weather in Paris?"},
                  {"role": "assistant", "content": [b.model_dump() for b in m.content]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                "content": [{"type": "text", "text": "Sunny, 21C"}]}]}])
    assert m2.stop_reason == "end_turn" and m2.content[0].text == "It is sunny in Paris."
    sent = engine.chat_calls[-1][0]
    assert sent[-2]["role"] == "assistant" and sent[-2]["tool_calls"][0]["id"] == use.id
    assert sent[-2]["tool_calls"][0]["function"]["arguments"] in ({"city": "Paris"}, '{"city": "Paris"}')
    assert sent[-1] == {"role": "tool", "tool_call_id": use.id, "content": "Sunny, 21C"}


async def test_tool_use_streamed_input_json_delta():
    _, _, client = make(reply=CALL_TEXT)
    events = []
    async with client.messages.stream(model="fake-model", max_tokens=200, tools=[WEATHER],
                                      tool_choice={"type": "auto"},
                                      messages=[{"role": "user", "content": "Weather?"}]) as stream:
        async for event in stream:
            events.append(event)
        final = await stream.get_final_message()
    assert any(e.type == "content_block_delta" and e.delta.type == "input_json_delta" for e in events)
    assert final.stop_reason == "tool_use" and final.content[-1].input == {"city": "Paris"}


async def test_tool_choice_tool_and_any_constrain():
    engine, _, client = make(reply='{"city": "Rome"}')
    m = await client.messages.create(model="fake-model", max_tokens=100, tools=[WEATHER],
                                     tool_choice={"type": "tool", "name": "get_weather"},
                                     messages=[{"role": "user", "content": "Weather?"}])
    assert engine.calls[-1].params.structured_outputs is not None
    assert m.content[-1].type == "tool_use" and m.content[-1].input == {"city": "Rome"}
    assert m.stop_reason == "tool_use"


async def test_tool_choice_none_leaves_tools_out():
    engine, _, client = make()
    m = await client.messages.create(model="fake-model", max_tokens=50, tools=[WEATHER],
                                     tool_choice={"type": "none"}, messages=[{"role": "user", "content": "Hi"}])
    assert m.content[0].text == "Paris is the capital." and m.stop_reason == "end_turn"


async def test_thinking_blocks_from_the_reasoning_parser():
    _, _, client = make(reply="<think>Paris, surely.</think>Paris.", parser="qwen3")
    m = await client.messages.create(model="fake-model", max_tokens=100,
                                     messages=[{"role": "user", "content": "Capital?"}])
    assert [b.type for b in m.content] == ["thinking", "text"]
    assert m.content[0].thinking == "Paris, surely." and m.content[1].text == "Paris."
    async with client.messages.stream(model="fake-model", max_tokens=100,
                                      messages=[{"role": "user", "content": "Capital?"}]) as stream:
        deltas = [e.delta.type async for e in stream if e.type == "content_block_delta"]
        final = await stream.get_final_message()
    assert "thinking_delta" in deltas and "text_delta" in deltas
    assert final.content[0].thinking == "Paris, surely." and final.content[1].text == "Paris."


async def test_count_tokens():
    engine, _, client = make()
    r = await client.messages.count_tokens(model="fake-model", messages=[{"role": "user", "content": "Hi"}])
    m = await client.messages.create(model="fake-model", max_tokens=5, messages=[{"role": "user", "content": "Hi"}])
    assert r.input_tokens == m.usage.input_tokens > 0


async def test_errors_in_anthropic_shape():
    _, http, client = make()
    with pytest.raises(anthropic.BadRequestError) as e:
        await client.messages.create(model="fake-model", max_tokens=10,
                                     messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}])
    assert e.value.status_code == 400 and e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "invalid_request_error" and "image" in e.value.body["error"]["message"]
    r = await http.post("/v1/messages", json={"model": "fake-model", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("max_tokens")
    with pytest.raises(anthropic.NotFoundError) as e:
        await client.messages.create(model="nope", max_tokens=10, messages=[{"role": "user", "content": "x"}])
    assert e.value.body["error"]["type"] == "not_found_error"
    r = await http.post("/v1/messages", json={"model": "fake-model", "max_tokens": 10**6,  # context arithmetic
                                              "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 400 and "maximum context length" in r.json()["error"]["message"]


async def test_admission_limits_hold():
    _, _, client = make()
    with pytest.raises(anthropic.BadRequestError) as e:
        await client.messages.create(model="fake-model", max_tokens=10, stop_sequences=["x"] * 300,
                                     messages=[{"role": "user", "content": "x"}])
    msg = e.value.body["error"]["message"]
    assert "'stop_sequences'" in msg and "--max-stop-sequences" in msg
    with pytest.raises(anthropic.BadRequestError) as e:
        await client.messages.create(model="fake-model", max_tokens=10,
                                     messages=[{"role": "user", "content": "x"}] * 3000)
    assert "--max-messages" in e.value.body["error"]["message"]


async def test_x_api_key_accepted_and_401_in_anthropic_shape():
    _, http, client = make(api_key="sekrit")
    m = await client.messages.create(model="fake-model", max_tokens=5, messages=[{"role": "user", "content": "x"}])
    assert m.content[0].text == "Paris"
    bad = anthropic.AsyncAnthropic(base_url="http://test", api_key="wrong", http_client=client.sdk_http,
                                 max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        await bad.messages.create(model="fake-model", max_tokens=5, messages=[{"role": "user", "content": "x"}])
    assert e.value.body["error"]["type"] == "authentication_error"
    r = await http.get("/v1/models", headers={"x-api-key": "sekrit"})
    assert r.status_code == 200


async def test_prefill_output_config_and_thinking_flag():
    engine, http, client = make(reply='{"a": 1}')
    m = await client.messages.create(model="fake-model", max_tokens=20, messages=[
        {"role": "user", "content": "json please"}, {"role": "assistant", "content": "Here:"}])
    assert m.content[0].text == '{"a": 1}'
    assert engine.chat_calls[-1][0][-1] == {"role": "assistant", "content": "Here:"}
    r = await http.post("/v1/messages", json={
        "model": "fake-model", "max_tokens": 20, "messages": [{"role": "user", "content": "json"}],
        "output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}},
        "thinking": {"type": "disabled"}})
    assert r.status_code == 200 and r.json()["content"][0]["text"] == '{"a": 1}'
    assert engine.calls[-1].params.structured_outputs is not None
    r = await http.post("/v1/messages", json={"model": "fake-model", "max_tokens": 5, "mcp_servers": [{"url": "x"}],
                                              "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 400 and "mcp_servers" in r.json()["error"]["message"]


async def test_engine_errors_in_anthropic_shape_whole_and_mid_stream():
    engine, http, client = make()
    engine.overloaded = True
    with pytest.raises(anthropic.APIStatusError) as e:
        await client.messages.create(model="fake-model", max_tokens=5, messages=[{"role": "user", "content": "x"}])
    assert e.value.status_code == 503 and e.value.body["error"]["type"] == "overloaded_error"
    engine.overloaded = False
    engine.fail_after = 3
    async with http.stream("POST", "/v1/messages", json={"model": "fake-model", "max_tokens": 50, "stream": True,
                                                         "messages": [{"role": "user", "content": "Hi"}]}) as r:
        body = (await r.aread()).decode()
    last = [f for f in body.split("\n\n") if f.strip()][-1]
    assert last.startswith("event: error\n")
    payload = json.loads(last.split("data: ", 1)[1])
    assert payload["type"] == "error" and payload["error"]["type"] == "api_error"  # the engine died
    assert "worker died" in payload["error"]["message"]


async def test_client_gone_mid_stream_aborts_the_request():
    import asyncio

    from tests.app.asgi_stream import AsgiRun

    engine = FakeAsyncEngine(reply="x" * 200, max_model_len=4096)
    engine.delay = 0.01
    app = build_app(engine, served_model_name="fake-model", max_body_bytes=1 << 20)
    run = AsgiRun(app, "POST", "/v1/messages", {"model": "fake-model", "max_tokens": 200, "stream": True,
                                                "messages": [{"role": "user", "content": "Hi"}]})
    for _ in range(500):
        if len(run.chunks) >= 5:
            break
        await asyncio.sleep(0.01)
    run._disconnect.set()  # the client hangs up
    await run.finish()
    await asyncio.sleep(0)
    assert engine.aborted == [engine.calls[0].request_id]
    assert b"message_stop" not in b"".join(run.chunks)
