"""Tool calling against a real `pagedserve serve --enable-auto-tool-choice` (tiny random model,
the default model's tokenizer and ChatML template, which does not know tools: the default tool
prompt is used), through the official openai client.

A random model never writes a tool call by itself, so the calls here come from constrained
output: tool_choice "required" / a named function (the server's own constraint), and for "auto"
a vLLM ``structured_outputs`` regex that forces a Hermes-style call the auto parser must find.
"""
from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.e2e.test_server_e2e import ServerProcess


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
        "unit": {"type": "string", "enum": ["c", "f"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "tz": {"type": "string", "enum": ["CET", "JST"]}}, "required": ["tz"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
FORCED_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lima", "unit": "c"}}\n</tool_call>'


@pytest.fixture(scope="module")
def server():
    s = ServerProcess("--enable-auto-tool-choice")
    yield s
    assert s.stop() == 0, s.output()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def check_calls(message, names=None):
    assert message.tool_calls, message
    for call in message.tool_calls:
        assert call.id.startswith("call_") and call.type == "function"
        assert call.function.name in (names or PARAMS)
        jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])


def reassemble(stream):
    content, calls, finish = "", {}, None
    for chunk in stream:
        for ch in chunk.choices:
            content += ch.delta.content or ""
            for tc in ch.delta.tool_calls or []:
                if tc.index not in calls:
                    assert tc.id and tc.type == "function" and tc.function.name, tc  # first delta
                    calls[tc.index] = [tc.function.name, ""]
                calls[tc.index][1] += tc.function.arguments or ""
            finish = ch.finish_reason or finish
    return content, [tuple(calls[i]) for i in sorted(calls)], finish


def test_auto_without_a_call_is_content_and_the_tools_are_in_the_prompt(server, client):
    r = client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, max_tokens=8,
                                       temperature=0)
    assert r.choices[0].message.tool_calls is None and isinstance(r.choices[0].message.content, str)
    assert r.choices[0].finish_reason == "length"
    with_tools = httpx.post(server.url + "/tokenize", json={"messages": USER, "tools": TOOLS}).json()
    without = httpx.post(server.url + "/tokenize", json={"messages": USER}).json()
    assert r.usage.prompt_tokens == with_tools["count"] > without["count"] + 50
    none = client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, max_tokens=1,
                                          tool_choice="none")
    assert none.usage.prompt_tokens == without["count"]  # "none": no tools in the prompt


def test_multi_turn_with_tool_calls_and_results(server, client):
    history = USER + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
    ]
    r = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, max_tokens=4)
    assert r.choices[0].message.content is not None
    ids = httpx.post(server.url + "/tokenize", json={"messages": history, "tools": TOOLS}).json()["tokens"]
    prompt = httpx.post(server.url + "/detokenize", json={"tokens": ids}).json()["prompt"]
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris", "unit": "c"}}\n</tool_call><|im_end|>') in prompt
    assert '<|im_start|>user\n<tool_response>\n{"temp": 21}\n</tool_response><|im_end|>' in prompt
    assert prompt.startswith("<|im_start|>system\n# Tools") and prompt.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("parallel", [True, False])
def test_required_always_gives_valid_calls(client, parallel):
    r = client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, tool_choice="required",
                                       temperature=1.0, n=3, seed=7, max_tokens=300,
                                       parallel_tool_calls=parallel)
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        check_calls(choice.message)
        if not parallel:
            assert len(choice.message.tool_calls) == 1


def test_named_function_gives_a_valid_call_of_it(client):
    r = client.chat.completions.create(
        model="tiny", messages=USER, tools=TOOLS, temperature=1.0, n=3, seed=3, max_tokens=300,
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_time"
        check_calls(choice.message, ["get_time"])


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_streamed_calls_reassemble_to_the_non_streamed_ones(client, tool_choice):
    # seeded sampling: the same tokens streamed or not (greedy may repeat array items up to max_tokens)
    kw = dict(model="tiny", messages=USER, tools=TOOLS, tool_choice=tool_choice, temperature=1.0, seed=11,
              max_tokens=300)
    full = client.chat.completions.create(**kw)
    content, calls, finish = reassemble(client.chat.completions.create(**kw, stream=True))
    assert finish == full.choices[0].finish_reason == "tool_calls" and content == ""
    assert calls == [(c.function.name, c.function.arguments) for c in full.choices[0].message.tool_calls]


def test_auto_parses_a_hermes_call_the_output_was_constrained_to(client):
    # scripted by constraint: the regex forces text + a call; the auto parser must find it
    body = dict(model="tiny", messages=USER, tools=TOOLS, temperature=0, max_tokens=200,
                extra_body={"structured_outputs": {"regex": "Sure\\.\\n" + _regex_escape(FORCED_CALL)}})
    r = client.chat.completions.create(**body)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.content == "Sure.\n"
    (call,) = msg.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Lima", "unit": "c"})
    content, calls, finish = reassemble(client.chat.completions.create(**body, stream=True))
    assert (content, calls, finish) == ("Sure.\n", [(call.function.name, call.function.arguments)], "tool_calls")


def test_round_trip_call_then_tool_result(client):
    first = client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, tool_choice="required",
                                           temperature=0, max_tokens=300, parallel_tool_calls=False)
    msg = first.choices[0].message
    check_calls(msg)
    results = [{"role": "tool", "tool_call_id": c.id, "content": json.dumps({"temp": 21})} for c in msg.tool_calls]
    history = USER + [msg.model_dump(exclude_none=True)] + results
    second = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS,
                                            max_tokens=5, temperature=0)
    assert second.choices[0].message.tool_calls is None and second.choices[0].message.content
    assert second.usage.prompt_tokens > first.usage.prompt_tokens


def _regex_escape(s: str) -> str:
    out = []
    for ch in s:
        if ch == "\n":
            out.append("\\n")
        elif ch in ".^$*+?()[]{}|\\/":
            out.append("\\" + ch)
        else:
            out.append(ch)
    return "".join(out)


def test_a_tool_schema_the_grammar_engine_refuses_is_a_400_on_tools(server, client):
    bad = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "strng"}}}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=USER, tools=[bad], tool_choice="required",
                                       max_tokens=5)
    assert e.value.body["param"] == "tools", e.value.body
    r = client.chat.completions.create(model="tiny", messages=USER, max_tokens=2)  # still serving
    assert r.choices[0].finish_reason == "length"
