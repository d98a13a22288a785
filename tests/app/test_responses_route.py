"""POST /v1/responses against the fake engine (scripted replies, one byte per token), read with the
official openai client's ``responses.create``, streamed and not."""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from pagedserve.app.server import build_app
from pagedserve.app.tools.plan import ToolConfig
from tests.app.conftest import assert_openai_error
from tests.app.fake_engine import FakeAsyncEngine

WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CALL_TEXT = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def make(reply: str = "Paris is the capital.", parser: str | None = None, max_model_len: int = 4096):
    engine = FakeAsyncEngine(reply=reply, max_model_len=max_model_len)
    app = build_app(engine, served_model_name="fake-model", max_body_bytes=1 << 20,
                    tool_config=ToolConfig(enable_auto_tool_choice=True), reasoning_parser=parser)
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")
    client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="x", http_client=http, max_retries=0)
    return engine, http, client


async def collect(client, **kw):
    stream = await client.responses.create(model="fake-model", stream=True, **kw)
    return [event async for event in stream]


async def test_text_input_non_streamed():
    engine, _, client = make()
    r = await client.responses.create(model="fake-model", input="Capital of France?", instructions="Be brief.",
                                      max_output_tokens=50, temperature=0.5)
    assert r.status == "completed" and r.object == "response"
    assert r.output_text == "Paris is the capital."
    (msg,) = r.output
    assert msg.type == "message" and msg.role == "assistant" and msg.content[0].type == "output_text"
    n_prompt = len(engine.calls[0].prompt_token_ids)
    assert (r.usage.input_tokens, r.usage.output_tokens) == (n_prompt, len("Paris is the capital."))
    assert r.usage.total_tokens == n_prompt + r.usage.output_tokens
    messages = engine.chat_calls[-1][0]
    assert messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France?"}]
    assert engine.calls[0].params.max_tokens == 50 and engine.calls[0].params.temperature == 0.5
    assert r.temperature == 0.5


async def test_streamed_events_build_the_non_streamed_response():
    _, _, client = make()
    full = await client.responses.create(model="fake-model", input="Capital of France?")
    events = await collect(client, input="Capital of France?")
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == full.output_text
    done = events[-1].response
    assert done.output_text == full.output_text and done.usage.output_tokens == full.usage.output_tokens
    assert events[0].response.status == "in_progress" and events[0].response.output == []


async def test_curl_style_sse_names_each_event():
    _, http, _ = make(reply="ok")
    async with http.stream("POST", "/v1/responses", json={"input": "hi", "stream": True}) as r:
        body = (await r.aread()).decode()
    frames = [f for f in body.split("\n\n") if f.strip()]
    for frame in frames:
        event_line, data_line = frame.split("\n")
        assert event_line.removeprefix("event: ") == json.loads(data_line.removeprefix("data: "))["type"]
    assert "[DONE]" not in body and json.loads(frames[-1].split("data: ")[1])["type"] == "response.completed"


async def test_function_tool_round_trip():
    engine, _, client = make(reply=CALL_TEXT)
    r = await client.responses.create(model="fake-model", input="Weather in Paris?", tools=[WEATHER])
    kinds = [item.type for item in r.output]
    assert kinds == ["message", "function_call"]
    call = r.output[1]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert call.call_id.startswith("call_") and call.status == "completed"
    assert engine.chat_tools[-1] == [{"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city", "parameters": WEATHER["parameters"]}}]
    # streamed: the same items, arguments in pieces
    events = await collect(client, input="Weather in Paris?", tools=[WEATHER])
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    (args_done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert args == args_done.arguments == call.arguments
    assert [i.type for i in events[-1].response.output] == kinds
    # the call's result goes back as a function_call_output item, after the earlier output
    engine.reply = "It is 21 C in Paris."
    follow = [{"role": "user", "content": "Weather in Paris?"}, *[i.model_dump(exclude_none=True) for i in r.output],
              {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp_c": 21}'}]
    r2 = await client.responses.create(model="fake-model", input=follow, tools=[WEATHER])
    assert r2.output_text == "It is 21 C in Paris."
    messages = engine.chat_calls[-1][0]
    assert [m["role"] for m in messages] == ["user", "assistant", "tool"]
    assert messages[1]["content"] == "Let me check.\n"
    # (the template gets the arguments decoded, as chat's tool_calls: app/tools/prompt.py)
    assert messages[1]["tool_calls"] == [{"id": call.call_id, "type": "function",
                                          "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]
    assert messages[2] == {"role": "tool", "tool_call_id": call.call_id, "content": '{"temp_c": 21}'}


async def test_forced_function_call():
    engine, _, client = make(reply='{"city": "Paris"}')
    r = await client.responses.create(model="fake-model", input="Weather?", tools=[WEATHER],
                                      tool_choice={"type": "function", "name": "get_weather"})
    (call,) = r.output
    assert call.type == "function_call" and call.arguments == '{"city": "Paris"}'
    assert engine.calls[-1].params.structured_outputs.json == WEATHER["parameters"]


async def test_text_format_json_schema_is_structured_output():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    engine, _, client = make(reply='{"a": 1}')
    r = await client.responses.create(model="fake-model", input="json please",
                                      text={"format": {"type": "json_schema", "name": "x", "schema": schema}})
    assert json.loads(r.output_text) == {"a": 1}
    assert engine.calls[-1].params.structured_outputs.json == schema
    assert r.text.format.type == "json_schema"


async def test_reasoning_items():
    reply = "<think>Paris, surely.</think>Paris."
    _, _, client = make(reply=reply, parser="qwen3")
    r = await client.responses.create(model="fake-model", input="Capital of France?")
    assert [i.type for i in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == "Paris, surely." and r.output_text == "Paris."
    assert r.usage.output_tokens_details.reasoning_tokens == len("<think>Paris, surely.</think>")
    events = await collect(client, input="Capital of France?")
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert thought == "Paris, surely."
    assert [i.type for i in events[-1].response.output] == ["reasoning", "message"]


async def test_cut_by_max_output_tokens_is_incomplete():
    _, _, client = make()
    r = await client.responses.create(model="fake-model", input="x", max_output_tokens=5)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output_text == "Paris" and r.output[0].status == "incomplete"
    events = await collect(client, input="x", max_output_tokens=5)
    assert events[-1].type == "response.incomplete"


@pytest.mark.parametrize("body, status, param", [
    ({"input": "x", "previous_response_id": "resp_1"}, 400, "previous_response_id"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, 400, "tools.0.type"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, 400, "input.0.type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, 400,
     "input.0.content.0"),
    ({"input": []}, 400, "input"),
    ({}, 400, "input"),
    ({"input": "x", "max_output_tokens": 10**6}, 400, "max_output_tokens"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "x"}}}, 400, "text.format.schema"),
    ({"input": "x", "model": "other"}, 404, "model"),
    ({"input": "x", "background": True}, 400, "background"),
    ({"input": "x", "tool_choice": "auto", "tools": [WEATHER], "truncation": "auto"}, 400, "truncation"),
])
async def test_requests_it_cannot_serve_get_openai_errors(body, status, param):
    engine, http, _ = make()
    err = assert_openai_error(await http.post("/v1/responses", json=body), status, param)
    assert err["message"]
    assert engine.calls == []


async def test_previous_response_id_says_nothing_is_stored():
    _, _, client = make()
    with pytest.raises(openai.BadRequestError, match="stores no responses"):
        await client.responses.create(model="fake-model", input="x", previous_response_id="resp_abc")


async def test_model_defaults_apply_where_the_request_is_silent():
    """--generation-config: the model's recommended settings on every generating route; the
    request's own fields win."""
    engine, http, client = make()
    engine.sampling_defaults = {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    await client.responses.create(model="fake-model", input="x")
    await client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "x"}])
    await client.completions.create(model="fake-model", prompt="x")
    for call in engine.calls:
        p = call.params
        assert (p.temperature, p.top_p, p.top_k) == pytest.approx((0.6, 0.95, 20))
    engine.calls.clear()
    r = await client.responses.create(model="fake-model", input="x", temperature=0.1)
    await client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "x"}],
                                         top_p=0.5, extra_body={"top_k": -1})
    await client.completions.create(model="fake-model", prompt="x", temperature=0)
    temps = [(c.params.temperature, c.params.top_p, c.params.top_k) for c in engine.calls]
    for got, want in zip(temps, [(0.1, 0.95, 20), (0.6, 0.5, 0), (0.0, 0.95, 20)], strict=True):
        assert got == pytest.approx(want)
    assert r.temperature == pytest.approx(0.1) and r.top_p == pytest.approx(0.95)


async def test_a_stream_cut_by_the_engine_ends_with_an_error_event():
    engine, http, _ = make()
    engine.fail_after = 3
    async with http.stream("POST", "/v1/responses", json={"input": "x", "stream": True}) as r:
        body = (await r.aread()).decode()
    events = [json.loads(f.split("data: ", 1)[1]) for f in body.split("\n\n") if f.strip()]
    assert [e["type"] for e in events][:2] == ["response.created", "response.in_progress"]
    last = events[-1]
    assert last["type"] == "error" and last["code"] == "engine_dead" and "worker died" in last["message"]
    assert last["sequence_number"] == len(events) - 1
    assert not any(e["type"] == "response.completed" for e in events)
