"""StructuredOutputsParams, allowed_token_ids and bad_words: shape checks at construction."""
from __future__ import annotations

import pytest

from pagedserve.engine.errors import SamplingParamsError
from pagedserve.engine.sampling_params import SamplingParams, StructuredOutputsParams


def test_exactly_one_kind():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a+", choice=["a"])
    assert StructuredOutputsParams(regex="a+").kind == "regex"
    assert StructuredOutputsParams(json_object=True).kind == "json_object"


@pytest.mark.parametrize("kwargs, fragment", [
    ({"json": "{not json"}, "not valid JSON"),
    ({"json": 5}, "JSON schema"),
    ({"json": "[1, 2]"}, "JSON schema"),
    ({"choice": []}, "non-empty"),
    ({"choice": ["a", 3]}, "strings"),
    ({"regex": ""}, "non-empty"),
    ({"grammar": 12}, "string"),
    ({"json_object": False}, "exactly one"),
])
def test_bad_shapes(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        StructuredOutputsParams(**kwargs)


def test_json_string_is_parsed_and_key_keeps_property_order():
    a = StructuredOutputsParams(json='{"type": "object", "properties": {"b": {}, "a": {}}}')
    b = StructuredOutputsParams(json={"type": "object", "properties": {"b": {}, "a": {}}})
    c = StructuredOutputsParams(json={"type": "object", "properties": {"a": {}, "b": {}}})
    assert isinstance(a.json, dict)
    assert a.key == b.key
    assert a.key != c.key  # property order decides the order of generation


def test_sampling_params_carry_structured_outputs():
    p = SamplingParams(structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    assert p.structured_outputs.choice == ["yes", "no"]
    # A plain dict (as some offline callers pass) is accepted too.
    p = SamplingParams(structured_outputs={"regex": "[0-9]+"})
    assert p.structured_outputs.regex == "[0-9]+"
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(structured_outputs={"regex": "a", "choice": ["b"]})
    assert e.value.param == "structured_outputs"


@pytest.mark.parametrize("kwargs, param, fragment", [
    ({"allowed_token_ids": []}, "allowed_token_ids", "at least one"),
    ({"allowed_token_ids": [1, -2]}, "allowed_token_ids", ">= 0"),
    ({"allowed_token_ids": "12"}, "allowed_token_ids", "list"),
    ({"bad_words": "word"}, "bad_words", "list"),
    ({"bad_words": ["ok", ""]}, "bad_words", "non-empty"),
])
def test_token_mask_fields_validated(kwargs, param, fragment):
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param
    assert fragment in str(e.value)


def test_token_mask_fields_normalised():
    p = SamplingParams(allowed_token_ids=[5, 3, 5], bad_words=["a", "a", "b"])
    assert p.allowed_token_ids == [5, 3]
    assert p.bad_words == ["a", "b"]
    assert SamplingParams().allowed_token_ids is None
