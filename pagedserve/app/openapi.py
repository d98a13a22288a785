"""The API's OpenAPI 3.1 document, served at ``GET /openapi.json``.

Request bodies come from the same pydantic models that validate requests (app/protocol.py), so
the contract cannot drift from the code; the fuzz test (tests/e2e/test_fuzz.py) holds the
server to it. The document is built per server: bounds only the running server knows (its
vocabulary, its context length) are written in, and the API key requirement appears only
when the server has one. Every status a route can answer is listed with OpenAI's error body.
"""
from __future__ import annotations

import copy
from typing import Any

from pydantic.json_schema import models_json_schema

from pagedserve.app.admission import AdmissionLimits, flag, int_range_pattern
from pagedserve.app.auth import is_protected
from pagedserve.app.embeddings_protocol import EmbeddingRequest, ScoreRequest
from pagedserve.app.responses_api.protocol import ResponsesRequest
from pagedserve.app.protocol import (
    BOUND_KEY,
    LIMIT_KEY,
    TOTAL_KEY,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)

OPENAPI_VERSION = "3.1.0"
# Routes of the other APIs this server speaks, which this (OpenAI-format) document leaves out:
# Anthropic's Messages API (app/anthropic_api) and Ollama's API (app/ollama_api) have their own
# documentation, request shapes and error bodies; README lists them.
OTHER_API_PREFIXES = ("/v1/messages", "/api/")
REF = "#/components/schemas/{model}"

ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "title": "ErrorResponse",
    "description": "OpenAI's error body.",
    "required": ["error"],
    "properties": {"error": {
        "type": "object",
        "required": ["message", "type", "param", "code"],
        "properties": {
            "message": {"type": "string"},
            "type": {"type": "string"},
            "param": {"type": ["string", "null"]},
            "code": {"type": ["string", "null"]},
        },
    }},
}

_USAGE = {
    "type": "object",
    "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
    "properties": {**{k: {"type": "integer", "minimum": 0}
                      for k in ("prompt_tokens", "completion_tokens", "total_tokens")},
                   "prompt_tokens_details": {
                       "type": "object", "required": ["cached_tokens"],
                       "description": "Only with --enable-prompt-tokens-details: prompt tokens the "
                                      "prefix cache served.",
                       "properties": {"cached_tokens": {"type": "integer", "minimum": 0}}}},
}
_POOLING_USAGE = {
    "type": "object",
    "required": ["prompt_tokens", "total_tokens"],
    "properties": {k: {"type": "integer", "minimum": 0} for k in ("prompt_tokens", "total_tokens")},
}
_FINISH = {"type": ["string", "null"]}
_TOOL_CALLS = {"type": "array", "items": {  # app/tools/output.py
    "type": "object", "required": ["id", "type", "function"],
    "properties": {"id": {"type": "string"}, "type": {"const": "function"},
                   "function": {"type": "object", "required": ["name", "arguments"],
                                "properties": {"name": {"type": "string"},
                                               "arguments": {"type": "string"}}}}}}


def _response_object(kind: str, choice: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["id", "object", "created", "model", "choices", "usage"],
        "properties": {
            "id": {"type": "string"},
            "object": {"const": kind},
            "created": {"type": "integer"},
            "model": {"type": "string"},
            "choices": {"type": "array", "items": choice},
            "usage": _USAGE,
        },
    }


RESPONSE_SCHEMAS: dict[str, dict[str, Any]] = {
    "ErrorResponse": ERROR_SCHEMA,
    "Completion": _response_object("text_completion", {
        "type": "object", "required": ["index", "text", "finish_reason"],
        "properties": {"index": {"type": "integer"}, "text": {"type": "string"},
                       "logprobs": {"type": ["object", "null"]}, "finish_reason": _FINISH},
    }),
    "ChatCompletion": _response_object("chat.completion", {
        "type": "object", "required": ["index", "message", "finish_reason"],
        "properties": {"index": {"type": "integer"}, "finish_reason": _FINISH,
                       "logprobs": {"type": ["object", "null"]},
                       "message": {"type": "object", "required": ["role", "content"],
                                   "properties": {"role": {"const": "assistant"},
                                                  "content": {"type": ["string", "null"]},
                                                  "tool_calls": _TOOL_CALLS}}},
    }),
    "Response": {  # app/responses_api/route.py
        "type": "object",
        "required": ["id", "object", "created_at", "status", "model", "output", "usage"],
        "properties": {
            "id": {"type": "string"}, "object": {"const": "response"}, "created_at": {"type": "integer"},
            "status": {"enum": ["completed", "incomplete"]}, "model": {"type": "string"},
            "incomplete_details": {"type": ["object", "null"]},
            "output": {"type": "array", "items": {
                "type": "object", "required": ["id", "type", "status"],
                "properties": {"id": {"type": "string"}, "type": {"enum": ["message", "function_call", "reasoning"]},
                               "status": {"enum": ["completed", "incomplete"]}}}},
            "usage": {"type": "object",
                      "required": ["input_tokens", "output_tokens", "total_tokens"],
                      "properties": {**{k: {"type": "integer", "minimum": 0}
                                        for k in ("input_tokens", "output_tokens", "total_tokens")},
                                     "input_tokens_details": {
                                         "type": "object",
                                         "description": "`cached_tokens`: prompt tokens the prefix cache "
                                                        "served, told to a request with a `cache_salt` or "
                                                        "with --enable-prompt-tokens-details; else 0.",
                                         "properties": {"cached_tokens": {"type": "integer", "minimum": 0}}}}},
        },
    },
    "EmbeddingList": {
        "type": "object", "required": ["id", "object", "created", "model", "data", "usage"],
        "properties": {
            "id": {"type": "string"}, "object": {"const": "list"}, "created": {"type": "integer"},
            "model": {"type": "string"},
            "data": {"type": "array", "items": {
                "type": "object", "required": ["object", "index", "embedding"],
                "properties": {"object": {"const": "embedding"}, "index": {"type": "integer", "minimum": 0},
                               "embedding": {"oneOf": [
                                   {"type": "array", "items": {"type": "number"},
                                    "description": "encoding_format float"},
                                   {"type": "string", "contentEncoding": "base64",
                                    "description": "encoding_format base64: float32 little-endian"}]}}}},
            "usage": _POOLING_USAGE,
        },
    },
    "ScoreList": {
        "type": "object", "required": ["id", "object", "created", "model", "data", "usage"],
        "properties": {
            "id": {"type": "string"}, "object": {"const": "list"}, "created": {"type": "integer"},
            "model": {"type": "string"},
            "data": {"type": "array", "items": {
                "type": "object", "required": ["index", "object", "score"],
                "properties": {"index": {"type": "integer", "minimum": 0}, "object": {"const": "score"},
                               "score": {"type": "number"}}}},
            "usage": _POOLING_USAGE,
        },
    },
    "ModelList": {
        "type": "object", "required": ["object", "data"],
        "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": {
            "type": "object", "required": ["id", "object", "created", "owned_by"],
            "properties": {"id": {"type": "string"}, "object": {"const": "model"},
                           "created": {"type": "integer"}, "owned_by": {"type": "string"},
                           "root": {"type": "string", "description": "The served name; the model's or "
                                                                     "adapter's path with --show-model-paths."},
                           "parent": {"type": ["string", "null"]},
                           "max_model_len": {"type": "integer"},
                           "permission": {"type": "array", "items": {"type": "object"}}}}}},
    },
    "TokenizeResponse": {
        "type": "object", "required": ["count", "max_model_len", "tokens"],
        "properties": {"count": {"type": "integer", "minimum": 0},
                       "max_model_len": {"type": "integer"},
                       "tokens": {"type": "array", "items": {"type": "integer"}}},
    },
    "DetokenizeResponse": {"type": "object", "required": ["prompt"],
                           "properties": {"prompt": {"type": "string"}}},
    "VersionResponse": {"type": "object", "required": ["version"],
                        "properties": {"version": {"type": "string"}}},
    "HealthStatus": {"type": "object", "required": ["status"],
                     "properties": {"status": {"enum": ["ok", "restarting", "dead"]},
                                    "replicas": {"type": "array", "items": {"enum": ["ok", "restarting", "dead"]},
                                                 "description": "Each data-parallel replica's own status "
                                                                "(--data-parallel-size > 1 only); the "
                                                                "server is ok while any replica is."}}},
}

# Before OpenAPI 3.2 (no itemSchema) the schema of an event stream describes one event.
_SSE = {"text/event-stream": {"schema": {
    "type": "object",
    "description": "One server-sent event: `data: {chunk JSON}` per delta (or `data: {error JSON}` "
                   "if the request fails midway), then `data: [DONE]`.",
    "required": ["data"],
    "properties": {"data": {"type": "string"}}}}}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": REF.format(model=name)}


def _error(description: str, headers: dict[str, Any] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"description": description,
                           "content": {"application/json": {"schema": _ref("ErrorResponse")}}}
    if headers:
        out["headers"] = headers
    return out


def _health_error() -> dict[str, Any]:
    out = _error("The workers are restarting (status `restarting`, with Retry-After) or the engine "
                 "has stopped (status `dead`).", _RETRY_AFTER)
    schema = out["content"]["application/json"]["schema"]
    out["content"]["application/json"]["schema"] = {"allOf": [schema, _ref("HealthStatus")]}
    return out


def _json(description: str, schema_name: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": _ref(schema_name)}}}


_INVALID_HOST = (" Also: a Host header this server does not answer (code `invalid_host`; without --api-key "
                 "only the bound address, localhost and --allowed-hosts are served).")


def _unsupported_media_type() -> dict[str, Any]:
    return _error("The body is not `application/json` (code `unsupported_media_type`): refused before it "
                  "is read, as vLLM refuses it.")


_RETRY_AFTER = {"Retry-After": {"description": "Seconds to wait before retrying (overload only).",
                                "schema": {"type": "string"}}}
_WWW_AUTH = {"WWW-Authenticate": {"schema": {"type": "string"}}}
_REQUEST_ID = {"X-Request-Id": {
    "description": "The request's id: the client's X-Request-Id header (up to 256 printable ASCII "
                   "characters) or the body's `request_id`, else a new one.",
    "schema": {"type": "string"}}}


def _post(summary: str, model_name: str, ok: dict[str, Any], *, generates: bool,
          max_body_bytes: int) -> dict[str, Any]:
    responses: dict[str, Any] = {
        "200": ok,
        "400": _error("Invalid request: a field fails validation, or a rule across fields "
                      "(context length, best_of == n, ...). `param` names the field."),
        "404": _error("The `model` field names a model this server does not serve."),
        "413": _error(f"The request body is larger than {max_body_bytes} bytes."),
        "415": _unsupported_media_type(),
    }
    responses["408"] = _timeout_error(body=True)
    if generates:
        responses["503"] = _error("Overloaded (code `overloaded`, with Retry-After) or the engine "
                                  "has stopped (code `engine_dead`).", _RETRY_AFTER)
    return {"summary": summary, "requestBody": {
        "required": True, "content": {"application/json": {"schema": _ref(model_name)}}},
        "responses": responses}


def _lora_route(summary: str, load: bool) -> dict[str, Any]:
    body = {"type": "object", "required": ["lora_name", "lora_path"] if load else ["lora_name"],
            "properties": {"lora_name": {"type": "string"}, "lora_path": {"type": "string"}}}
    responses = {
        "200": {"description": "Done (vLLM's plain-text answer).", "content": {"text/plain": {"schema": {"type": "string"}}}},
        "400": _error("A bad body, or an adapter already loaded; " + (
            "a `lora_path` refused (code `lora_path_refused`: one message for every refused path, which must "
            "lie under a --lora-root, hold no symbolic links and fit the base model; the reason is logged), or "
            "--max-runtime-loras adapters already loaded (code `too_many_adapters`)." if load else
            "an adapter of --lora-modules, which the API cannot unload (code `adapter_pinned`).")),
        "408": _timeout_error(body=True),
        "415": _unsupported_media_type(),
    }
    if not load:
        responses["404"] = _error("No adapter of that name is loaded (code `model_not_found`).")
        responses["409"] = _error("Requests still use the adapter (code `adapter_in_use`).")
    return {"summary": summary, "requestBody": {"required": True, "content": {"application/json": {"schema": body}}},
            "responses": responses}


def _get(summary: str, ok: dict[str, Any], **more: dict[str, Any]) -> dict[str, Any]:
    return {"summary": summary, "responses": {"200": ok, "408": _timeout_error(body=False), **more}}


def _ping(method: str) -> dict[str, Any]:
    op = _get("Liveness of the engine (vLLM's /ping; answers as /health, any body is not read).",
              _json("The engine is serving.", "HealthStatus"), **{"503": _health_error()})
    op["responses"]["408"] = _timeout_error(body=method == "post")
    return op


def _timeout_error(*, body: bool) -> dict[str, Any]:
    """The read timeouts of app/http_protocol.py: answered before any route runs."""
    what = ("The request head (--header-timeout) or body (--body-timeout) did not arrive in "
            "time" if body else "The request head did not arrive in time (--header-timeout)")
    return _error(f"{what}; the connection is closed (code `request_timeout`).")


_LIMIT_KEYWORD = {"array": "maxItems", "object": "maxProperties", "integer": "maximum", "string": "maxLength"}


def _fill_bounds(node: Any, bounds: dict[str, int | None], limits: AdmissionLimits) -> None:
    """Replace each BOUND_KEY marker by the maximum this server enforces (or drop it), and each
    LIMIT_KEY marker by its admission limit (app/admission.py)."""
    if isinstance(node, dict):
        kind = node.pop(BOUND_KEY, None)
        if kind == "vocab_key":  # an object keyed by token ids: the pattern of ids < vocab
            if bounds["vocab"] is not None:
                node["patternProperties"] = {int_range_pattern(bounds["vocab"]): value
                                             for value in node["patternProperties"].values()}
        elif kind == "vocab_items":  # a list of token ids, at most the vocabulary's size
            if bounds["vocab"] is not None:
                node["maxItems"] = bounds["vocab"] + 1
        elif kind is not None:
            limit = bounds[kind]
            if limit is not None:
                node["maximum"] = min(node.get("maximum", limit), limit)
        limit_name = node.pop(LIMIT_KEY, None)
        if limit_name is not None:
            keyword = _LIMIT_KEYWORD[node["type"]]
            limit = getattr(limits, limit_name)
            if limit >= 0:  # max_logprobs -1: no cap
                node[keyword] = min(node.get(keyword, limit), limit)
        total_name = node.pop(TOTAL_KEY, None)
        if total_name is not None:  # JSON Schema cannot state it: the description does
            total = getattr(limits, total_name)
            what = "bytes as JSON" if total_name.endswith("_bytes") else "characters in all"
            note = f"At most {total} {what} ({flag(total_name)})."
            node["description"] = f"{node['description']} {note}" if node.get("description") else note
        for value in node.values():
            _fill_bounds(value, bounds, limits)
    elif isinstance(node, list):
        for value in node:
            _fill_bounds(value, bounds, limits)


def request_schemas() -> dict[str, Any]:
    """JSON Schemas of the request bodies (and the models they use), keyed by model name."""
    models = (CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest,
              EmbeddingRequest, ScoreRequest, ResponsesRequest)
    _, defs = models_json_schema([(m, "validation") for m in models], ref_template=REF)
    return defs["$defs"]


def build_openapi(*, served_model_name: str, max_model_len: int, vocab_size: int | None,
                  api_key: bool, max_body_bytes: int, version: str,
                  trust_request_chat_template: bool = False,
                  embedding_size: int | None = None, limits: AdmissionLimits | None = None,
                  lora_runtime_routes: bool = False, host_check: bool = False) -> dict[str, Any]:
    """The OpenAPI document of one server. ``api_key``: whether /v1/*, /tokenize,
    /detokenize and /score require a bearer token (they answer 401 without it). Every response carries
    ``X-Request-Id``: the client's (header, or a generating route's ``request_id`` field) or a
    new one. ``limits``: the server's admission limits (maxItems and the like).
    ``lora_runtime_routes``: the server answers /v1/load_lora_adapter and /v1/unload_lora_adapter.
    ``host_check``: a request with a Host header the server does not serve gets 400 (app/trusted_host.py)."""
    limits = limits or AdmissionLimits()
    tokenize_body_bytes = min(max_body_bytes, limits.max_tokenize_body_bytes)
    schemas = copy.deepcopy(request_schemas())
    # A token id is < vocab_size; a completion length leaves at least one prompt token.
    # An embedding keeps at most the model's hidden size (``dimensions``).
    _fill_bounds(schemas, {"vocab": vocab_size - 1 if vocab_size else None,
                           "context": max_model_len - 1, "embedding": embedding_size}, limits)
    schemas.update(copy.deepcopy(RESPONSE_SCHEMAS))
    if not trust_request_chat_template:  # a request's own template is a 400 then
        for name in ("ChatCompletionRequest", "TokenizeRequest"):
            schemas[name]["properties"]["chat_template"] = {
                "type": "null", "title": "Chat Template", "description": "Needs --trust-request-chat-template."}

    stream_note = " With `stream: true` the 200 answer is an SSE stream."
    paths: dict[str, Any] = {
        "/v1/completions": {"post": _post(
            "Text completion." + stream_note, "CompletionRequest",
            {"description": "The completion.",
             "content": {"application/json": {"schema": _ref("Completion")}, **_SSE}},
            generates=True, max_body_bytes=max_body_bytes)},
        "/v1/chat/completions": {"post": _post(
            "Chat completion." + stream_note, "ChatCompletionRequest",
            {"description": "The chat completion.",
             "content": {"application/json": {"schema": _ref("ChatCompletion")}, **_SSE}},
            generates=True, max_body_bytes=max_body_bytes)},
        "/v1/responses": {"post": _post(
            "OpenAI's Responses API (function tools, text.format, reasoning items; nothing is stored). "
            "With `stream: true` the 200 answer is an SSE stream of typed events (`event: response.created`"
            " ... `event: response.completed`), without `[DONE]`.", "ResponsesRequest",
            {"description": "The response.",
             "content": {"application/json": {"schema": _ref("Response")}, **_SSE}},
            generates=True, max_body_bytes=max_body_bytes)},
        "/v1/embeddings": {"post": _post(
            "Embeddings of the inputs (OpenAI's format; any served model, pooled per request).",
            "EmbeddingRequest", _json("The embeddings.", "EmbeddingList"),
            generates=True, max_body_bytes=max_body_bytes)},
        **{path: {"post": _post(
            "Scores of text pairs: the cosine of their embeddings (vLLM's /score).",
            "ScoreRequest", _json("The scores.", "ScoreList"),
            generates=True, max_body_bytes=max_body_bytes)} for path in ("/v1/score", "/score")},
        "/tokenize": {"post": _post(
            "Token ids of a prompt or of chat messages (after the chat template).", "TokenizeRequest",
            _json("The token ids.", "TokenizeResponse"), generates=False, max_body_bytes=tokenize_body_bytes)},
        "/detokenize": {"post": _post(
            "Text of token ids.", "DetokenizeRequest",
            _json("The text.", "DetokenizeResponse"), generates=False, max_body_bytes=tokenize_body_bytes)},
        "/v1/models": {"get": _get("The served model.", _json("One model.", "ModelList"))},
        "/health": {"get": _get("Liveness of the engine.", _json("The engine is serving.", "HealthStatus"),
                                **{"503": _health_error()})},
        "/ping": {method: _ping(method) for method in ("get", "post")},
        "/version": {"get": _get("Server version.", _json("The version.", "VersionResponse"))},
        "/metrics": {"get": _get("Prometheus metrics.", {
            "description": "Prometheus text exposition format.",
            "content": {"text/plain": {"schema": {"type": "string"}}}})},
    }
    if lora_runtime_routes:
        paths["/v1/load_lora_adapter"] = {"post": _lora_route(
            "Serve a PEFT LoRA adapter under `lora_name` (--allow-runtime-lora-updating).", load=True)}
        paths["/v1/unload_lora_adapter"] = {"post": _lora_route(
            "Stop serving the adapter `lora_name` (refused while requests use it).", load=False)}
    doc: dict[str, Any] = {
        "openapi": OPENAPI_VERSION,
        "info": {"title": "pagedserve", "version": version,
                 "description": f"OpenAI-compatible API serving `{served_model_name}` "
                                f"(context {max_model_len} tokens)."},
        "paths": paths,
        "components": {"schemas": schemas},
    }
    if api_key:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        for path, item in paths.items():
            if is_protected(path):
                for op in item.values():
                    op["security"] = [{"bearer": []}]
                    op["responses"]["401"] = _error("Missing or wrong API key.", _WWW_AUTH)
    if host_check:
        for item in paths.values():
            for op in item.values():
                op["responses"].setdefault("400", _error("Invalid request."))["description"] += _INVALID_HOST
    for item in paths.values():
        for op in item.values():
            for resp in op["responses"].values():
                resp.setdefault("headers", {}).update(_REQUEST_ID)
    return doc
