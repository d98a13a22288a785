"""Request fields beyond the core sampling set: vLLM's extras and the OpenAI fields that do not
change the output. No field that would change the output is accepted and dropped: each one is
implemented, or accepted only at the value that changes nothing, anything else being a 400
that names it (code ``unsupported``); the schema (app/openapi.py) lists only what passes.
Fields no known API has are accepted and logged once per name, as vLLM does.

Mixed into the request models of app/protocol.py; the routes read them (app/prompt_options.py
turns them into prompt and template settings).
"""
from __future__ import annotations

import logging
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from pagedserve.app.errors import APIError
from pagedserve.app.json_types import AS_INT, BOUND_KEY, Name, NumLogprobs, limited

logger = logging.getLogger(__name__)

# A request's own chat template (app/admission.py bounds its length: it is parsed and compiled).
RequestTemplate = Annotated[str, limited("max_chat_template_chars")]
# A prompt length: keeps at least one token and leaves room for one generated token.
PromptTokens = Annotated[int, Field(ge=1, json_schema_extra={BOUND_KEY: "context"}), AS_INT]

_NULL = {"type": "null"}
_FALSE_OR_NULL = {"anyOf": [{"const": False}, _NULL]}
_EMPTY_LIST_OR_NULL = {"anyOf": [{"type": "array", "maxItems": 0}, _NULL]}
_EMPTY_OBJECT_OR_NULL = {"anyOf": [{"type": "object", "maxProperties": 0}, _NULL]}
_ONLY_NULL = {"anyOf": [_NULL]}
_TEXT_MODALITIES = {"anyOf": [{"type": "array", "items": {"const": "text"}}, _NULL]}
# Keys chat_template_kwargs may not hold: the conversation itself, the template (that is the
# ``chat_template`` field, behind --trust-request-chat-template), and any other name the render
# path takes as a parameter of its own ("self": a second value for it was a TypeError, a 500).
RESERVED_TEMPLATE_KWARGS = ("messages", "chat_template", "self")
# Render parameters a request may set through chat_template_kwargs, as in vLLM (they override
# the request's fields of the same name: app/prompt_options.py).
OVERRIDABLE_TEMPLATE_KWARGS = ("add_generation_prompt", "continue_final_message")
TEMPLATE_KWARGS_SCHEMA = {"anyOf": [{"type": "object", "propertyNames": {
    "not": {"enum": list(RESERVED_TEMPLATE_KWARGS)}}}, _NULL]}


class _Fields(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=(), strict=True)


class ExtraFields(_Fields):
    """vLLM's extras both generating routes take."""

    request_id: Name | None = None  # names the response when no X-Request-Id header is sent
    prompt_logprobs: NumLogprobs | None = None
    truncate_prompt_tokens: PromptTokens | None = None  # keep the last N prompt tokens
    return_tokens_as_token_ids: bool | None = None  # logprob tokens as "token_id:<id>"
    # Fast tokenizers (all of ours) decode the same either way, as in vLLM.
    spaces_between_special_tokens: bool = True
    length_penalty: float | None = None  # beam search only, as in vLLM (app/beam_requests.py)
    use_beam_search: bool | None = None
    logits_processors: list[Any] | None = Field(default=None, json_schema_extra=_EMPTY_LIST_OR_NULL)
    kv_transfer_params: Any = Field(default=None, json_schema_extra=_ONLY_NULL)
    vllm_xargs: dict[str, Any] | None = Field(default=None, json_schema_extra=_EMPTY_OBJECT_OR_NULL)

    def check_extra_fields(self, stream: bool) -> None:
        """``stream``: the request's own (declared beside these fields, in app.protocol)."""
        refused = {
            "logits_processors": (bool(self.logits_processors), "logits_processors are not supported"),
            "kv_transfer_params": (self.kv_transfer_params is not None,
                                   "kv_transfer_params (disaggregated serving) are not supported"),
            "vllm_xargs": (bool(self.vllm_xargs), "vllm_xargs (custom extensions) are not supported"),
        }
        for name, (bad, message) in refused.items():
            if bad:
                raise APIError.unsupported(name, message)
        if self.prompt_logprobs is not None and stream:
            raise APIError.bad_request("prompt_logprobs are not available when stream is true",
                                       param="prompt_logprobs")


class CompletionExtraFields(ExtraFields):
    add_special_tokens: bool = True  # BOS etc. around a text prompt
    prompt_embeds: Any = Field(default=None, json_schema_extra=_ONLY_NULL)

    def check_extra_fields(self, stream: bool) -> None:
        super().check_extra_fields(stream)
        if self.prompt_embeds is not None:
            raise APIError.unsupported("prompt_embeds", "prompt_embeds are not supported")


class ChatExtraFields(ExtraFields):
    """Chat: the template's inputs, echo, and OpenAI's fields that do not touch the text."""

    echo: bool = False  # the reply starts with the last message's content if it is the assistant's
    add_special_tokens: bool = False  # on top of what the template writes
    documents: list[dict[str, str]] | None = None  # for templates that render RAG documents
    chat_template: RequestTemplate | None = None  # needs --trust-request-chat-template
    chat_template_kwargs: dict[str, Any] | None = Field(default=None, json_schema_extra=TEMPLATE_KWARGS_SCHEMA)
    reasoning_effort: Name | None = None  # handed to the template, as vLLM
    include_reasoning: bool = True  # false: the reasoning (--reasoning-parser) is left out of the reply
    mm_processor_kwargs: dict[str, Any] | None = Field(default=None, json_schema_extra=_EMPTY_OBJECT_OR_NULL)
    audio: Any = Field(default=None, json_schema_extra=_ONLY_NULL)
    modalities: Any = Field(default=None, json_schema_extra=_TEXT_MODALITIES)
    verbosity: Any = Field(default=None, json_schema_extra=_ONLY_NULL)
    web_search_options: Any = Field(default=None, json_schema_extra=_ONLY_NULL)
    # OpenAI fields that leave the text as it is.
    prediction: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: Name | None = None
    prompt_cache_key: Name | None = None
    safety_identifier: Name | None = None

    def check_extra_fields(self, stream: bool) -> None:
        super().check_extra_fields(stream)
        refused = {
            "mm_processor_kwargs": (bool(self.mm_processor_kwargs), "multimodal inputs are not supported"),
            "audio": (self.audio is not None, "audio output is not supported"),
            "modalities": (self.modalities is not None and (not isinstance(self.modalities, list) or any(
                m != "text" for m in self.modalities)), "only the 'text' modality is supported"),
            "verbosity": (self.verbosity is not None, "verbosity is not supported"),
            "web_search_options": (self.web_search_options is not None, "web search is not supported"),
        }
        for name, (bad, message) in refused.items():
            if bad:
                raise APIError.unsupported(name, message)
        check_template_kwargs(self.chat_template_kwargs)


class TokenizeExtraFields(_Fields):
    """vLLM's /tokenize fields: messages count as chat would render them."""

    return_token_strs: bool | None = None  # also the token pieces
    documents: list[dict[str, str]] | None = None
    chat_template: RequestTemplate | None = None  # needs --trust-request-chat-template
    chat_template_kwargs: dict[str, Any] | None = Field(default=None, json_schema_extra=TEMPLATE_KWARGS_SCHEMA)
    mm_processor_kwargs: dict[str, Any] | None = Field(default=None, json_schema_extra=_EMPTY_OBJECT_OR_NULL)

    def check_extra_fields(self) -> None:
        if self.mm_processor_kwargs:
            raise APIError.unsupported("mm_processor_kwargs", "multimodal inputs are not supported")
        check_template_kwargs(self.chat_template_kwargs)


def check_template_kwargs(kwargs: dict[str, Any] | None) -> None:
    for key in RESERVED_TEMPLATE_KWARGS:
        if key in (kwargs or {}):
            raise APIError.bad_request(
                f"chat_template_kwargs may not set {key!r}"
                + (" (use the chat_template field)" if key == "chat_template" else ""),
                param="chat_template_kwargs")


_logged_ignored: set[str] = set()
_MAX_LOGGED_NAMES = 1024  # random names from a fuzzer must not grow the set without end


_MAX_NAMES_PER_LINE = 32  # one body's names in one warning line


def log_ignored_fields(model: type[BaseModel], data: dict[str, Any]) -> None:
    """Warn once per field name about body fields no model declares (accepted, unused). Stores
    and logs at most what the caps allow, whatever the body holds: a body of a million unknown
    keys costs one pass over them, no memory."""
    room = min(_MAX_LOGGED_NAMES - len(_logged_ignored), _MAX_NAMES_PER_LINE)
    if room <= 0:
        return
    fields = model.model_fields
    unknown: list[str] = []
    more = 0
    for k in data:
        if k in fields or k in _logged_ignored:
            continue
        if len(unknown) < room:
            unknown.append(k)
        else:
            more += 1
    if unknown:
        _logged_ignored.update(unknown)
        logger.warning("The following fields were present in the request but ignored: %s%s",
                       sorted(unknown), f" (and {more} more)" if more else "")
