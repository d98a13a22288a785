"""--reasoning-parser on /v1/chat/completions against the fake engine (one byte per token, so every
tag is split across tokens), read with the official openai client."""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from pagedserve.app.server import build_app
from pagedserve.app.tools.plan import ToolConfig
from tests.app.fake_engine import FakeAsyncEngine

USER = [{"role": "user", "content": "What is 2 + 2?"}]
REPLY = "<think>Let me think: 2 + 2 = 4.</think>\n\nThe answer is 4."
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


class ThinkingEngine(FakeAsyncEngine):
    """Renders as a Qwen3 template does: ``enable_thinking: false`` closes an empty think block in
    the prompt; ``open_think`` (a DeepSeek-R1-style template) opens one."""

    open_think = False

    async def render_chat(self, messages, add_generation_prompt=True, continue_final_message=False, **kw):
        text = await super().render_chat(messages, add_generation_prompt, continue_final_message, **kw)
        if kw.get("enable_thinking") is False:
            return text + "<think>\n\n</think>\n\n"
        return text + ("<think>\n" if self.open_think else "")


def make(reply: str = REPLY, parser: str | None = "qwen3", open_think: bool = False):
    engine = ThinkingEngine(reply=reply, max_model_len=4096)
    engine.open_think = open_think
    app = build_app(engine, served_model_name="fake-model", max_body_bytes=1 << 20,
                    tool_config=ToolConfig(enable_auto_tool_choice=True), reasoning_parser=parser)
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")
    client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="x", http_client=http, max_retries=0)
    return engine, http, client


async def streamed(client, **kw) -> tuple[str, str, str, dict, str | None]:
    stream = await client.chat.completions.create(model="fake-model", stream=True, **kw)
    reasoning, reasoning_new, content, calls, finish = "", "", "", {}, None
    async for chunk in stream:
        for ch in chunk.choices:
            extra = ch.delta.model_extra or {}
            reasoning += extra.get("reasoning_content") or ""
            reasoning_new += extra.get("reasoning") or ""
            content += ch.delta.content or ""
            for tc in ch.delta.tool_calls or []:
                calls.setdefault(tc.index, {"name": tc.function.name, "arguments": ""})
                calls[tc.index]["arguments"] += tc.function.arguments or ""
            finish = ch.finish_reason or finish
    return reasoning, reasoning_new, content, calls, finish


async def test_reasoning_apart_from_the_answer():
    _, _, client = make()
    r = await client.chat.completions.create(model="fake-model", messages=USER)
    msg = r.choices[0].message
    assert msg.model_extra["reasoning_content"] == msg.model_extra["reasoning"] == "Let me think: 2 + 2 = 4."
    assert msg.content == "\n\nThe answer is 4."
    reasoning, reasoning_new, content, _, finish = await streamed(client, messages=USER)
    assert reasoning == reasoning_new == "Let me think: 2 + 2 = 4."
    assert content == "\n\nThe answer is 4." and finish == "stop"


async def test_without_the_parser_the_reply_is_content_as_before():
    _, http, _ = make(parser=None)
    body = (await http.post("/v1/chat/completions", json={"messages": USER})).json()
    assert body["choices"][0]["message"] == {"role": "assistant", "content": REPLY}


async def test_include_reasoning_false_leaves_it_out():
    _, http, _ = make()
    body = (await http.post("/v1/chat/completions", json={"messages": USER, "include_reasoning": False})).json()
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "\n\nThe answer is 4."}


async def test_deepseek_r1_reply_starts_inside_the_thinking_the_template_opened():
    engine, _, client = make(reply="Hmm, 4.</think>It is 4.", parser="deepseek_r1", open_think=True)
    r = await client.chat.completions.create(model="fake-model", messages=USER)
    assert r.choices[0].message.model_extra["reasoning_content"] == "Hmm, 4."
    assert r.choices[0].message.content == "It is 4."
    reasoning, _, content, _, _ = await streamed(client, messages=USER)
    assert (reasoning, content) == ("Hmm, 4.", "It is 4.")


async def test_enable_thinking_reaches_the_template_and_closes_the_reasoning():
    engine, _, client = make(reply="a </think> b")
    r = await client.chat.completions.create(model="fake-model", messages=USER,
                                             extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert engine.template_kwargs[-1]["enable_thinking"] is False
    assert r.choices[0].message.content == "a </think> b"
    assert "reasoning_content" not in (r.choices[0].message.model_extra or {})


async def test_tool_calls_come_from_the_answer_only():
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    reply = f"<think>Maybe {call} later.</think>{call}"
    _, _, client = make(reply=reply)
    r = await client.chat.completions.create(model="fake-model", messages=USER, tools=[WEATHER])
    msg = r.choices[0].message
    assert msg.model_extra["reasoning_content"] == f"Maybe {call} later."
    (tc,) = msg.tool_calls
    assert tc.function.name == "get_weather" and json.loads(tc.function.arguments) == {"city": "Paris"}
    assert r.choices[0].finish_reason == "tool_calls" and msg.content is None
    reasoning, _, content, calls, finish = await streamed(client, messages=USER, tools=[WEATHER])
    assert reasoning == f"Maybe {call} later." and content == ""
    assert calls == {0: {"name": "get_weather", "arguments": tc.function.arguments}} and finish == "tool_calls"


@pytest.mark.parametrize("extra", [
    {"response_format": {"type": "json_object"}},
    {"structured_outputs": {"regex": "[0-9]+"}},
    {"tools": [WEATHER], "tool_choice": "required"},
])
async def test_a_grammar_binds_the_answer_after_the_thinking(extra):
    engine, http, _ = make()
    r = await http.post("/v1/chat/completions", json={"messages": USER, **extra})
    assert r.status_code == 200, r.text
    assert engine.calls[-1].params.structured_outputs.start_after == "</think>"
    # thinking off: the prompt closed it, the grammar binds from the first token
    r = await http.post("/v1/chat/completions", json={
        "messages": USER, **extra, "chat_template_kwargs": {"enable_thinking": False}})
    assert r.status_code == 200, r.text
    assert engine.calls[-1].params.structured_outputs.start_after is None


async def test_without_the_parser_a_grammar_binds_from_the_start():
    engine, http, _ = make(parser=None)
    r = await http.post("/v1/chat/completions", json={"messages": USER, "response_format": {"type": "json_object"}})
    assert r.status_code == 200 and engine.calls[-1].params.structured_outputs.start_after is None


async def test_a_required_call_after_the_thinking():
    reply = '<think>I need the weather.</think>[{"name": "get_weather", "parameters": {"city": "Paris"}}]'
    _, _, client = make(reply=reply)
    r = await client.chat.completions.create(model="fake-model", messages=USER, tools=[WEATHER],
                                             tool_choice="required")
    msg = r.choices[0].message
    assert msg.model_extra["reasoning_content"] == "I need the weather."
    (tc,) = msg.tool_calls
    assert tc.function.name == "get_weather" and json.loads(tc.function.arguments) == {"city": "Paris"}


def test_an_unknown_parser_is_refused_at_build():
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        build_app(FakeAsyncEngine(), reasoning_parser="nope")
