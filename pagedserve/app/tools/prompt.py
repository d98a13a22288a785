"""Tools and tool-call turns in the prompt.

A chat template that knows tools (it reads the jinja variable ``tools``) gets them as that
variable, and assistant ``tool_calls`` / ``tool`` messages as they are (arguments decoded to
objects, as vLLM and transformers pass them). A template that does not (the default model's
ChatML template) gets the tools as ``DEFAULT_TOOL_PROMPT`` appended to the system message, and
the tool-call turns written the way that prompt asks for them (Hermes style):
assistant calls as ``<tool_call>{...}</tool_call>`` text, tool results as a user turn of
``<tool_response>...</tool_response>`` blocks.
"""
from __future__ import annotations

import functools
import json
from typing import Any

DEFAULT_TOOL_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


@functools.lru_cache(maxsize=8)
def template_knows_tools(source: str | None) -> bool:
    """Does the chat template read the ``tools`` variable? None (a template we cannot see, e.g.
    an engine stand-in) is trusted to. Parsing takes time linear in the template (a request's
    own: call it off the event loop) and evaluates nothing (engine.tokenizer.template_variables)."""
    if source is None:
        return True
    if "tools" not in source:
        return False
    import jinja2

    from pagedserve.engine.tokenizer import template_variables

    try:
        return "tools" in template_variables(source)
    except jinja2.TemplateSyntaxError:
        return True


def default_tool_prompt(tools: list[dict]) -> str:
    return DEFAULT_TOOL_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))


def _arguments_object(arguments: str) -> Any:
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    return value if isinstance(value, dict) else arguments


def template_messages(messages: list[Any], native: bool) -> list[dict[str, Any]]:
    """The request's messages (app.protocol.ChatMessage) as the template gets them."""
    out: list[dict[str, Any]] = []
    for m in messages:
        role = "system" if m.role == "developer" else m.role
        msg: dict[str, Any] = {"role": role, "content": m.text()}
        if m.name:
            msg["name"] = m.name
        if m.tool_calls and role == "assistant":
            if native:
                if m.content is None:
                    msg["content"] = None
                msg["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                    "name": c.function.name, "arguments": _arguments_object(c.function.arguments)}}
                    for c in m.tool_calls]
            else:
                blocks = [_hermes_call(c.function.name, c.function.arguments) for c in m.tool_calls]
                msg["content"] = "\n".join(([msg["content"]] if msg["content"] else []) + blocks)
        if role == "tool":
            if native:
                if m.tool_call_id is not None:
                    msg["tool_call_id"] = m.tool_call_id
            else:
                # A run of tool results is one user turn; its blocks are joined once, at the end
                # (appending to the turn's text each time was quadratic in the run's length).
                response = _tool_response(msg["content"])
                if out and "_tool_responses" in out[-1]:
                    out[-1]["_tool_responses"].append(response)
                else:
                    out.append({"role": "user", "content": None, "_tool_responses": [response]})
                continue
        out.append(msg)
    for msg in out:
        blocks = msg.pop("_tool_responses", None)
        if blocks is not None:
            msg["content"] = _join_tool_responses(blocks)
    return out


def _tool_response(content: str) -> str:
    """One tool result as the Hermes-style block the default template shows."""
    return f"<tool_response>\n{content}\n</tool_response>"


def _join_tool_responses(blocks: list[str]) -> str:
    """A run of tool results as one user turn's text: one join, once the run is complete."""
    return "\n".join(blocks)


def _hermes_call(name: str, arguments: str) -> str:
    args = _arguments_object(arguments)
    body = json.dumps({"name": name, "arguments": args}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


def with_default_tool_prompt(messages: list[dict[str, Any]], tools: list[dict]) -> list[dict[str, Any]]:
    """The tools described in the system message (appended to the first one, or a new one)."""
    prompt = default_tool_prompt(tools)
    if messages and messages[0]["role"] == "system":
        first = dict(messages[0])
        first["content"] = (first["content"] + "\n\n" if first["content"] else "") + prompt
        return [first, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]
