"""Pydantic models of the OpenAI request schema (plus vLLM's extra sampling fields).

Unknown fields are ignored, as OpenAI does. Fields we know but do not support are declared so
the server can answer "unsupported" instead of silently ignoring them. Responses are plain
dicts serialized with orjson: building them is on the hot path of every stream chunk.
"""
from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from app.errors import APIError

MAX_LOGPROBS = 20


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())


class StreamOptions(OpenAIModel):
    include_usage: bool = False


class SamplingFields(OpenAIModel):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    n: int = Field(default=1, ge=1, le=128)
    best_of: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM extras
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    stop_token_ids: list[int] | None = None
    priority: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # vLLM's prefix-cache tenant key: only requests with an equal salt share cached KV blocks.
    cache_salt: str | None = None

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v: str | list[str] | None) -> list[str] | None:
        if v is None:
            return None
        stops = [v] if isinstance(v, str) else list(v)
        if any(s == "" for s in stops):
            raise ValueError("stop strings must not be empty")
        return stops

    @field_validator("cache_salt")
    @classmethod
    def _salt_not_empty(cls, v: str | None) -> str | None:
        if v is not None and not v:
            raise ValueError("cache_salt must be a non-empty string (or left out)")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias_keys(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v is None:
            return None
        for key, bias in v.items():
            try:
                int(key)
            except ValueError:
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}") from None
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias}")
        return v

    def check_common(self) -> None:
        if self.best_of is not None and self.best_of != self.n:
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
        return kw

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


PromptType = Union[str, list[str], list[int], list[list[int]]]


class CompletionRequest(SamplingFields):
    prompt: PromptType
    max_tokens: int | None = Field(default=None, ge=1)
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, v: Any) -> Any:
        # Decide the shape explicitly: pydantic's union would happily coerce "12" into an int.
        if isinstance(v, str):
            return v
        if not isinstance(v, list) or not v:
            raise ValueError("prompt must be a string, a list of strings, a list of token ids "
                             "or a list of token-id lists, and must not be empty")
        if all(isinstance(x, str) for x in v):
            return v
        if all(isinstance(x, int) and not isinstance(x, bool) for x in v):
            return v
        if all(isinstance(x, list) and x and all(isinstance(t, int) and not isinstance(t, bool)
                                                 for t in x) for x in v):
            return v
        raise ValueError("prompt must be a string, a list of strings, a list of token ids "
                         "or a list of non-empty token-id lists")

    def check_supported(self) -> None:
        self.check_common()
        if self.suffix:
            raise APIError.unsupported("suffix", "suffix is not supported")


class ContentPart(OpenAIModel):
    type: str
    text: str | None = None


class ChatMessage(OpenAIModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[Any] | None = None
    tool_call_id: str | None = None

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


class ResponseFormat(OpenAIModel):
    type: str = "text"


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: ResponseFormat | None = None

    def check_supported(self) -> None:
        self.check_common()
        for name in ("tools", "functions"):
            if getattr(self, name):
                raise APIError.unsupported(name, f"{name} are not supported")
        if self.tool_choice not in (None, "none"):
            raise APIError.unsupported("tool_choice", "tool_choice is not supported")
        if self.function_call not in (None, "none"):
            raise APIError.unsupported("function_call", "function_call is not supported")
        if self.response_format is not None and self.response_format.type != "text":
            raise APIError.unsupported("response_format",
                                       f"response_format type {self.response_format.type!r} is not "
                                       "supported (only 'text')")
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError.bad_request("top_logprobs requires logprobs to be true",
                                       param="top_logprobs")
        if self.continue_final_message and self.add_generation_prompt:
            raise APIError.bad_request("continue_final_message and add_generation_prompt cannot "
                                       "both be true", param="continue_final_message")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise APIError.bad_request("continue_final_message needs the last message to be from "
                                       "the assistant", param="continue_final_message")
        for message in self.messages:
            if message.tool_calls:
                raise APIError.unsupported("messages", "tool_calls in messages are not supported")

    def requested_max_tokens(self) -> int | None:
        # max_completion_tokens replaces the deprecated max_tokens; take it when both are given.
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def template_messages(self) -> list[dict[str, str]]:
        out = []
        for m in self.messages:
            msg = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            if m.name:
                msg["name"] = m.name
            out.append(msg)
        return out


class TokenizeRequest(OpenAIModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise APIError.bad_request("give exactly one of 'prompt' or 'messages'", param="prompt")


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: list[int]


def parse(model: type[OpenAIModel], data: Any) -> Any:
    """Validate a decoded JSON body; a validation failure becomes one clear 400 naming the field."""
    if not isinstance(data, dict):
        raise APIError.bad_request("the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from None


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
    else:
        message = f"Invalid value for '{param}': {msg}" if param else msg
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})"
    return APIError.bad_request(message, param=param)


def _is_union_branch(part: Any) -> bool:
    # pydantic puts the tried union member in the location (e.g. 'str', 'list[ContentPart]').
    return isinstance(part, str) and (part in ("str", "int", "float", "bool", "function-after")
                                      or "[" in part or part.startswith("function-"))
