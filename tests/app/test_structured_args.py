"""Each way of asking for structured outputs reaches the engine as the same StructuredOutputsParams
(chat and completions), and the token-mask fields pass through; shapes the API can judge itself
are 400s naming the field."""
from __future__ import annotations

import pytest

from tests.app.conftest import assert_openai_error

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"prompt": "hi", "max_tokens": 2}


@pytest.mark.parametrize("extra, kind, value", [
    ({"response_format": {"type": "json_object"}}, "json_object", True),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA,
                                                                 "strict": True}}}, "json", SCHEMA),
    ({"structured_outputs": {"json": SCHEMA}}, "json", SCHEMA),
    ({"structured_outputs": {"regex": "[0-9]+", "disable_any_whitespace": True}}, "regex", "[0-9]+"),
    ({"structured_outputs": {"choice": ["x", "y"]}}, "choice", ["x", "y"]),
    ({"structured_outputs": {"grammar": 'root ::= "a"'}}, "grammar", 'root ::= "a"'),
    ({"structured_outputs": {"json_object": True}}, "json_object", True),
    ({"guided_json": SCHEMA}, "json", SCHEMA),
    ({"guided_json": '{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}'},
     "json", SCHEMA),
    ({"guided_regex": "[0-9]+"}, "regex", "[0-9]+"),
    ({"guided_choice": ["x", "y"]}, "choice", ["x", "y"]),
    ({"guided_grammar": 'root ::= "a"'}, "grammar", 'root ::= "a"'),
])
@pytest.mark.parametrize("path, base", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)])
async def test_every_field_reaches_the_engine(client, engine, path, base, extra, kind, value):
    r = await client.post(path, json={**base, **extra, "n": 2})
    assert r.status_code == 200, r.text
    assert len(engine.calls) == 2
    for call in engine.calls:
        so = call.params.structured_outputs
        assert so.kind == kind and getattr(so, kind) == value


async def test_free_request_has_no_constraint(client, engine):
    r = await client.post("/v1/chat/completions", json={**CHAT, "response_format": {"type": "text"}})
    assert r.status_code == 200
    p = engine.calls[0].params
    assert p.structured_outputs is None and p.allowed_token_ids is None and p.bad_words is None


async def test_token_mask_fields_pass_through(client, engine):
    r = await client.post("/v1/completions", json={**COMPLETION, "allowed_token_ids": [5, 6],
                                                   "bad_words": ["no"]})
    assert r.status_code == 200, r.text
    assert engine.calls[0].params.allowed_token_ids == [5, 6]
    assert engine.calls[0].params.bad_words == ["no"]


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}}, "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"guided_json": SCHEMA, "guided_regex": "a"}, "guided_regex"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_json": "{oops"}, "guided_json"),
    ({"allowed_token_ids": [-1]}, "allowed_token_ids.0"),
    ({"bad_words": ["ok", ""]}, "bad_words"),
])
async def test_bad_shapes_400(client, engine, extra, param):
    assert_openai_error(await client.post("/v1/chat/completions", json={**CHAT, **extra}), 400, param)
    assert engine.calls == []


@pytest.mark.parametrize("path, base", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)])
async def test_an_unknown_key_in_structured_outputs_is_a_400_naming_it(client, engine, path, base):
    """Issue 37 item 8: it was dropped silently (the output then was not what was asked)."""
    r = await client.post(path, json={**base, "structured_outputs": {"regex": "[0-9]+", "regexp_flags": "i"}})
    err = assert_openai_error(r, 400, "structured_outputs.regexp_flags")
    assert "regexp_flags" in err["message"]
    assert engine.calls == []


async def test_vllms_own_structured_outputs_keys_at_their_defaults_still_pass(client, engine):
    """vLLM's client sends its whole StructuredOutputsParams (dataclasses.asdict): every key is known."""
    so = {"json": None, "regex": "[0-9]+", "choice": None, "grammar": None, "json_object": None,
          "disable_fallback": False, "disable_any_whitespace": False, "disable_additional_properties": False,
          "whitespace_pattern": None, "structural_tag": None, "_backend": None, "_backend_was_auto": False}
    r = await client.post("/v1/chat/completions", json={**CHAT, "structured_outputs": so})
    assert r.status_code == 200, r.text
    assert engine.calls[0].params.structured_outputs.regex == "[0-9]+"


async def test_vllms_output_changing_structured_outputs_keys_are_refused_unless_null(client, engine):
    r = await client.post("/v1/chat/completions", json={
        **CHAT, "structured_outputs": {"json": SCHEMA, "whitespace_pattern": "[ ]*"}})
    assert_openai_error(r, 400, "structured_outputs.whitespace_pattern")
    assert engine.calls == []
