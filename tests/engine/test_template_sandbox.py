"""A request's own chat template (issue 37 item 3): every way of building a value too large to
hold is refused with a ChatTemplateError (a 400) before it is built, fast, and ordinary templates
render exactly as in the model's sandbox. The hostile templates below froze a real server for
50 s (``7**30000000``), killed it (``'a' * 10**10``) or got a 500 (``range(10**9)``)."""
from __future__ import annotations

import time

import pytest

from pagedserve.engine.bounded_render import MAX_TEMPLATE_LINES, _render_bounded
from pagedserve.engine.tokenizer import ChatTemplateError, Tokenizer
from tests.app.test_tool_prompt import QWEN_LIKE

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "",
             "tool_calls": [{"id": "c1", "type": "function",
                             "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny, 24 C"},
            {"role": "assistant", "content": "Sunny and 24 C."}, {"role": "user", "content": "Thanks!"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}}, "required": ["city"]}}}]

LLAMA_LIKE = r"""{{- bos_token }}
{%- set date_string = strftime_now("%d %b %Y") if strftime_now is defined else "26 Jul 2024" %}
{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content']|trim %}{%- set messages = messages[1:] %}
{%- else %}{%- set system_message = "" %}{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{{- "Today Date: 26 Jul 2024\n\n" }}
{%- if tools is not none %}{{- "You have tools:\n" }}{%- for t in tools %}{{- t | tojson(indent=4) }}{{- "\n\n" }}{%- endfor %}{%- endif %}
{{- system_message }}{{- "<|eot_id|>" }}
{%- set ns = namespace(count=0, names=[]) %}
{%- for message in messages %}
    {%- set ns.count = ns.count + 1 %}
    {%- if message.tool_calls %}
        {%- for call in message.tool_calls %}{%- set ns.names = ns.names + [call.function.name] %}
            {{- '<|python_tag|>{"name": "' + call.function.name + '", "parameters": ' + call.function.arguments | tojson + '}' }}
        {%- endfor %}
    {%- else %}
        {{- '<|start_header_id|>' ~ message['role'] ~ '<|end_header_id|>\n\n' ~ message['content'] | trim ~ '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- for k, v in {"calls": ns.names|length, "turns": ns.count}.items() %}{{ "%s=%d;" % (k, v) }}{% endfor %}
{%- macro box(text, width=3) %}[{{ text|center(width) }}]{% endmacro %}{{ box("x") }}
{%- set footer %}{{ "{}/{}".format(ns.count, messages|length) }}{{ (("ab",) * 2)|join("-") }}{% endset %}{{ footer|upper }}
{%- if messages[-1].content|length > 100000 %}{{ raise_exception("too long") }}{%- endif %}
{{- messages|map(attribute='role')|select('equalto', 'user')|list|join(',') }}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}"""


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_model(None)


def _plain(tok, template, **kw):
    """The same template rendered in the model's sandbox (the unbounded one)."""
    from pagedserve.engine.tokenizer import _compile_template

    return _compile_template(template).render(messages=MESSAGES, bos_token=tok.bos_token,
                                              add_generation_prompt=True, **kw)


@pytest.mark.parametrize("name", ["model", "qwen_like", "llama_like"])
def test_ordinary_templates_render_exactly_as_before(tok, name):
    template = {"model": tok.chat_template, "qwen_like": QWEN_LIKE, "llama_like": LLAMA_LIKE}[name]
    messages = [dict(m) for m in MESSAGES]
    for m in messages:
        if "tool_calls" in m and name == "llama_like":
            m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": '{"city": "Paris"}'}}
                               for c in m["tool_calls"]]
    ours = tok.apply_chat_template(messages, chat_template=template, tools=TOOLS)
    from pagedserve.engine.tokenizer import _compile_template

    plain = _compile_template(template).render(messages=messages, add_generation_prompt=True, tools=TOOLS,
                                               documents=None, bos_token=tok.bos_token,
                                               eos_token=tok.eos_token, **({"unk_token": tok.unk_token}
                                                                           if tok.unk_token else {}))
    assert ours == plain and len(ours) > 100


HOSTILE = {
    "power": "{{ (7**30000000) % 10 }}",  # one C operation of ~50 s
    "repeat": "{{ 'a' * 10**10 }}",  # 40 GB
    "range": "{{ range(10**9)|list|length }}",  # the sandbox's OverflowError: was a 500
    "squaring": "{% set ns = namespace(x=3) %}{% for i in range(40) %}{% set ns.x = ns.x * ns.x %}{% endfor %}{{ ns.x }}",
    "doubling concat": "{% set ns = namespace(x='ab') %}{% for i in range(60) %}{% set ns.x = ns.x ~ ns.x %}"
                       "{% endfor %}{{ ns.x|length }}",
    "doubling plus": "{% set ns = namespace(x=[0]) %}{% for i in range(60) %}{% set ns.x = ns.x + ns.x %}"
                     "{% endfor %}{{ ns.x|length }}",
    "shared doubling": "{% set ns = namespace(x=[1]) %}{% for i in range(80) %}{% set ns.x = [ns.x, ns.x] %}"
                       "{% endfor %}{{ ns.x }}",  # small in memory, exponential as text
    "center": "{{ 'a'|center(10**9) }}",
    "ljust": "{{ 'a'.ljust(10**9) }}",
    "percent width": "{{ '%0999999999d' % 1 }}",
    "format width": "{{ '{:>999999999}'.format(1) }}",
    "replace": "{{ ('x' * 1000000)|replace('', 'y' * 1000000) }}",
    "join": "{{ range(100000)|join('x' * 100000) }}",
    "indent": "{{ ('a\n' * 1000000)|indent('x' * 1000) }}",
    "batch": "{{ [1]|batch(10**8, 'x')|list }}",
    "list repeat": "{{ (range(100000)|list) * 100 }}",
    "lipsum": "{{ lipsum(10**9) }}",
    "recursion": "{% macro m(n) %}{{ m(n + 1) }}{% endmacro %}{{ m(0) }}",
    "zero division": "{{ 1 / 0 }}",
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_hostile_template_is_a_chat_template_error_at_once(tok, name):
    t0 = time.monotonic()
    with pytest.raises(ChatTemplateError, match="chat template error"):
        _render_bounded(lambda: tok.apply_chat_template(MESSAGES, chat_template=HOSTILE[name]), 30.0,
                        MAX_TEMPLATE_LINES)
    assert time.monotonic() - t0 < 2.0


def test_nested_loops_stop_at_the_statement_cap_whatever_the_deadline(tok):
    nested = "{% for a in range(100000) %}{% for b in range(100000) %}{{ a }}{% endfor %}{% endfor %}"
    t0 = time.monotonic()
    with pytest.raises(ChatTemplateError, match="statements"):
        _render_bounded(lambda: tok.apply_chat_template(MESSAGES, chat_template=nested), None, 100_000)
    assert time.monotonic() - t0 < 5.0


def test_the_rendered_prompt_is_bounded(tok):
    from pagedserve.engine.template_sandbox import MAX_SIZE

    many = "{% for i in range(100) %}{{ messages[0].content }}{% endfor %}"
    big = [{"role": "user", "content": "x" * (MAX_SIZE // 50)}]
    with pytest.raises(ChatTemplateError, match="would build a text"):
        tok.apply_chat_template(big, chat_template=many)
    assert len(tok.apply_chat_template(big, chat_template=many.replace("100", "10"))) == 10 * (MAX_SIZE // 50)


def test_the_models_template_keeps_jinjas_own_sandbox(tok):
    """Only a request's template is bounded: the model's renders as it always did."""
    from pagedserve.engine.tokenizer import _compile_template

    assert type(_compile_template(tok.chat_template).environment).__name__ == "ImmutableSandboxedEnvironment"
