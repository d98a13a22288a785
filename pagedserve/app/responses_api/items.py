"""A Responses API request as the chat request it means: ``instructions`` and ``input`` items to chat
messages, flat function tools to chat tools, ``text.format`` to ``response_format``. The chat
route then serves it (same template, tool prompt, parsers, sampling and engine path).

Items: a message (``role`` user / system / developer / assistant; ``content`` a string or
``input_text`` / ``output_text`` parts); ``function_call`` (joins the assistant turn before it, as
the chat API's ``tool_calls``); ``function_call_output`` (a ``tool`` message); ``reasoning`` items
of an earlier response are left out of the prompt, as the reasoning models' templates drop
earlier turns' thinking. Anything else is a 400 naming the item.
"""
from __future__ import annotations

from typing import Any

from pagedserve.app.errors import APIError
from pagedserve.app.responses_api.protocol import ResponsesContentPart, ResponsesRequest

_TEXT_PARTS = ("input_text", "output_text", "text")
_ROLES = ("user", "system", "developer", "assistant")
# A chat field named in an error, as the Responses request names it.
PARAM_NAMES = {"max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
               "messages": "input", "response_format": "text.format", "reasoning_effort": "reasoning.effort"}


def chat_body(req: ResponsesRequest) -> dict[str, Any]:
    """The chat completions body this request means (validated again as a ChatCompletionRequest)."""
    body: dict[str, Any] = {"messages": messages(req)}
    if req.model is not None:
        body["model"] = req.model
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed", "cache_salt",
                 "request_id", "chat_template_kwargs", "parallel_tool_calls", "user"):
        value = getattr(req, name)
        if value is not None:
            body[name] = value
    body["priority"] = req.priority
    if req.max_output_tokens is not None:
        body["max_completion_tokens"] = req.max_output_tokens
    if req.tools:
        body["tools"] = [chat_tool(i, t) for i, t in enumerate(req.tools)]
    if req.tool_choice is not None:
        body["tool_choice"] = chat_tool_choice(req.tool_choice)
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type == "json_object":
        body["response_format"] = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.schema_ is None:
            raise APIError.bad_request("text.format of type 'json_schema' needs 'schema' (the JSON schema "
                                       "of the output)", param="text.format.schema")
        spec = {"name": fmt.name or "response", "schema": fmt.schema_}
        if fmt.strict is not None:
            spec["strict"] = fmt.strict
        body["response_format"] = {"type": "json_schema", "json_schema": spec}
    if req.reasoning is not None and req.reasoning.effort is not None:
        body["reasoning_effort"] = req.reasoning.effort
    return body


def messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if req.instructions:
        out.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        out.append({"role": "user", "content": req.input})
        return out
    for i, item in enumerate(req.input):
        kind = item.type or "message"
        where = f"input.{i}"
        if kind == "message":
            if item.role not in _ROLES:
                raise APIError.bad_request(f"{where}: a message item needs a role of {', '.join(_ROLES)}, "
                                           f"got {item.role!r}", param=f"{where}.role")
            out.append({"role": item.role, "content": _text(item.content, f"{where}.content")})
        elif kind == "function_call":
            for key in ("call_id", "name", "arguments"):
                if not isinstance(getattr(item, key), str):
                    raise APIError.bad_request(f"{where}: a function_call item needs '{key}' (a string)",
                                               param=f"{where}.{key}")
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)  # the calls of the same turn
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.call_id, str) or item.output is None:
                raise APIError.bad_request(f"{where}: a function_call_output item needs 'call_id' and "
                                           "'output'", param=f"{where}.call_id")
            out.append({"role": "tool", "tool_call_id": item.call_id,
                        "content": _text(item.output, f"{where}.output")})
        elif kind == "reasoning":
            continue  # an earlier turn's thinking: not part of the prompt
        else:
            raise APIError.unsupported(f"{where}.type", f"input items of type {kind!r} are not supported "
                                       "(message, function_call, function_call_output and reasoning are)")
    if not out:
        raise APIError.bad_request("input holds no message", param="input")
    return out


def _text(content: str | list[ResponsesContentPart] | None, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for j, part in enumerate(content):
        if part.type not in _TEXT_PARTS or part.text is None:
            raise APIError.unsupported(f"{where}.{j}", f"content parts of type {part.type!r} are not "
                                       "supported (only input_text and output_text)")
        parts.append(part.text)
    return "".join(parts)


def chat_tool(i: int, tool: Any) -> dict[str, Any]:
    if tool.type != "function":
        raise APIError.unsupported(f"tools.{i}.type", f"tools of type {tool.type!r} are not supported "
                                   "(only function tools: the server runs no built-in tools)")
    if not tool.name:
        raise APIError.bad_request(f"tools.{i}: a function tool needs a name", param=f"tools.{i}.name")
    fn = {"name": tool.name}
    for key in ("description", "parameters", "strict"):
        value = getattr(tool, key)
        if value is not None:
            fn[key] = value
    return {"type": "function", "function": fn}


def chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, str):
        return choice
    if choice.type != "function" or not choice.name:
        raise APIError.unsupported("tool_choice", f"tool_choice of type {choice.type!r} is not supported "
                                   '("none", "auto", "required" or {"type": "function", "name": ...})')
    return {"type": "function", "function": {"name": choice.name}}
