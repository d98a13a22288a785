"""The mistral, pythonic and qwen3_coder tool parsers, each on its model family's format: whole,
streamed character by character and in random pieces (the pieces reassemble to the whole parse),
malformed replies back as content, parallel_tool_calls false."""
from __future__ import annotations

import json

import pytest

from pagedserve.app.tools.parsers import AUTO_PARSERS
from pagedserve.app.tools.output import full_message
from pagedserve.app.tools.plan import ToolConfig, ToolPlan
from pagedserve.app.tools.pythonic_parser import parse_calls
from pagedserve.app.tools.qwen3_coder_parser import convert
from tests.app.test_tool_parsers import chars, random_pieces, stream, whole

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
    "extra": {"type": "object"}, "zip": {"type": "string"}}}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {
             "tz": {"type": "string"}}}}}]
WEATHER = {"city": "Paris", "days": 3}
TIME = {"tz": "CET"}

FORMATS = {
    "mistral": [  # tokenizer v3: a JSON array; v11: name[ARGS]{...} per call
        ('Let me look. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, '
         '{"name": "get_time", "arguments": {"tz": "CET"}}]', "Let me look. "),
        ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}[TOOL_CALLS]get_time[ARGS]{"tz": "CET"}', ""),
        ('[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Paris", "days": 3}'
         '[TOOL_CALLS]get_time[CALL_ID]x9[ARGS]{"tz": "CET"}', ""),
    ],
    "pythonic": [
        ('[get_weather(city="Paris", days=3), get_time(tz=\'CET\')]', ""),
        ('<|python_start|>[get_weather(city="Paris", days=3), get_time(tz="CET")]<|python_end|>', ""),
    ],
    "qwen3_coder": [
        ("Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
         "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n"
         "<parameter=tz>\nCET\n</parameter>\n</function>\n</tool_call>", "Checking.\n"),
    ],
}
CASES = [(name, text, content) for name, texts in FORMATS.items() for text, content in texts]


def new(name, **kw):
    return AUTO_PARSERS[name](tools=TOOLS, **kw)


@pytest.mark.parametrize("name, text, content", CASES)
def test_calls_whole_and_streamed_agree(name, text, content):
    got_content, calls = whole(new(name), text)
    assert got_content == content
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather", WEATHER), ("get_time", TIME)]
    for pieces in [chars(text), *(random_pieces(text, seed) for seed in range(5))]:
        s_content, s_calls, _ = stream(new(name), pieces)
        assert (s_content, s_calls) == (got_content, calls), pieces


@pytest.mark.parametrize("name, text, content", CASES)
def test_parallel_tool_calls_false_keeps_the_first(name, text, content):
    _, calls = whole(new(name, max_calls=1), text)
    assert [c["name"] for c in calls] == ["get_weather"]


@pytest.mark.parametrize("name, text", [
    ("mistral", "No tools needed: the answer is 4."),
    ("pythonic", "The answer is [4]."),
    ("qwen3_coder", "Plain <b>answer</b> with a < sign."),
])
def test_replies_without_calls_are_content(name, text):
    assert whole(new(name), text) == (text, [])
    assert stream(new(name), chars(text))[:2] == (text, [])


@pytest.mark.parametrize("name, text", [
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": }}]'),
    ("pythonic", "[get_weather(city=open('/etc/passwd'))]"),
    ("pythonic", "[get_weather('Paris')]"),
    ("pythonic", '[get_weather(city="Paris"'),
    ("pythonic", "[get_weather(city={'Paris', 'Lyon'})]"),  # a set has no JSON form (was a TypeError)
    ("pythonic", "[get_weather(city=b'Paris', days=1j)]"),
    ("qwen3_coder", "<tool_call>\n<oops>\n</tool_call>"),
])
def test_malformed_calls_come_back_as_content(name, text):
    parser = new(name)
    whole(parser, text)
    assert parser.failed
    plan = ToolPlan(mode="auto", tools=TOOLS, parser_name=name)  # the non-streamed answer: all content
    assert full_message(plan, text, "stop") == ({"role": "assistant", "content": text}, "stop")


def test_qwen3_coder_values_follow_the_schema():
    text = ("<tool_call>\n<function=get_weather>\n<parameter=city>\n007\n</parameter>\n<parameter=zip>\n"
            "75001\n</parameter>\n<parameter=days>\n2\n</parameter>\n<parameter=metric>\nTrue\n</parameter>\n"
            "<parameter=extra>\n{'a': [1, 2]}\n</parameter>\n<parameter=unknown>\n[1, 2]\n</parameter>\n"
            "</function>\n</tool_call>")
    _, calls = whole(new("qwen3_coder"), text)
    assert json.loads(calls[0]["arguments"]) == {"city": "007", "zip": "75001", "days": 2, "metric": True,
                                                 "extra": {"a": [1, 2]}, "unknown": [1, 2]}
    assert convert("\nline one\nline two\n", {"type": "string"}) == "line one\nline two"
    _, calls = whole(new("qwen3_coder"), "<tool_call><function=get_time></function></tool_call>")
    assert calls == [{"name": "get_time", "arguments": "{}"}]


def test_pythonic_literals():
    assert parse_calls('[f(a=[1, {"b": None}], c=true, d=-2.5)]') == [("f", '{"a": [1, {"b": null}], "c": true, "d": -2.5}')]
    assert parse_calls("[ns.f()]") == [("ns.f", "{}")]


def test_template_markers_choose_the_parser():
    cfg = ToolConfig()
    assert cfg.parser_name("... <tool_call>\n<function=name>\n<parameter=...") == "qwen3_coder"
    assert cfg.parser_name("{{ '[TOOL_CALLS]' }}") == "mistral"
    assert cfg.parser_name("<tool_call>{{ tool_call | tojson }}</tool_call>") == "hermes"


async def test_chosen_by_the_flag_on_chat_streamed_and_not():
    import httpx
    import openai

    from pagedserve.app.server import build_app
    from tests.app.fake_engine import FakeAsyncEngine

    text, content = FORMATS["qwen3_coder"][0]
    engine = FakeAsyncEngine(reply=text, max_model_len=4096)
    app = build_app(engine, served_model_name="fake-model",
                    tool_config=ToolConfig(enable_auto_tool_choice=True, tool_call_parser="qwen3_coder"))
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")
    client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="x", http_client=http, max_retries=0)
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    r = await client.chat.completions.create(model="fake-model", messages=messages, tools=TOOLS)
    msg = r.choices[0].message
    assert msg.content == content and r.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == [
        ("get_weather", WEATHER), ("get_time", TIME)]
    args: dict[int, str] = {}
    async for chunk in await client.chat.completions.create(model="fake-model", messages=messages, tools=TOOLS,
                                                            stream=True):
        for tc in chunk.choices[0].delta.tool_calls or []:
            args[tc.index] = args.get(tc.index, "") + (tc.function.arguments or "")
    assert [args[i] for i in sorted(args)] == [c.function.arguments for c in msg.tool_calls]
