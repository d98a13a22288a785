"""Pydantic models of the OpenAI request schema (plus vLLM's extra sampling fields).

Unknown fields are accepted and logged once per name (as vLLM). Fields we know but do not support
are declared so the server can answer "unsupported" instead of silently ignoring them; vLLM's
other extras live in app/extra_fields.py. Responses are plain
dicts serialized with orjson: building them is on the hot path of every stream chunk.

These models are also the published schema (app/openapi.py), so they validate strictly (no
"12" for 12, no true for 1, as OpenAI) and carry every bound the server enforces as a schema
constraint. Bounds known only at run time (vocabulary size, context length) are marked with
``BOUND_KEY`` and filled in by the schema builder; the server checks them itself.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from pagedserve.app.errors import APIError
from pagedserve.app.tools.models import ToolCall, ToolChoice, ToolDefinition
from pagedserve.app.structured_args import StructuredFields
from pagedserve.app.extra_fields import ChatExtraFields, CompletionExtraFields, TokenizeExtraFields, log_ignored_fields
from pagedserve.app.json_types import AS_INT as _AS_INT
from pagedserve.app.json_types import (  # noqa: F401  (re-exported)
    BOUND_KEY, INT64_MAX, INT64_MIN, LIMIT_KEY, MAX_N, TOTAL_KEY, Int, Name, NonEmptyName, NonEmptyStr, NumLogprobs,
    in_all, limited)
from pagedserve.app.json_types import json_integer as _json_integer

# A token id the model reads: the server answers 400 past the vocabulary.
TokenId = Annotated[int, Field(ge=0, le=INT64_MAX, json_schema_extra={BOUND_KEY: "vocab"}), _AS_INT]
# A token id the sampler only compares with (stop ids, logit_bias keys): one past the vocabulary
# never matches and is ignored, but it must fit int64 to travel to the workers.
AnyTokenId = Annotated[int, Field(ge=0, le=INT64_MAX), _AS_INT]
# logit_bias keys: token ids in decimal (no leading zeros); the schema narrows the pattern to
# the vocabulary (BOUND_KEY "vocab_key") and the server refuses an id past it (app/admission.py).
AnyTokenIdKey = Annotated[str, Field(pattern=r"^(0|[1-9][0-9]{0,17})$")]
LogitBias = Annotated[dict[AnyTokenIdKey, Annotated[float, Field(ge=-100.0, le=100.0)]],
                      Field(json_schema_extra={"additionalProperties": False, BOUND_KEY: "vocab_key",
                                               LIMIT_KEY: "max_logit_bias"})]
StopStr = Annotated[str, Field(min_length=1, json_schema_extra={LIMIT_KEY: "max_stop_chars"})]
StopList = Annotated[list[StopStr], limited("max_stop_sequences")]
Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX), _AS_INT]
BestOf = Annotated[int, Field(ge=1, le=MAX_N), _AS_INT]
Seed = Annotated[int, Field(ge=0, le=INT64_MAX), _AS_INT]
TopK = Annotated[int, Field(ge=-1, le=INT64_MAX), _AS_INT]  # -1 or 0 = off

# Declared-but-unsupported fields: the model accepts any value so the server can answer
# "... is not supported" (code "unsupported"); the schema says which values actually pass.
_EMPTY_LIST_OR_NULL = {"anyOf": [{"type": "array", "maxItems": 0}, {"type": "null"}]}
_NONE_OR_NULL = {"anyOf": [{"const": "none"}, {"type": "null"}]}
_EMPTY_STR_OR_NULL = {"anyOf": [{"type": "string", "maxLength": 0}, {"type": "null"}]}


def _only_text_type(schema: dict[str, Any]) -> None:
    schema["properties"]["type"] = {"const": "text", "title": "Type"}


def _text_part(schema: dict[str, Any]) -> None:
    _only_text_type(schema)
    schema["properties"]["text"] = {"type": "string", "title": "Text"}
    schema["required"] = ["type", "text"]


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=(), strict=True)


class StreamOptions(OpenAIModel):
    include_usage: bool = False
    continuous_usage_stats: bool | None = None  # vLLM's: each chunk carries the usage so far (with include_usage)


class SamplingFields(StructuredFields, OpenAIModel):
    """Fields shared by completions and chat completions (the output constraints:
    app/structured_args.py)."""

    model: Name | None = None
    n: Int = Field(default=1, ge=1, le=MAX_N)
    best_of: BestOf | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: LogitBias | None = None
    seed: Seed | None = None
    stop: StopStr | StopList | None = in_all("max_stop_chars", default=None)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Name | None = None
    # vLLM extras
    top_k: TopK | None = None
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    # > 0 in vLLM; bounded here because the penalty divides or multiplies logits: 5e-324 made
    # them +inf and the sampler failed the whole step. 0.01..100 keeps fp32 logits finite.
    repetition_penalty: float | None = Field(default=None, ge=0.01, le=100.0)
    ignore_eos: bool = False
    min_tokens: Int = Field(default=0, ge=0, json_schema_extra={BOUND_KEY: "context"})
    stop_token_ids: Annotated[list[AnyTokenId], limited("max_stop_token_ids")] | None = None
    priority: Int64 = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # vLLM's prefix-cache tenant key: only requests with an equal salt share cached KV blocks.
    cache_salt: NonEmptyName | None = None

    # The "before" validators only give the common mistakes a clearer message than pydantic's;
    # the field types carry the same rules for the schema.
    @field_validator("stop", mode="before")
    @classmethod
    def _stop_not_empty(cls, v: Any) -> Any:
        if v == "" or (isinstance(v, list) and "" in v):
            raise ValueError("stop strings must not be empty")
        return v

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v: str | list[str] | None) -> list[str] | None:
        if v is None:
            return None
        return [v] if isinstance(v, str) else list(v)

    @field_validator("cache_salt")
    @classmethod
    def _salt_not_empty(cls, v: str | None) -> str | None:
        if v is not None and not v:
            raise ValueError("cache_salt must be a non-empty string (or left out)")
        return v

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _logit_bias_keys(cls, v: Any) -> Any:
        if not isinstance(v, dict):
            return v
        for key, bias in v.items():
            if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 18
                    and (key == "0" or key[0] != "0")):
                raise ValueError(f"logit_bias keys must be token ids (up to 18 digits, no leading "
                                 f"zeros), got {key!r}")
            if isinstance(bias, (int, float)) and not isinstance(bias, bool) and not -100 <= bias <= 100:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias}")
        return v

    def check_common(self, use_beam_search: bool | None) -> None:
        """``use_beam_search``: the request's own (an extra field, app/extra_fields.py)."""
        self.check_extra_fields(self.stream)  # app/extra_fields.py
        if self.best_of is not None and self.best_of != self.n and not use_beam_search:
            raise APIError.unsupported("best_of", "best_of different from n is not supported")
        if self.stream_options is not None and not self.stream:
            raise APIError.bad_request("stream_options is only allowed when stream is true",
                                       param="stream_options")

    def sampling_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for engine SamplingParams (only what the user set, plus flags)."""
        kw: dict[str, Any] = {}
        for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty",
                     "min_p", "repetition_penalty"):
            value = getattr(self, name)
            if value is not None:
                kw[name] = value
        if self.top_k is not None:
            kw["top_k"] = 0 if self.top_k < 0 else self.top_k  # -1 (vLLM) = off
        if self.logit_bias:
            kw["logit_bias"] = {int(k): float(v) for k, v in self.logit_bias.items()}
        if self.stop:
            kw["stop"] = list(self.stop)
        if self.stop_token_ids:
            kw["stop_token_ids"] = list(self.stop_token_ids)
        kw["ignore_eos"] = self.ignore_eos
        kw["min_tokens"] = self.min_tokens
        kw["include_stop_str_in_output"] = self.include_stop_str_in_output
        kw["skip_special_tokens"] = self.skip_special_tokens
        kw.update(self.constraint_kwargs())
        return kw

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """vLLM's ``continuous_usage_stats``: with ``include_usage``, every chunk carries the usage so far."""
        return bool(self.include_usage and self.stream_options.continuous_usage_stats)


PromptType = Union[
    NonEmptyStr,
    Annotated[list[NonEmptyStr], limited("max_prompts", min_length=1)],
    Annotated[list[TokenId], Field(min_length=1)],
    Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], limited("max_prompts", min_length=1)],
]
# A completion length: the prompt takes at least one token of the context, so it is < max_model_len.
MaxTokens = Annotated[int, Field(ge=1, json_schema_extra={BOUND_KEY: "context"}), _AS_INT]


class CompletionRequest(SamplingFields, CompletionExtraFields):
    prompt: PromptType
    max_tokens: MaxTokens | None = None
    echo: bool = False
    logprobs: NumLogprobs | None = None
    suffix: str | None = Field(default=None, json_schema_extra=_EMPTY_STR_OR_NULL)

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, v: Any) -> Any:
        # Decide the shape explicitly: pydantic's union would happily coerce "12" into an int.
        if v == "":
            raise ValueError("prompt must not be empty")
        if isinstance(v, str):
            return v
        if not isinstance(v, list) or not v:
            raise ValueError("prompt must be a string, a list of strings, a list of token ids "
                             "or a list of token-id lists, and must not be empty")
        if all(isinstance(x, str) for x in v):
            if "" in v:
                raise ValueError("prompt strings must not be empty")
            return v
        if all(_is_json_int(x) for x in v):
            return _check_id_range([_json_integer(x) for x in v])
        if all(isinstance(x, list) and x and all(_is_json_int(t) for t in x) for x in v):
            return [_check_id_range([_json_integer(t) for t in ids]) for ids in v]
        raise ValueError("prompt must be a string, a list of strings, a list of token ids "
                         "or a list of non-empty token-id lists")

    def check_supported(self) -> None:
        self.check_common(self.use_beam_search)
        if self.suffix:
            raise APIError.unsupported("suffix", "suffix is not supported")


def _is_json_int(x: Any) -> bool:
    return (isinstance(x, int) and not isinstance(x, bool)) or (type(x) is float and x.is_integer())


def _check_id_range(ids: list[int]) -> list[int]:
    for t in ids:
        if not 0 <= t <= INT64_MAX:
            raise ValueError(f"token id {t} is out of range: ids must be >= 0")
    return ids


class ContentPart(OpenAIModel):
    model_config = ConfigDict(json_schema_extra=_text_part)

    type: str
    text: str | None = None


class ChatMessage(OpenAIModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: Name | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: Name | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise APIError.unsupported("messages", f"content parts of type {part.type!r} are "
                                                       "not supported (only text)")
            parts.append(part.text)
        return "".join(parts)


def check_messages(messages: list[ChatMessage]) -> None:
    """What chat completions and /tokenize refuse alike in a conversation (content parts that
    are not text: ``ChatMessage.text``)."""
    for message in messages:
        message.text()


class ChatCompletionRequest(SamplingFields, ChatExtraFields):
    messages: list[ChatMessage] = limited("max_messages", min_length=1)
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool = False
    top_logprobs: NumLogprobs | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: Annotated[list[ToolDefinition], limited("max_tools")] | None = in_all(  # app/tools/plan.py
        "max_tools_bytes", default=None)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = Field(default=None, json_schema_extra=_EMPTY_LIST_OR_NULL)
    function_call: Any = Field(default=None, json_schema_extra=_NONE_OR_NULL)

    def check_supported(self) -> None:
        self.check_common(self.use_beam_search)
        if self.functions:
            raise APIError.unsupported("functions", "functions are not supported (use tools)")
        if self.function_call not in (None, "none"):
            raise APIError.unsupported("function_call", "function_call is not supported")
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError.bad_request("top_logprobs requires logprobs to be true",
                                       param="top_logprobs")
        if self.continue_final_message and self.add_generation_prompt:
            raise APIError.bad_request("continue_final_message and add_generation_prompt cannot "
                                       "both be true", param="continue_final_message")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise APIError.bad_request("continue_final_message needs the last message to be from "
                                       "the assistant", param="continue_final_message")
        check_messages(self.messages)

    def requested_max_tokens(self) -> int | None:
        # max_completion_tokens replaces the deprecated max_tokens; take it when both are given.
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(OpenAIModel, TokenizeExtraFields):
    # Exactly one of prompt / messages (check() enforces it; the schema says it).
    model_config = ConfigDict(json_schema_extra={"oneOf": [
        {"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
        {"required": ["messages"], "properties": {"messages": {"type": "array"}}},
    ]})
    model: Name | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], limited("max_messages")] | None = None
    tools: Annotated[list[ToolDefinition], limited("max_tools")] | None = in_all(  # rendered as for chat (vLLM)
        "max_tools_bytes", default=None)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise APIError.bad_request("give exactly one of 'prompt' or 'messages'", param="prompt")
        if self.messages is not None:
            check_messages(self.messages)
        self.check_extra_fields()  # app/extra_fields.py


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: list[TokenId]


def parse(model: type[OpenAIModel], data: Any) -> Any:
    """Validate a decoded JSON body; a validation failure becomes one clear 400 naming the field."""
    if not isinstance(data, dict):
        raise APIError.bad_request("the request body must be a JSON object")
    try:
        req = model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from None
    log_ignored_fields(model, data)
    return req


def validation_error(e: ValidationError) -> APIError:
    errors = e.errors(include_url=False)
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if not _is_union_branch(p)]
    param = ".".join(loc) or None
    msg = first.get("msg", "invalid value")
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    if first.get("type") == "missing":
        message = f"'{param}' is a required field"
    elif first.get("type") == "extra_forbidden" and len(loc) > 1:
        message = f"'{'.'.join(loc[:-1])}' has no field '{loc[-1]}'"
    else:
        message = f"Invalid value for '{param}': {msg}" if param else msg
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})"
    return APIError.bad_request(message, param=param)


def _is_union_branch(part: Any) -> bool:
    # pydantic puts the tried union member in the location (e.g. 'str', 'list[ContentPart]').
    return isinstance(part, str) and (part in ("str", "int", "float", "bool", "function-after")
                                      or "[" in part or part.startswith(("function-", "constrained-")))
