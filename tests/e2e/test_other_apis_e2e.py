"""Anthropic's Messages API and Ollama's API against a real `pagedserve serve` (tiny random model,
the default model's tokenizer and ChatML template, --enable-auto-tool-choice, --api-key), through
the official ``anthropic`` and ``ollama`` clients: plain, streamed, a tool round trip, error shapes.

A random model writes no tool call by itself: the Anthropic call is forced by a named
``tool_choice`` (the server's constraint); Ollama has no tool_choice, so its round trip sends the
assistant's call and the tool's answer back and checks the tools reach the prompt.
"""
from __future__ import annotations

import httpx
import pytest

from tests.e2e.test_server_e2e import ServerProcess

anthropic = pytest.importorskip("anthropic")
ollama = pytest.importorskip("ollama")

KEY = "sk-e2e"
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Lima"]}},
                  "required": ["city"], "additionalProperties": False}
A_TOOL = {"name": "get_weather", "description": "Current weather in a city", "input_schema": WEATHER_SCHEMA}
O_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER_SCHEMA}}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server():
    s = ServerProcess("--enable-auto-tool-choice", "--api-key", KEY)
    yield s
    assert s.stop() == 0, s.output()


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def oll(server):
    return ollama.Client(host=server.url, headers={"Authorization": f"Bearer {KEY}"})


# ---- Anthropic ------------------------------------------------------------------------------------


def test_anthropic_plain_and_streamed(claude):
    m = claude.messages.create(model="tiny", max_tokens=8, system="Be brief.", messages=USER,
                               extra_body={"temperature": 0})
    assert m.type == "message" and m.content[0].type == "text" and m.stop_reason == "max_tokens"
    assert m.usage.output_tokens == 8 and m.usage.input_tokens > 10
    with claude.messages.stream(model="tiny", max_tokens=8, system="Be brief.", messages=USER,
                                extra_body={"temperature": 0}) as stream:
        types = [event.type for event in stream]
        final = stream.get_final_message()
    assert final.content[0].text == m.content[0].text  # greedy: the same text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 8
    assert types[0] == "message_start" and "content_block_delta" in types and types[-1] == "message_stop"
    n = claude.messages.count_tokens(model="tiny", system="Be brief.", messages=USER)
    assert n.input_tokens == m.usage.input_tokens


def test_anthropic_tool_round_trip(claude):
    m = claude.messages.create(model="tiny", max_tokens=60, messages=USER, tools=[A_TOOL],
                               tool_choice={"type": "tool", "name": "get_weather"})
    assert m.stop_reason == "tool_use"
    use = m.content[-1]
    assert use.type == "tool_use" and use.name == "get_weather" and use.input["city"] in ("Paris", "Lima")
    m2 = claude.messages.create(model="tiny", max_tokens=6, tools=[A_TOOL], messages=[
        *USER, {"role": "assistant", "content": [use.model_dump()]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny, 21C"}]}])
    assert m2.content[0].type == "text" and m2.usage.input_tokens > m.usage.input_tokens
    with claude.messages.stream(model="tiny", max_tokens=60, messages=USER, tools=[A_TOOL],
                                tool_choice={"type": "any"}) as stream:
        deltas = [e.delta.type for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    # a random model may pad the constrained call with whitespace up to max_tokens: then the stop
    # reason says so (as Anthropic's), with the call begun
    assert "input_json_delta" in deltas and final.content[-1].type == "tool_use"
    assert final.stop_reason in ("tool_use", "max_tokens")


def test_anthropic_errors(server, claude):
    with pytest.raises(anthropic.NotFoundError) as e:
        claude.messages.create(model="nope", max_tokens=4, messages=USER)
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model="tiny", max_tokens=4, stop_sequences=["x"] * 300, messages=USER)
    assert "--max-stop-sequences" in e.value.body["error"]["message"]
    bad = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        bad.messages.create(model="tiny", max_tokens=4, messages=USER)
    assert e.value.body["error"]["type"] == "authentication_error"


# ---- Ollama ---------------------------------------------------------------------------------------


def test_ollama_chat_and_generate(oll):
    assert [m.model for m in oll.list().models] == ["tiny"]
    r = oll.chat(model="tiny", messages=USER, options={"temperature": 0, "num_predict": 8})
    assert r.done and r.done_reason == "length" and r.eval_count == 8 and r.prompt_eval_count > 10
    assert r.total_duration > 0 and r.eval_duration > 0
    parts = list(oll.chat(model="tiny", messages=USER, options={"temperature": 0, "num_predict": 8}, stream=True))
    assert parts[-1].done and "".join(p.message.content for p in parts) == r.message.content
    g = oll.generate(model="tiny:latest", prompt="What is the weather in Paris?",
                     options={"temperature": 0, "num_predict": 8})
    assert g.response == r.message.content  # the same conversation through the template
    j = oll.chat(model="tiny", messages=USER, format="json", options={"temperature": 0, "num_predict": 40})
    assert j.message.content.lstrip().startswith("{")
    assert oll.show("tiny").template and oll.embed(model="tiny", input=["a", "b"]).embeddings[1]


def test_ollama_tool_round_trip(oll):
    plain = oll.chat(model="tiny", messages=USER, options={"num_predict": 1})
    with_tools = oll.chat(model="tiny", messages=USER, tools=[O_TOOL], options={"num_predict": 1})
    assert with_tools.prompt_eval_count > plain.prompt_eval_count + 20  # the tools are in the prompt
    r = oll.chat(model="tiny", tools=[O_TOOL], options={"num_predict": 4}, messages=[
        *USER, {"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "Sunny, 21C", "tool_name": "get_weather"}])
    assert r.done and r.prompt_eval_count > with_tools.prompt_eval_count


def test_ollama_errors(server, oll):
    with pytest.raises(ollama.ResponseError) as e:
        oll.pull("llama3")
    assert e.value.status_code == 501
    with pytest.raises(ollama.ResponseError) as e:
        oll.chat(model="tiny", messages=[{"role": "user", "content": "x"}] * 3000)
    assert e.value.status_code == 400 and "--max-messages" in e.value.error
    r = httpx.get(server.url + "/api/tags")  # no key
    assert r.status_code == 401 and set(r.json()) == {"error"}
