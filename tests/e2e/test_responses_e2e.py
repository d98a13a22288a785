"""POST /v1/responses against a real `pagedserve serve` (tiny random model) through the official
openai client's ``responses.create``, streamed and not. A random model writes no call by itself:
the calls come from a forced function (the server's own constraint)."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest

# the tool tests' server (--enable-auto-tool-choice) and client, one of each for this module too
from tests.e2e.test_tools_e2e import client, server  # noqa: F401

WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "properties": {
               "city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]}},
               "required": ["city"], "additionalProperties": False}}


def test_text_streamed_and_not_agree(client):
    kw = dict(model="tiny", input="The capital of France is", instructions="Answer briefly.",
              max_output_tokens=12, temperature=0)
    r = client.responses.create(**kw)
    assert r.status in ("completed", "incomplete") and r.output_text
    assert r.usage.output_tokens <= 12 and r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    events = list(client.responses.create(stream=True, **kw))
    assert events[0].type == "response.created" and events[-1].type == f"response.{r.status}"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == r.output_text == events[-1].response.output_text  # greedy: the same tokens


def test_function_tool_round_trip(client):
    tools = [WEATHER]
    r = client.responses.create(model="tiny", input="Weather in Paris?", tools=tools, max_output_tokens=64,
                                tool_choice={"type": "function", "name": "get_weather"})
    (call,) = [i for i in r.output if i.type == "function_call"]
    assert call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    events = list(client.responses.create(model="tiny", input="Weather in Paris?", tools=tools, stream=True,
                                          max_output_tokens=64, tool_choice={"type": "function", "name": "get_weather"}))
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    jsonschema.validate(json.loads(args), WEATHER["parameters"])
    follow = [{"role": "user", "content": "Weather in Paris?"}, *[i.model_dump(exclude_none=True) for i in r.output],
              {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp_c": 21}'}]
    r2 = client.responses.create(model="tiny", input=follow, tools=tools, tool_choice="none", max_output_tokens=8)
    assert r2.output and r2.output[0].type == "message"


def test_text_format_json_schema(client):
    schema = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
              "required": ["answer"], "additionalProperties": False}
    r = client.responses.create(model="tiny", input="Is Paris in France?", max_output_tokens=64,
                                text={"format": {"type": "json_schema", "name": "a", "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(r.output_text), schema)


def test_previous_response_id_is_refused(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="tiny", input="x", previous_response_id="resp_1")
    assert e.value.body["param"] == "previous_response_id"


def test_curl_streams_named_events(server):
    import shutil
    import subprocess

    if shutil.which("curl") is None:
        pytest.skip("needs curl")
    out = subprocess.run(["curl", "-sN", server.url + "/v1/responses", "-H", "Content-Type: application/json",
                          "-d", json.dumps({"input": "Hi", "stream": True, "max_output_tokens": 4})],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    frames = [f for f in out.split("\n\n") if f.strip()]
    names = [f.split("\n")[0].removeprefix("event: ") for f in frames]
    assert names[0] == "response.created" and names[-1] in ("response.completed", "response.incomplete")
    assert all(json.loads(f.split("\ndata: ", 1)[1])["type"] == n for f, n in zip(frames, names))
