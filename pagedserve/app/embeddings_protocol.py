"""Request models of POST /v1/embeddings (OpenAI's) and POST /v1/score (vLLM's pair scoring).

Strict like app/protocol.py, and the published schema (app/openapi.py): every bound the
server enforces is a schema constraint; the embedding length (``dimensions``' upper bound) is
known only at run time and is marked with ``BOUND_KEY`` "embedding".
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import Field, field_validator

from pagedserve.app.json_types import AS_INT, BOUND_KEY, Name, NonEmptyName, NonEmptyStr
from pagedserve.app.protocol import INT64_MAX, INT64_MIN, OpenAIModel, TokenId
from pagedserve.app.protocol import _check_id_range, _is_json_int, _json_integer

MAX_INPUTS = 2048  # OpenAI's bound on the inputs of one embeddings request

Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX), AS_INT]
Dimensions = Annotated[int, Field(ge=1, json_schema_extra={BOUND_KEY: "embedding"}), AS_INT]
PoolingType = Literal["last", "mean", "cls"]

EmbeddingInput = Union[
    NonEmptyStr,
    Annotated[list[NonEmptyStr], Field(min_length=1, max_length=MAX_INPUTS)],
    Annotated[list[TokenId], Field(min_length=1)],
    Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1, max_length=MAX_INPUTS)],
]
ScoreText = Union[NonEmptyStr, Annotated[list[NonEmptyStr], Field(min_length=1, max_length=MAX_INPUTS)]]

_SHAPE = ("input must be a non-empty string, a list of non-empty strings, a list of token ids or a "
          "list of non-empty token-id lists (at most {n} inputs)")


def input_shape(v: Any) -> Any:
    """Decide the input's shape explicitly: a union would coerce "12" into an int (strict)."""
    message = _SHAPE.format(n=MAX_INPUTS)
    if isinstance(v, str):
        if not v:
            raise ValueError("input must not be empty")
        return v
    if not isinstance(v, list) or not v:
        raise ValueError(message)
    if all(isinstance(x, str) for x in v):
        if "" in v:
            raise ValueError("input strings must not be empty")
        if len(v) > MAX_INPUTS:
            raise ValueError(message)
        return v
    if all(_is_json_int(x) for x in v):
        return _check_id_range([_json_integer(x) for x in v])
    if all(isinstance(x, list) and x and all(_is_json_int(t) for t in x) for x in v):
        if len(v) > MAX_INPUTS:
            raise ValueError(message)
        return [_check_id_range([_json_integer(t) for t in ids]) for ids in v]
    raise ValueError(message)


class PoolingFields(OpenAIModel):
    """What both routes take beside their inputs."""

    model: Name | None = None
    user: Name | None = None
    # vLLM's extras
    request_id: Name | None = None  # names the response when no X-Request-Id header is sent
    priority: Int64 = 0
    add_special_tokens: bool = True  # BOS etc. around a text input
    # pagedserve: how the hidden states of the input become one vector (default "last", as
    # vLLM's embedding conversion of decoder models)
    pooling_type: PoolingType | None = None
    # vLLM's prefix-cache tenant key, as on chat and completions: only requests with an equal
    # salt share cached KV blocks.
    cache_salt: NonEmptyName | None = None


class EmbeddingRequest(PoolingFields):
    input: EmbeddingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Dimensions | None = None  # keep the first N values, then normalise
    normalize: bool | None = None  # vLLM's; default true

    @field_validator("input", mode="before")
    @classmethod
    def _input_shape(cls, v: Any) -> Any:
        return input_shape(v)


class ScoreRequest(PoolingFields):
    """vLLM's /score for an embedding model: the cosine of the two texts' embeddings; one text
    against one, one against many (either side), or two lists of equal length pairwise."""

    text_1: ScoreText
    text_2: ScoreText

    @field_validator("text_1", "text_2", mode="before")
    @classmethod
    def _text_shape(cls, v: Any) -> Any:
        if v == "" or (isinstance(v, list) and "" in v):
            raise ValueError("texts must not be empty")
        return v

