"""An Ollama request as the chat completions (or embeddings) body it means.

``options`` become the sampling fields (``num_predict`` -> max_tokens, ``repeat_penalty`` ->
repetition_penalty, ``stop``, ``seed``, ...); the options that tune Ollama's own runtime
(``num_ctx``, ``num_gpu``, ``num_thread``, ...) change nothing here and are ignored, as Ollama ignores
what a runner does not use. ``format`` "json" is a JSON object, a schema is that schema, both through
the structured-output engine. ``think`` sets the template's ``enable_thinking`` (false also leaves
the reasoning out of the reply). Tool calls carry their arguments as objects and tool messages
name no call id: ids are made here and matched in order. ``/api/generate``'s ``prompt`` and
``system`` are a one-turn conversation; ``raw``, ``suffix``, ``template``, ``context`` and images are a 400.
"""
from __future__ import annotations

from typing import Any

import orjson

from pagedserve.app.errors import APIError

_SAMPLING = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
             "seed": "seed", "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
             "repeat_penalty": "repetition_penalty"}


def bad(message: str) -> APIError:
    return APIError.bad_request(message)


def model_name(data: dict[str, Any]) -> str:
    model = data.get("model")
    if not isinstance(model, str) or not model:
        raise bad("model is required")
    return model.removesuffix(":latest")


def common(data: dict[str, Any], body: dict[str, Any]) -> None:
    """options, format and think into ``body``."""
    options = data.get("options")
    if options is not None:
        if not isinstance(options, dict):
            raise bad("options: expected an object")
        for name, field in _SAMPLING.items():
            if options.get(name) is not None:
                body[field] = options[name]
        n = options.get("num_predict")
        if isinstance(n, int) and not isinstance(n, bool) and n > 0:
            body["max_tokens"] = n  # -1 (no limit) and -2 (fill the context): up to the context
        elif n is not None and not isinstance(n, int):
            raise bad("options.num_predict: expected an integer")
        stop = options.get("stop")
        if stop is not None:
            body["stop"] = [stop] if isinstance(stop, str) else stop
    fmt = data.get("format")
    if fmt == "json":
        body["response_format"] = {"type": "json_object"}
    elif isinstance(fmt, dict):
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}
    elif fmt not in (None, ""):
        raise bad(f"invalid format: {fmt!r} (\"json\" or a JSON schema)")
    think = data.get("think")
    if isinstance(think, bool):
        body["chat_template_kwargs"] = {"enable_thinking": think}
        body["include_reasoning"] = think
    elif isinstance(think, str):
        body["reasoning_effort"] = think
    elif think is not None:
        raise bad("think: expected a boolean or one of \"low\", \"medium\", \"high\"")


def _no_images(message: dict[str, Any], where: str) -> None:
    if message.get("images"):
        raise bad(f"{where}: images are not supported by this server (the model reads text only)")


def chat_body(data: Any) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise bad("the request body must be a JSON object")
    body: dict[str, Any] = {"model": model_name(data), "messages": messages(data.get("messages"))}
    tools = data.get("tools")
    if tools:
        if not isinstance(tools, list):
            raise bad("tools: expected a list")
        body["tools"] = [_tool(i, t) for i, t in enumerate(tools)]
    common(data, body)
    return body


def _tool(i: int, tool: Any) -> dict[str, Any]:
    if not isinstance(tool, dict) or not isinstance(tool.get("function"), dict):
        raise bad(f"tools.{i}: expected {{\"type\": \"function\", \"function\": {{...}}}}")
    fn = {k: v for k, v in tool["function"].items() if v is not None}
    return {"type": tool.get("type") or "function", "function": fn}


def messages(given: Any) -> list[dict[str, Any]]:
    if not isinstance(given, list):
        raise bad("messages: expected a list of messages")
    out: list[dict[str, Any]] = []
    pending: list[str] = []  # ids of the assistant's calls not yet answered, in order
    count = 0
    for i, m in enumerate(given):
        where = f"messages.{i}"
        if not isinstance(m, dict):
            raise bad(f"{where}: expected an object")
        _no_images(m, where)
        role = m.get("role")
        content = m.get("content") if m.get("content") is not None else ""
        if not isinstance(content, str):
            raise bad(f"{where}.content: expected a string")
        if role == "assistant" and m.get("tool_calls"):
            calls = []
            for call in m["tool_calls"]:
                fn = call.get("function") if isinstance(call, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise bad(f"{where}.tool_calls: each call needs function.name")
                args = fn.get("arguments") if fn.get("arguments") is not None else {}
                count += 1
                call_id = f"call_{count}"
                pending.append(call_id)
                calls.append({"id": call_id, "type": "function",
                              "function": {"name": fn["name"], "arguments": orjson.dumps(args).decode()
                                           if not isinstance(args, str) else args}})
            out.append({"role": "assistant", "content": content or None, "tool_calls": calls})
        elif role == "tool":
            if pending:
                call_id = pending.pop(0)
            else:
                count += 1
                call_id = f"call_{count}"
            out.append({"role": "tool", "tool_call_id": call_id, "content": content})
        elif role in ("system", "user", "assistant"):
            out.append({"role": role, "content": content})
        else:
            raise bad(f"{where}.role: expected system, user, assistant or tool, got {role!r}")
    return out


def generate_body(data: Any) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise bad("the request body must be a JSON object")
    for name in ("raw", "suffix", "template", "context"):
        if data.get(name):
            raise bad(f"{name} is not supported by this server on /api/generate (the prompt goes through the "
                      "model's chat template; use /v1/completions for a raw prompt)")
    _no_images(data, "images")
    prompt = data.get("prompt")
    if not isinstance(prompt, str):
        raise bad("prompt: expected a string")
    msgs: list[dict[str, Any]] = []
    system = data.get("system")
    if isinstance(system, str) and system:
        msgs.append({"role": "system", "content": system})
    msgs.append({"role": "user", "content": prompt})
    body: dict[str, Any] = {"model": model_name(data), "messages": msgs}
    common(data, body)
    return body


def embed_body(data: Any, legacy: bool) -> dict[str, Any]:
    """/api/embed's (``input``) or /api/embeddings' (``prompt``) body as an embeddings body."""
    if not isinstance(data, dict):
        raise bad("the request body must be a JSON object")
    value = data.get("prompt") if legacy else data.get("input")
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
        raise bad(f"{'prompt' if legacy else 'input'}: expected a non-empty string or list of strings")
    body: dict[str, Any] = {"model": model_name(data), "input": value, "encoding_format": "float"}
    if data.get("dimensions") is not None:
        body["dimensions"] = data["dimensions"]
    return body
