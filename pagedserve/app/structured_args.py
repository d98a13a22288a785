"""Request fields that constrain the output, shared by chat and completions: OpenAI's
``response_format`` (json_object, json_schema), vLLM's ``structured_outputs`` and its older
``guided_*`` aliases, and the token masks ``allowed_token_ids`` / ``bad_words``.

They become ``SamplingParams(structured_outputs=StructuredOutputsParams(...), allowed_token_ids,
bad_words)``. At most one source of structured outputs per request. Whether the grammar engine
accepts a schema is checked by the engine (``AsyncEngine.check_constraint``, off the loop)
before the request starts, so a bad one is a 400 carrying the library's reason.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pagedserve.app.errors import APIError
from pagedserve.engine.client import EngineClient
from pagedserve.app.json_types import AS_INT, BOUND_KEY, LIMIT_KEY, in_all, limited

BadWord = Annotated[str, Field(json_schema_extra={LIMIT_KEY: "max_bad_words_chars"})]
# 1.0 is an integer in JSON, as elsewhere; the schema bounds each id by the vocabulary, as the server does
_TokenId = Annotated[int, Field(ge=0, le=2**63 - 1, json_schema_extra={BOUND_KEY: "vocab"}), AS_INT]


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=(), strict=True)


class JsonSchemaFormat(_Model):
    name: str = Field(default="response", max_length=64)
    description: str | None = None
    # "schema" shadows a BaseModel attribute, hence the alias.
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Model):
    type: Literal["text", "json_object", "json_schema"] = "text"
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(_Model):
    """vLLM's ``structured_outputs`` object. A key vLLM's object does not have is a 400 naming it
    (it was dropped silently: issue 37); vLLM's own keys are all accepted, since its client sends
    the whole object (``dataclasses.asdict``), and those that would change the output
    (``whitespace_pattern``, ``structural_tag``) are refused unless null. Its ``disable_*`` flags
    are hints this server's grammar engine does not need."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=(), strict=True)

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_fallback: bool | None = None
    disable_any_whitespace: bool | None = None
    disable_additional_properties: bool | None = None
    whitespace_pattern: str | None = Field(default=None, json_schema_extra={"anyOf": [{"type": "null"}]})
    structural_tag: Any = Field(default=None, json_schema_extra={"anyOf": [{"type": "null"}]})
    backend_: str | None = Field(default=None, alias="_backend")
    backend_was_auto_: bool | None = Field(default=None, alias="_backend_was_auto")

    def check_supported(self) -> None:
        for name in ("whitespace_pattern", "structural_tag"):
            if getattr(self, name) is not None:
                raise APIError.unsupported(f"structured_outputs.{name}",
                                           f"structured_outputs.{name} is not supported")


class StructuredFields(_Model):
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM refuses an empty list (nothing could be sampled); the schema says so too.
    # At most the vocabulary's size (a longer list repeats ids: app/admission.py refuses it).
    allowed_token_ids: list[_TokenId] | None = Field(default=None, min_length=1,
                                                     json_schema_extra={BOUND_KEY: "vocab_items"})
    bad_words: Annotated[list[BadWord], limited("max_bad_words")] | None = in_all("max_bad_words_chars", default=None)

    def structured_source(self) -> tuple[str, dict[str, Any]] | None:
        """(request field, StructuredOutputsParams kwargs), or None when the output is free."""
        sources: list[tuple[str, dict[str, Any]]] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            sources.append(("response_format", {"json_object": True}))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise APIError.bad_request("response_format of type 'json_schema' needs "
                                           "json_schema.schema (the JSON schema of the output)",
                                           param="response_format")
            sources.append(("response_format", {"json": rf.json_schema.schema_}))
        so = self.structured_outputs
        if so is not None:
            so.check_supported()
            kw = {k: v for k, v in (("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                                    ("grammar", so.grammar), ("json_object", so.json_object))
                  if v is not None}
            sources.append(("structured_outputs", kw))
        for name, key in (("guided_json", "json"), ("guided_regex", "regex"),
                          ("guided_choice", "choice"), ("guided_grammar", "grammar")):
            value = getattr(self, name)
            if value is not None:
                sources.append((name, {key: value}))
        if len(sources) > 1:
            raise APIError.bad_request(
                "give one way of constraining the output, not several: got "
                + ", ".join(name for name, _ in sources), param=sources[1][0])
        return sources[0] if sources else None

    def constraint_kwargs(self) -> dict[str, Any]:
        """SamplingParams keyword arguments for the constraint fields (400 on a bad shape)."""
        from pagedserve.engine.sampling_params import StructuredOutputsParams

        kw: dict[str, Any] = {}
        source = self.structured_source()
        if source is not None:
            name, spec = source
            try:
                kw["structured_outputs"] = StructuredOutputsParams(**spec)
            except ValueError as e:
                raise APIError.bad_request(f"{name}: {e}", param=name) from None
        if self.allowed_token_ids is not None:
            kw["allowed_token_ids"] = list(self.allowed_token_ids)
        if self.bad_words is not None:
            kw["bad_words"] = list(self.bad_words)
        return kw

    def constraint_param(self) -> str | None:
        """The request field an engine refusal of the constraint is about."""
        source = self.structured_source()
        if source is not None:
            return source[0]
        return "allowed_token_ids" if self.allowed_token_ids is not None else None


async def check_constraint(engine: EngineClient, params: Any, param: str | None) -> None:
    """Ask the engine (off its loop) whether it can honour the constraint: a 400 with the grammar
    library's reason otherwise."""
    if not params.has_token_constraint:
        return
    from pagedserve.engine.errors import RequestRejectedError

    try:
        await engine.check_constraint(params)
    except RequestRejectedError as e:
        raise APIError.bad_request(str(e), param=param, code=e.code) from None
