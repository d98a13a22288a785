"""Tool calling on /v1/chat/completions against the fake engine (scripted replies), read with the
official openai client: request checks, prompts, response and stream shapes."""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from pagedserve.app.server import build_app
from pagedserve.app.tools.plan import ToolConfig
from pagedserve.app.tools.prompt import DEFAULT_TOOL_PROMPT
from tests.app.conftest import assert_openai_error
from tests.app.fake_engine import FakeAsyncEngine

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}}
USER = [{"role": "user", "content": "Weather in Paris?"}]
CALL_TEXT = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TWO_CALLS = (CALL_TEXT + '\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>')



def make(reply: str, auto: bool = True, template: str | None = None):
    engine = FakeAsyncEngine(reply=reply, max_model_len=4096)
    if template is not None:
        engine.tokenizer.chat_template = template
    app = build_app(engine, served_model_name="fake-model", max_body_bytes=1 << 20,
                    tool_config=ToolConfig(enable_auto_tool_choice=auto))
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")
    client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="x", http_client=http, max_retries=0)
    return engine, http, client


async def test_auto_needs_the_server_flag():
    engine, http, _ = make(CALL_TEXT, auto=False)
    for body in ({"messages": USER, "tools": [WEATHER]},  # auto is the default with tools
                 {"messages": USER, "tools": [WEATHER], "tool_choice": "auto"}):
        err = assert_openai_error(await http.post("/v1/chat/completions", json=body), 400, "tool_choice")
        assert "--enable-auto-tool-choice" in err["message"]
    assert engine.calls == []


@pytest.mark.parametrize("body, param", [
    ({"messages": USER, "tool_choice": "required"}, "tool_choice"),
    ({"messages": USER, "tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"messages": USER, "tools": [{"type": "function"}]}, "tools.0.function"),
    ({"messages": USER, "tools": [WEATHER], "tool_choice": "sometimes"}, None),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}]}, None),
])
async def test_bad_tool_requests_are_400(body, param):
    engine, http, _ = make(CALL_TEXT)
    err = assert_openai_error(await http.post("/v1/chat/completions", json=body), 400)
    if param:
        assert err["param"] == param, err
    assert engine.calls == []


async def test_auto_call_non_streamed():
    engine, _, client = make(CALL_TEXT)
    r = await client.chat.completions.create(model="fake-model", messages=USER, tools=[WEATHER])
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check.\n"
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    # the fake template is unknown: trusted to render tools itself
    assert engine.chat_tools[-1] == [WEATHER]


async def test_auto_streamed_deltas_reassemble_to_the_non_streamed_calls():
    engine, _, client = make(TWO_CALLS)
    full = await client.chat.completions.create(model="fake-model", messages=USER, tools=[WEATHER, TIME])
    stream = await client.chat.completions.create(model="fake-model", messages=USER, tools=[WEATHER, TIME],
                                                  stream=True)
    content, calls, finish, firsts = "", {}, None, []
    async for chunk in stream:
        for ch in chunk.choices:
            content += ch.delta.content or ""
            for tc in ch.delta.tool_calls or []:
                if tc.index not in calls:
                    firsts.append(tc)
                    calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": ""}
                else:
                    assert tc.id is None and tc.function.name is None
                calls[tc.index]["arguments"] += tc.function.arguments or ""
            finish = ch.finish_reason or finish
    assert all(f.id and f.type == "function" and f.function.name for f in firsts)
    assert finish == "tool_calls" == full.choices[0].finish_reason
    assert content == full.choices[0].message.content == "Let me check.\n"
    expect = [(c.function.name, c.function.arguments) for c in full.choices[0].message.tool_calls]
    assert [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)] == expect
    assert [name for name, _ in expect] == ["get_weather", "get_time"]
    assert len({c["id"] for c in calls.values()}) == 2


async def test_parallel_tool_calls_false_keeps_one_call():
    _, _, client = make(TWO_CALLS)
    r = await client.chat.completions.create(model="fake-model", messages=USER, tools=[WEATHER, TIME],
                                             parallel_tool_calls=False)
    assert [c.function.name for c in r.choices[0].message.tool_calls] == ["get_weather"]


async def test_auto_without_a_call_is_plain_content():
    _, _, client = make("It is sunny.")
    r = await client.chat.completions.create(model="fake-model", messages=USER, tools=[WEATHER])
    assert r.choices[0].message.content == "It is sunny." and r.choices[0].message.tool_calls is None
    assert r.choices[0].finish_reason == "stop"


async def test_malformed_call_comes_back_as_content():
    text = 'Sure <tool_call>{"name": "get_weather", "arguments": {"city": }}</tool_call>'
    _, _, client = make(text)
    r = await client.chat.completions.create(model="fake-model", messages=USER, tools=[WEATHER])
    assert r.choices[0].message.content == text and r.choices[0].message.tool_calls is None
    assert r.choices[0].finish_reason == "stop"


async def test_tool_choice_none_keeps_tools_out_and_does_not_parse():
    engine, _, client = make(CALL_TEXT, auto=False)
    r = await client.chat.completions.create(model="fake-model", messages=USER, tools=[WEATHER],
                                             tool_choice="none")
    assert r.choices[0].message.content == CALL_TEXT and r.choices[0].finish_reason == "stop"
    assert engine.chat_tools[-1] is None


async def test_template_without_tools_gets_the_default_tool_prompt():
    engine, _, client = make(CALL_TEXT, template="{% for m in messages %}{{ m.content }}{% endfor %}")
    await client.chat.completions.create(model="fake-model", messages=USER, tools=[WEATHER])
    messages = engine.chat_calls[-1][0]
    assert engine.chat_tools[-1] is None
    assert messages[0]["role"] == "system" and messages[0]["content"].startswith("# Tools")
    assert json.dumps(WEATHER) in messages[0]["content"]
    assert DEFAULT_TOOL_PROMPT.splitlines()[-1] in messages[0]["content"]
    assert messages[1:] == USER


HISTORY = USER + [
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21}'},
]


async def test_round_trip_messages_reach_a_tool_template_as_they_are():
    engine, _, client = make("It is 21 C in Paris.")
    r = await client.chat.completions.create(model="fake-model", messages=HISTORY, tools=[WEATHER])
    assert r.choices[0].message.content == "It is 21 C in Paris."
    messages = engine.chat_calls[-1][0]
    assert messages[1]["tool_calls"] == [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": {"city": "Paris"}}}]
    assert messages[2] == {"role": "tool", "content": '{"temp_c": 21}', "tool_call_id": "call_1"}


async def test_round_trip_messages_are_written_out_for_a_template_without_tools():
    engine, http, _ = make("ok", template="{% for m in messages %}{{ m.content }}{% endfor %}")
    r = await http.post("/v1/chat/completions", json={"messages": HISTORY + [HISTORY[-1]]})
    assert r.status_code == 200, r.text
    messages = engine.chat_calls[-1][0]
    assert messages[1] == {"role": "assistant", "content":
                           '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'}
    assert messages[2] == {"role": "user", "content": '<tool_response>\n{"temp_c": 21}\n</tool_response>\n'
                                                      '<tool_response>\n{"temp_c": 21}\n</tool_response>'}
    r = await http.post("/tokenize", json={"messages": HISTORY})
    assert r.status_code == 200, r.text


async def test_required_is_constrained_to_calls_of_the_given_functions():
    reply = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {"tz": "CET"}}]'
    engine, _, client = make(reply, auto=False)
    r = await client.chat.completions.create(model="fake-model", messages=USER, tools=[WEATHER, TIME],
                                             tool_choice="required")
    schema = engine.calls[-1].params.structured_outputs.json
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    branches = schema["items"]["anyOf"]
    assert [b["properties"]["name"]["enum"] for b in branches] == [["get_weather"], ["get_time"]]
    assert branches[0]["properties"]["parameters"] == WEATHER["function"]["parameters"]
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
    calls = r.choices[0].message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]
    await client.chat.completions.create(model="fake-model", messages=USER, tools=[WEATHER, TIME],
                                         tool_choice="required", parallel_tool_calls=False)
    assert engine.calls[-1].params.structured_outputs.json["maxItems"] == 1


async def test_named_function_is_constrained_to_its_parameters():
    engine, _, client = make('{"city": "Paris"}', auto=False)
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = await client.chat.completions.create(model="fake-model", messages=USER, tools=[WEATHER, TIME],
                                             tool_choice=choice)
    assert engine.calls[-1].params.structured_outputs.json == WEATHER["function"]["parameters"]
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments == '{"city": "Paris"}'
    assert r.choices[0].finish_reason == "tool_calls"
    stream = await client.chat.completions.create(model="fake-model", messages=USER, tools=[WEATHER],
                                                  tool_choice=choice, stream=True)
    deltas = [tc async for chunk in stream for ch in chunk.choices for tc in (ch.delta.tool_calls or [])]
    assert deltas[0].function.name == "get_weather" and deltas[0].id.startswith("call_")
    assert "".join(d.function.arguments or "" for d in deltas) == '{"city": "Paris"}'


async def test_required_cannot_be_combined_with_another_constraint():
    _, http, _ = make("[]", auto=False)
    r = await http.post("/v1/chat/completions", json={
        "messages": USER, "tools": [WEATHER], "tool_choice": "required",
        "response_format": {"type": "json_object"}})
    assert_openai_error(r, 400, "response_format")


async def test_each_choice_parses_its_own_calls_streamed():
    _, _, client = make(CALL_TEXT)
    stream = await client.chat.completions.create(model="fake-model", messages=USER, tools=[WEATHER], n=2,
                                                  stream=True)
    content, ids, finish = {0: "", 1: ""}, {0: [], 1: []}, {}
    async for chunk in stream:
        for ch in chunk.choices:
            content[ch.index] += ch.delta.content or ""
            ids[ch.index] += [tc.id for tc in ch.delta.tool_calls or [] if tc.id]
            if ch.finish_reason:
                finish[ch.index] = ch.finish_reason
    assert content == {0: "Let me check.\n", 1: "[1] Let me check.\n"}
    assert finish == {0: "tool_calls", 1: "tool_calls"}
    assert len(ids[0]) == len(ids[1]) == 1 and ids[0] != ids[1]


async def test_a_request_chat_template_decides_how_tools_are_rendered():
    engine = FakeAsyncEngine(reply="ok", max_model_len=4096)
    engine.tokenizer.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"  # no tools
    app = build_app(engine, served_model_name="fake-model", max_body_bytes=1 << 20,
                    tool_config=ToolConfig(enable_auto_tool_choice=True), trust_request_chat_template=True)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
        own = "{{ tools | tojson }}{% for m in messages %}{{ m.content }}{% endfor %}"
        r = await http.post("/v1/chat/completions", json={"messages": USER, "tools": [WEATHER], "chat_template": own})
        assert r.status_code == 200, r.text
        assert engine.chat_tools[-1] == [WEATHER] and engine.chat_calls[-1][0] == USER
        r = await http.post("/v1/chat/completions", json={"messages": USER, "tools": [WEATHER]})
        assert engine.chat_tools[-1] is None and engine.chat_calls[-1][0][0]["content"].startswith("# Tools")


async def test_a_tool_call_answer_fits_the_published_schema():
    from jsonschema import Draft202012Validator

    _, http, _ = make(CALL_TEXT)
    doc = (await http.get("/openapi.json")).json()
    validator = Draft202012Validator({"$ref": "#/components/schemas/ChatCompletion",
                                      "components": doc["components"]})
    body = (await http.post("/v1/chat/completions", json={"messages": USER, "tools": [WEATHER]})).json()
    assert body["choices"][0]["message"]["tool_calls"]
    validator.validate(body)
    body["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris"}
    assert not validator.is_valid(body)  # arguments are a JSON string, not an object
