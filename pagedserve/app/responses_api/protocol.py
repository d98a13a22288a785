"""Pydantic models of OpenAI's Responses API request (``POST /v1/responses``), as the official
``openai`` client sends it (openai/types/responses/response_create_params.py), plus the vLLM
sampling extras the chat route takes.

Input items are read loosely here (one model with every key an item may have) and strictly by
``app.responses_api.items``, which turns them into chat messages and names the item that is
wrong. Fields that would change the output and are not implemented are declared so the request
gets a 400 naming them (``check_supported``), never silently dropped.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from pagedserve.app.errors import APIError
from pagedserve.app.extra_fields import TEMPLATE_KWARGS_SCHEMA, check_template_kwargs
from pagedserve.app.json_types import AS_INT, BOUND_KEY, INT64_MAX, LIMIT_KEY, Name, NonEmptyName, NumLogprobs, in_all, limited

_NULL = {"type": "null"}
_FALSE_OR_NULL = {"anyOf": [{"const": False}, _NULL]}
_ONLY_NULL = {"anyOf": [_NULL]}
_EMPTY_LIST_OR_NULL = {"anyOf": [{"type": "array", "maxItems": 0}, _NULL]}
MaxOutputTokens = Annotated[int, Field(ge=1, json_schema_extra={BOUND_KEY: "context"}), AS_INT]


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=(), strict=True)


# The published schema states what app/responses_api/items.py accepts (the fuzz test holds the two
# together): these models read loosely, the schema says exactly.
_TEXT_PART = {"type": "object", "required": ["type", "text"],
              "properties": {"type": {"enum": ["input_text", "output_text", "text"]}, "text": {"type": "string"}}}
_TEXT = {"anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART}]}
_STR = {"type": "string"}
_NAME = {"type": "string", LIMIT_KEY: "max_name_chars"}  # app/admission.py bounds names and ids


def _item_shapes(schema: dict[str, Any]) -> None:
    schema.pop("properties", None)
    schema["oneOf"] = [
        {"type": "object", "title": "message", "required": ["role"],
         "properties": {"type": {"anyOf": [{"const": "message"}, {"type": "null"}]}, "role": {"enum": ["user", "system", "developer", "assistant"]},
                        "content": {"anyOf": [_TEXT, {"type": "null"}]}}},
        {"type": "object", "title": "function_call", "required": ["type", "call_id", "name", "arguments"],
         "properties": {"type": {"const": "function_call"}, "call_id": _NAME, "name": _NAME, "arguments": _STR}},
        {"type": "object", "title": "function_call_output", "required": ["type", "call_id", "output"],
         "properties": {"type": {"const": "function_call_output"}, "call_id": _NAME, "output": _TEXT}},
        {"type": "object", "title": "reasoning", "required": ["type"], "properties": {"type": {"const": "reasoning"}}},
    ]


def _function_tool(schema: dict[str, Any]) -> None:
    schema["properties"]["type"] = {"const": "function"}
    schema["properties"]["name"] = {"type": "string", "minLength": 1, LIMIT_KEY: "max_name_chars"}
    schema["required"] = ["type", "name"]


def _text_format(schema: dict[str, Any]) -> None:
    schema["oneOf"] = [{"properties": {"type": {"enum": ["text", "json_object"]}}},
                       {"properties": {"type": {"const": "json_schema"}}, "required": ["type", "schema"]}]


class ResponsesContentPart(_Model):
    model_config = ConfigDict(json_schema_extra=_TEXT_PART)

    """A part of a message item's content: ``input_text`` (``output_text`` when an assistant
    message of an earlier response is sent back)."""

    type: str
    text: str | None = None


class ResponsesInputItem(_Model):
    """One item of ``input``: a message (``type`` "message" or left out), a ``function_call``, a
    ``function_call_output`` or a ``reasoning`` item (app/responses_api/items.py)."""

    model_config = ConfigDict(json_schema_extra=_item_shapes)

    type: str | None = None
    role: str | None = None
    content: str | list[ResponsesContentPart] | None = None
    id: str | None = None
    status: str | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[ResponsesContentPart] | None = None
    summary: list[dict[str, Any]] | None = None


class ResponsesFunctionTool(_Model):
    """``{"type": "function", "name": ..., "parameters": {...}}``: flat, unlike chat's tools."""

    model_config = ConfigDict(json_schema_extra=_function_tool)

    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesNamedFunction(_Model):
    model_config = ConfigDict(json_schema_extra=_function_tool)

    type: str
    name: str | None = None


class ResponsesTextFormat(_Model):
    model_config = ConfigDict(json_schema_extra=_text_format)

    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = Field(default=None, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponsesTextConfig(_Model):
    format: ResponsesTextFormat | None = None
    verbosity: str | None = Field(default=None, json_schema_extra=_ONLY_NULL)


class ResponsesReasoning(_Model):
    effort: Name | None = None  # handed to the chat template, as chat's reasoning_effort
    summary: str | None = None  # no summaries are written; the reasoning item holds the text
    generate_summary: str | None = None


class ResponsesRequest(_Model):
    model: Name | None = None
    input: Union[Annotated[str, Field(min_length=1)],
                 Annotated[list[ResponsesInputItem], limited("max_messages", min_length=1)]]
    instructions: str | None = None
    max_output_tokens: MaxOutputTokens | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    tools: Annotated[list[ResponsesFunctionTool], limited("max_tools")] | None = in_all("max_tools_bytes", default=None)
    tool_choice: Literal["none", "auto", "required"] | ResponsesNamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: ResponsesTextConfig | None = None
    reasoning: ResponsesReasoning | None = None
    stream: bool = False
    store: bool | None = None  # nothing is stored either way (previous_response_id is refused)
    metadata: dict[str, str] | None = None
    user: Name | None = None
    service_tier: Name | None = None
    prompt_cache_key: Name | None = None
    safety_identifier: Name | None = None
    stream_options: dict[str, Any] | None = None  # include_obfuscation: no obfuscation is sent
    # vLLM's sampling extras (as on chat)
    top_k: Annotated[int, Field(ge=-1, le=INT64_MAX), AS_INT] | None = None
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, ge=0.01, le=100.0)
    seed: Annotated[int, Field(ge=0, le=INT64_MAX), AS_INT] | None = None
    priority: Annotated[int, Field(ge=-(2**63), le=INT64_MAX), AS_INT] = 0
    cache_salt: NonEmptyName | None = None
    request_id: Name | None = None
    chat_template_kwargs: dict[str, Any] | None = Field(default=None, json_schema_extra=TEMPLATE_KWARGS_SCHEMA)
    # Declared so that they are refused by name (check_supported).
    previous_response_id: str | None = Field(default=None, json_schema_extra=_ONLY_NULL)
    conversation: Any = Field(default=None, json_schema_extra=_ONLY_NULL)
    background: bool | None = Field(default=None, json_schema_extra=_FALSE_OR_NULL)
    include: list[str] | None = Field(default=None, json_schema_extra=_EMPTY_LIST_OR_NULL)
    top_logprobs: NumLogprobs | None = Field(default=None, json_schema_extra={"anyOf": [{"const": 0}, _NULL]})
    truncation: Literal["auto", "disabled"] | None = Field(default=None, json_schema_extra={
        "anyOf": [{"const": "disabled"}, _NULL]})
    max_tool_calls: Annotated[int, Field(ge=1), AS_INT] | None = Field(default=None, json_schema_extra=_ONLY_NULL)
    prompt: Any = Field(default=None, json_schema_extra=_ONLY_NULL)

    def check_supported(self) -> None:
        if self.previous_response_id is not None:
            raise APIError.bad_request(
                "previous_response_id is not supported: this server stores no responses (store is "
                "ignored). Send the whole conversation in 'input' instead: the earlier input items and "
                "the output items of the earlier response, then the new ones", param="previous_response_id")
        refused = {
            "conversation": (self.conversation is not None, "conversations are not supported: this "
                             "server stores nothing; send the whole conversation in 'input'"),
            "background": (bool(self.background), "background responses are not supported"),
            "include": (bool(self.include), "include is not supported (no extra output data)"),
            "top_logprobs": (bool(self.top_logprobs), "top_logprobs is not supported on /v1/responses "
                             "(use /v1/chat/completions)"),
            "truncation": (self.truncation == "auto", "truncation 'auto' is not supported: a conversation "
                           "longer than the context is a 400"),
            "max_tool_calls": (self.max_tool_calls is not None, "max_tool_calls is not supported (use "
                               "parallel_tool_calls: false for at most one call)"),
            "prompt": (self.prompt is not None, "stored prompt templates are not supported"),
            "text.verbosity": (self.text is not None and self.text.verbosity is not None,
                               "verbosity is not supported"),
        }
        for name, (bad, message) in refused.items():
            if bad:
                raise APIError.unsupported(name, message)
        check_template_kwargs(self.chat_template_kwargs)
