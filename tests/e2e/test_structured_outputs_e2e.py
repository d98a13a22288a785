"""Structured outputs through a real server with the official openai client: response_format
(json_object, json_schema) on chat and completions, vLLM's structured_outputs and guided_*
fields, streamed and not; a bad schema is a 400 with the grammar library's reason and leaves the
server serving. The tiny random model makes the outputs random: the schemas are bounded so
every sampled output completes."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from tests.e2e.test_server_e2e import ServerProcess

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Lyon", "Nice"]},
        "population": {"type": "integer", "minimum": 0, "maximum": 999},
        "capital": {"type": "boolean"},
    },
    "required": ["city", "population", "capital"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Describe a French city as JSON."}]


@pytest.fixture(scope="module")
def server():
    s = ServerProcess()
    yield s
    assert s.stop() == 0, s.output()


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_chat_json_schema_sampled_outputs_validate(client):
    r = client.chat.completions.create(
        model="tiny", messages=MESSAGES, n=4, temperature=1.0, seed=3, max_tokens=100,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}})
    assert len(r.choices) == 4
    for c in r.choices:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.message.content), SCHEMA)


def test_chat_json_schema_streamed(client):
    stream = client.chat.completions.create(
        model="tiny", messages=MESSAGES, temperature=1.0, seed=4, max_tokens=100, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}})
    text, finish = "", None
    for chunk in stream:
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    assert finish == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)


def test_completions_guided_and_structured_outputs_fields(client):
    choices = ["alpha", "beta", "gamma"]
    r = client.completions.create(model="tiny", prompt="Pick one:", n=3, temperature=1.0, seed=5,
                                  max_tokens=20, extra_body={"guided_choice": choices})
    assert all(c.text in choices for c in r.choices)
    r = client.completions.create(model="tiny", prompt="An id:", n=3, temperature=1.0, seed=6,
                                  max_tokens=30, extra_body={"structured_outputs": {"regex": r"id-[0-9]{3}"}})
    assert all(re.fullmatch(r"id-[0-9]{3}", c.text) for c in r.choices), [c.text for c in r.choices]
    r = client.completions.create(model="tiny", prompt="JSON:", temperature=1.0, seed=7, max_tokens=100,
                                  extra_body={"guided_json": SCHEMA})
    jsonschema.validate(json.loads(r.choices[0].text), SCHEMA)
    r = client.completions.create(model="tiny", prompt="Yes or no:", temperature=0, max_tokens=20,
                                  extra_body={"guided_grammar": 'root ::= "yes" | "no"'})
    assert r.choices[0].text in ("yes", "no") and r.choices[0].finish_reason == "stop"


def test_completions_response_format_json_object(client):
    # Any JSON object: the random model is given a budget large enough to close it most times;
    # whatever it produced within the budget must be a prefix the grammar allowed.
    r = client.completions.create(model="tiny", prompt="{", temperature=0, max_tokens=200,
                                  extra_body={"response_format": {"type": "json_object"}})
    text = r.choices[0].text
    assert text.startswith("{")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize("extra, fragment", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "strin"}}}}}}, "strin"),
    ({"guided_json": {"type": "array", "uniqueItems": True}}, "uniqueItems"),
    ({"guided_regex": "a(b"}, "regex"),
    ({"structured_outputs": {"grammar": "root ::= nowhere"}}, "nowhere"),
    ({"guided_json": "{not json"}, "not valid JSON"),
    ({"guided_choice": ["a"], "guided_regex": "b"}, "not several"),
    ({"allowed_token_ids": [10**9]}, "vocabulary"),
    # each constraint alone is fine, together they admit no token: found by the fuzzer as a 500
    ({"guided_choice": ["hello"], "allowed_token_ids": [5]}, "no token satisfies"),
])
def test_bad_constraints_are_400_with_the_reason(client, extra, fragment):
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5, extra_body=extra)
    assert e.value.status_code == 400
    assert fragment in e.value.body["message"], e.value.body
    # The server still serves.
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, temperature=0)
    assert r.choices[0].finish_reason == "length"


def test_allowed_token_ids_and_bad_words(client):
    # Token 300 is "om", 301 is "il" (the default model's tokenizer).
    r = client.completions.create(model="tiny", prompt="x", temperature=1.0, seed=1, max_tokens=12,
                                  extra_body={"allowed_token_ids": [300, 301], "ignore_eos": True})
    assert r.usage.completion_tokens == 12
    assert re.fullmatch("(om|il)+", r.choices[0].text) and "om" in r.choices[0].text
    r = client.completions.create(model="tiny", prompt="x", temperature=1.0, seed=1, max_tokens=12,
                                  extra_body={"allowed_token_ids": [300, 301], "ignore_eos": True,
                                              "bad_words": ["om"]})
    assert r.choices[0].text == "il" * 12
