"""An Anthropic Messages request as the chat completions body it means.

``system`` (a string or text blocks) becomes a system message; each message's content blocks
become chat messages: ``text`` blocks join into the message's text, an assistant's ``tool_use``
blocks become its ``tool_calls`` (arguments as JSON text), a user's ``tool_result`` blocks become
``tool`` messages (ahead of the user's own text, in order); earlier ``thinking`` blocks are left
out of the prompt, as the reasoning models' templates drop earlier turns' thinking. Tools
(``input_schema``) become function tools; ``tool_choice`` auto / any / tool / none becomes
"auto" / "required" / the named function / "none". Anything the server cannot serve (images,
documents, server tools) is a 400 naming it, never dropped silently.
"""
from __future__ import annotations

from typing import Any

import orjson

from pagedserve.app.errors import APIError

_SAMPLING = ("temperature", "top_p", "top_k")
# Fields that would ask for what this server does not run: a 400 naming them when set.
_REFUSED = ("container", "mcp_servers")
# metadata, service_tier, cache_control (the prefix cache is automatic), speed, inference_geo,
# diagnostics change nothing here: accepted, not used; context_management (the API's clearing of old
# tool results as the context fills) is not done: the conversation is rendered whole, as sent.


def bad(message: str, param: str | None = None) -> APIError:
    return APIError.bad_request(message, param=param)


def _obj(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise bad(f"{where}: expected an object", where)
    return value


def block_text(blocks: Any, where: str) -> str:
    """A string, or a list of text blocks, as one text."""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise bad(f"{where}: expected a string or a list of text blocks", where)
    parts = []
    for i, block in enumerate(blocks):
        block = _obj(block, f"{where}.{i}")
        if block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise bad(f"{where}.{i}: content blocks of type {block.get('type')!r} are not supported here by this "
                      "server (only text blocks)", f"{where}.{i}")
        parts.append(block["text"])
    return "".join(parts)


def chat_body(data: Any) -> dict[str, Any]:
    """The chat completions body (validated again as a ChatCompletionRequest)."""
    data = _obj(data, "body")
    max_tokens = data.get("max_tokens")
    if max_tokens is None:
        raise bad("max_tokens: Field required", "max_tokens")
    for name in _REFUSED:
        if data.get(name):
            raise bad(f"{name} is not supported by this server", name)
    body: dict[str, Any] = {"messages": messages(data), "max_tokens": max_tokens}
    if body["messages"][-1]["role"] == "assistant":  # Anthropic's prefill: the reply goes on from it
        body["add_generation_prompt"] = False
        body["continue_final_message"] = True
    if data.get("model") is not None:
        body["model"] = data["model"]
    for name in _SAMPLING:
        if data.get(name) is not None:
            body[name] = data[name]
    stop = data.get("stop_sequences")
    if stop is not None:
        if not isinstance(stop, list):
            raise bad("stop_sequences: expected a list of strings", "stop_sequences")
        if stop:
            body["stop"] = stop
    tools = data.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise bad("tools: expected a list", "tools")
        if tools:
            body["tools"] = [chat_tool(i, t) for i, t in enumerate(tools)]
    choice = data.get("tool_choice")
    if choice is not None:
        choice = _obj(choice, "tool_choice")
        kind = choice.get("type")
        if kind == "auto":
            body["tool_choice"] = "auto"
        elif kind == "any":
            body["tool_choice"] = "required"
        elif kind == "none":
            body["tool_choice"] = "none"
        elif kind == "tool":
            if not isinstance(choice.get("name"), str):
                raise bad("tool_choice of type 'tool' needs 'name'", "tool_choice.name")
            body["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
        else:
            raise bad(f"tool_choice.type must be one of auto, any, tool, none; got {kind!r}", "tool_choice.type")
        if choice.get("disable_parallel_tool_use") is True and kind != "none" and "tools" in body:
            body["parallel_tool_calls"] = False
    output = data.get("output_config")
    if output is not None:
        output = _obj(output, "output_config")
        fmt = output.get("format")
        if fmt is not None:
            fmt = _obj(fmt, "output_config.format")
            if fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
                raise bad("output_config.format must be {\"type\": \"json_schema\", \"schema\": {...}}",
                          "output_config.format")
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}
        if output.get("effort") is not None:
            body["reasoning_effort"] = output["effort"]
    thinking = data.get("thinking")
    if thinking is not None:
        kind = _obj(thinking, "thinking").get("type")
        if kind not in ("enabled", "disabled", "adaptive"):
            raise bad(f"thinking.type must be 'enabled' or 'disabled', got {kind!r}", "thinking.type")
        # the templates of the thinking models read enable_thinking (Qwen3, SmolLM3, ...)
        body["chat_template_kwargs"] = {"enable_thinking": kind != "disabled"}
    return body


def messages(data: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    system = data.get("system")
    if system is not None:
        text = block_text(system, "system")
        if text:
            out.append({"role": "system", "content": text})
    given = data.get("messages")
    if not isinstance(given, list) or not given:
        raise bad("messages: expected a non-empty list of messages", "messages")
    for i, message in enumerate(given):
        where = f"messages.{i}"
        message = _obj(message, where)
        role = message.get("role")
        if role not in ("user", "assistant"):
            raise bad(f"{where}.role: expected 'user' or 'assistant', got {role!r}", f"{where}.role")
        content = message.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise bad(f"{where}.content: expected a string or a list of content blocks", f"{where}.content")
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        results = 0
        for j, block in enumerate(content):
            at = f"{where}.content.{j}"
            block = _obj(block, at)
            kind = block.get("type")
            if kind == "text" and isinstance(block.get("text"), str):
                texts.append(block["text"])
            elif kind in ("thinking", "redacted_thinking") and role == "assistant":
                continue  # an earlier turn's thinking: not part of the prompt
            elif kind == "tool_use" and role == "assistant":
                if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                    raise bad(f"{at}: a tool_use block needs 'id' and 'name'", at)
                args = block.get("input") if block.get("input") is not None else {}
                calls.append({"id": block["id"], "type": "function",
                              "function": {"name": block["name"], "arguments": orjson.dumps(args).decode()}})
            elif kind == "tool_result" and role == "user":
                if not isinstance(block.get("tool_use_id"), str):
                    raise bad(f"{at}: a tool_result block needs 'tool_use_id'", f"{at}.tool_use_id")
                result = block.get("content")
                text = "" if result is None else block_text(result, f"{at}.content")
                if block.get("is_error") is True:
                    text = f"Error: {text}"
                out.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": text})
                results += 1
            else:
                raise bad(f"{at}: content blocks of type {kind!r} are not supported in a {role} message by "
                          "this server (text, tool_use, tool_result and thinking are)", f"{at}.type")
        if role == "assistant":
            msg: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or (None if calls else "")}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
        elif texts or not results:
            out.append({"role": "user", "content": "".join(texts)})
    return out


def chat_tool(i: int, tool: Any) -> dict[str, Any]:
    tool = _obj(tool, f"tools.{i}")
    kind = tool.get("type")
    if kind not in (None, "custom"):
        raise bad(f"tools.{i}: tools of type {kind!r} are not supported by this server (only client tools with "
                  "an input_schema: the server runs no built-in tools)", f"tools.{i}.type")
    if not isinstance(tool.get("name"), str) or not tool["name"]:
        raise bad(f"tools.{i}: a tool needs a name", f"tools.{i}.name")
    fn: dict[str, Any] = {"name": tool["name"],
                          "parameters": tool.get("input_schema") or {"type": "object", "properties": {}}}
    if tool.get("description") is not None:
        fn["description"] = tool["description"]
    return {"type": "function", "function": fn}
