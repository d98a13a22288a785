"""The JSON value types request models share (app/protocol.py, app/extra_fields.py): strict JSON
integers that fit int64, and the schema marker for bounds only the running server knows."""
from __future__ import annotations

from typing import Annotated, Any

from pydantic import BeforeValidator, Field

MAX_N = 128  # OpenAI's bound on n
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # JSON integers must fit the engine's int64 fields

# Schema extension naming a bound only the running server knows (see app/openapi.py):
# "vocab" = a token id (< vocabulary size), "context" = a token count (< max_model_len).
BOUND_KEY = "x-pagedserve-bound"
# Schema extension naming the app.admission.AdmissionLimits field that bounds this node (a list's
# maxItems, an object's maxProperties, an integer's maximum): filled in by app/openapi.py.
LIMIT_KEY = "x-pagedserve-limit"


def json_integer(v: Any) -> Any:
    # JSON Schema counts 2.0 as an integer: take an integral float as that integer. orjson reads
    # integers past 64 bits as floats, rounded (-2**63 - 1 becomes -2**63): refuse those here,
    # before the rounding could carry them inside a bound.
    if type(v) is float and v.is_integer():
        if abs(v) >= 2**63:
            raise ValueError("integers must fit in 64 bits")
        return int(v)
    return v


# A JSON integer, strictly (no "12", no true). Constraints go before the validator in the
# Annotated list; after it, pydantic writes them into the schema as "ge"/"le", not JSON Schema.
AS_INT = BeforeValidator(json_integer)
Int = Annotated[int, AS_INT]
NonEmptyStr = Annotated[str, Field(min_length=1)]
# Bounded by the server's --max-logprobs (checked in app/admission.py, stated in /openapi.json).
NumLogprobs = Annotated[int, Field(ge=0, json_schema_extra={LIMIT_KEY: "max_logprobs"}), AS_INT]


# Schema extension naming the AdmissionLimits field that bounds a list's strings in all (their
# characters, or for a ``_bytes`` limit the list's size as JSON): JSON Schema cannot state it, so
# app/openapi.py writes it into the description.
TOTAL_KEY = "x-pagedserve-total"


def limited(limit_name: str, **constraints: Any) -> Any:
    """A Field bounded by an admission limit (app/admission.py checks it; the schema says it)."""
    return Field(json_schema_extra={LIMIT_KEY: limit_name}, **constraints)


def in_all(limit_name: str, **constraints: Any) -> Any:
    """A Field (a list of strings, or of tools) bounded in all by an admission limit."""
    return Field(json_schema_extra={TOTAL_KEY: limit_name}, **constraints)


# A name or id (a tool's, a message's, a call's, request_id, cache_salt, user...): at most
# --max-name-chars characters (app/admission.py).
Name = Annotated[str, limited("max_name_chars")]
NonEmptyName = Annotated[str, Field(min_length=1, json_schema_extra={LIMIT_KEY: "max_name_chars"})]
