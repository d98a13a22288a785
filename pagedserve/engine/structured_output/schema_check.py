"""JSON-schema keywords the grammar engine accepts but does not enforce, refused up front.

xgrammar 0.2 compiles these without error yet lets through documents that break them (measured:
an output could then fail the client's own validation), so a request using them gets a 400
naming the keyword instead of output that only looks constrained. ``oneOf`` is compiled as
``anyOf`` (right for the usual discriminated unions) and is allowed.
"""
from __future__ import annotations

from typing import Any

# keyword -> why it is refused
UNENFORCED = {
    "uniqueItems": "array items cannot be kept unique by the grammar",
    "not": "negated schemas cannot be expressed as a grammar",
    "if": "conditional schemas (if/then/else) are not supported",
    "then": "conditional schemas (if/then/else) are not supported",
    "else": "conditional schemas (if/then/else) are not supported",
    "dependentRequired": "dependentRequired is not supported",
    "dependentSchemas": "dependentSchemas is not supported",
    "dependencies": "dependencies is not supported",
}

# Keywords whose value is a map of name -> subschema, or a subschema, or a list of subschemas.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_VALUES = ("items", "additionalProperties", "contains", "propertyNames",
                  "unevaluatedProperties", "unevaluatedItems", "additionalItems")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")


def unsupported_keyword(schema: Any, path: str = "#") -> str | None:
    """The first refused construct as "<path>: <reason>", or None when the schema is fine."""
    if not isinstance(schema, dict):
        return None
    for key, why in UNENFORCED.items():
        if key in schema and not (key == "uniqueItems" and schema[key] is False):
            return f"{path}: '{key}' is not supported: {why}"
    ref = schema.get("$ref")
    if isinstance(ref, str) and not ref.startswith("#"):
        return f"{path}: '$ref' to {ref!r} is not supported: only local references ('#/...')"
    all_of = schema.get("allOf")
    if isinstance(all_of, list) and len(all_of) > 1:
        return f"{path}: 'allOf' with more than one schema is not supported"
    for key in _SCHEMA_MAPS:
        sub = schema.get(key)
        if isinstance(sub, dict):
            for name, s in sub.items():
                if (found := unsupported_keyword(s, f"{path}/{key}/{name}")) is not None:
                    return found
    for key in _SCHEMA_VALUES:
        if (found := unsupported_keyword(schema.get(key), f"{path}/{key}")) is not None:
            return found
    for key in _SCHEMA_LISTS:
        sub = schema.get(key)
        if isinstance(sub, list):
            for i, s in enumerate(sub):
                if (found := unsupported_keyword(s, f"{path}/{key}/{i}")) is not None:
                    return found
    return None
