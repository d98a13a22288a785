"""Tool turns in real chat templates (engine.tokenizer): a template that knows tools gets them
natively; the default model's template gets the same text written out by app/tools/prompt.py."""
from __future__ import annotations

import pytest

from pagedserve.app.protocol import ChatCompletionRequest
from pagedserve.app.tools.prompt import template_knows_tools, template_messages, with_default_tool_prompt

# Qwen 2.5's chat template (tools part), trimmed to what this test uses.
QWEN_LIKE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}{%- else %}{{- 'You are Qwen.' }}{%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}{{- "\n" }}{{- tool | tojson }}{%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}{{- '\n' + message.content }}{%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}{{- tool_call.name }}{{- '", "arguments": ' }}{{- tool_call.arguments | tojson }}{{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\n<tool_response>\n' }}{{- message.content }}{{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}{{- '<|im_end|>\n' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"""

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and Lima?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "b", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Lima"}'}}]},
    {"role": "tool", "tool_call_id": "a", "content": "21 C"},
    {"role": "tool", "tool_call_id": "b", "content": "18 C"},
]


@pytest.fixture(scope="module")
def tokenizer():
    from pagedserve.engine.tokenizer import Tokenizer

    return Tokenizer.from_model()


def messages():
    return ChatCompletionRequest.model_validate({"messages": CONVERSATION}).messages


def test_template_detection(tokenizer):
    assert template_knows_tools(QWEN_LIKE) and not template_knows_tools(tokenizer.chat_template)


def test_written_out_turns_match_what_a_tools_template_renders(tokenizer):
    tokenizer_qwen = _with_template(tokenizer, QWEN_LIKE)
    native = tokenizer_qwen.apply_chat_template(template_messages(messages(), native=True), tools=TOOLS)
    written = tokenizer.apply_chat_template(with_default_tool_prompt(template_messages(messages(), native=False),
                                                                     TOOLS))
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n' in native
    assert native == written  # the default tool prompt is Qwen 2.5's, byte for byte
    assert "<|im_start|>user\n<tool_response>\n21 C\n</tool_response>\n<tool_response>\n18 C\n" in written


def _with_template(tokenizer, source):
    import copy

    t = copy.copy(tokenizer)
    t.chat_template = source
    return t


def test_many_tool_results_are_merged_in_linear_time(monkeypatch):
    # Each tool result was appended with out[-1]["content"] += ...: 10,000 results of 200
    # characters copied ~10 GB on the event loop. Linear, counted: each result is made into its
    # block once, and the turn's text is the one join of the whole run (no copy of it after).
    from pagedserve.app.tools import prompt

    raw = [{"role": "user", "content": "go"}] + [
        {"role": "tool", "tool_call_id": str(i), "content": f"{i:06d}" + "r" * 194} for i in range(10_000)]
    msgs = ChatCompletionRequest.model_validate({"messages": raw}).messages
    made, joins = [], []
    real_block, real_join = prompt._tool_response, prompt._join_tool_responses
    monkeypatch.setattr(prompt, "_tool_response", lambda c: made.append(c) or real_block(c))

    def join(blocks):
        joins.append((len(blocks), real_join(blocks)))
        return joins[-1][1]

    monkeypatch.setattr(prompt, "_join_tool_responses", join)
    out = template_messages(msgs, native=False)
    assert len(made) == 10_000 and [n for n, _ in joins] == [10_000]
    assert out[1]["content"] is joins[0][1]
    assert len(out) == 2 and out[1]["role"] == "user"
    blocks = out[1]["content"].split("\n<tool_response>\n")
    assert len(blocks) == 10_000 and blocks[0].startswith("<tool_response>\n000000")
    assert out[1]["content"].endswith(f"009999{'r' * 194}\n</tool_response>")
    # a turn between them starts a new block
    msgs = ChatCompletionRequest.model_validate({"messages": [
        raw[1], raw[2], {"role": "assistant", "content": "ok"}, raw[3]]}).messages
    out = template_messages(msgs, native=False)
    assert [m["role"] for m in out] == ["user", "assistant", "user"]
    assert out[0]["content"].count("<tool_response>") == 2 and "_tool_responses" not in out[0]
