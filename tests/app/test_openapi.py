"""GET /openapi.json: a valid OpenAPI 3.1 document that lists every route with every status it
can answer, and whose request schemas accept exactly what the server accepts."""
from __future__ import annotations

import json
import re

import httpx
import pytest
from jsonschema import Draft202012Validator
from openapi_spec_validator import validate as validate_openapi

from pagedserve.app.errors import APIError
from pagedserve.app.embeddings_protocol import EmbeddingRequest, ScoreRequest
from pagedserve.app.protocol import BOUND_KEY, ChatCompletionRequest, CompletionRequest, TokenizeRequest, parse
from pagedserve.app.openapi import OTHER_API_PREFIXES
from pagedserve.app.server import build_app
from tests.app.fake_engine import FakeAsyncEngine

CHAT = [{"role": "user", "content": "hi"}]
GENERATE = {"/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/score", "/score", "/v1/responses"}
ERROR_REF = {"$ref": "#/components/schemas/ErrorResponse"}
PROTECTED = {"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/models", "/tokenize", "/detokenize",
             "/v1/embeddings", "/v1/score", "/score"}


async def fetch_doc(api_key: str | None = None, max_body_bytes: int = 4096) -> dict:
    engine = FakeAsyncEngine()
    app = build_app(engine, served_model_name="fake-model", api_key=api_key, max_body_bytes=max_body_bytes)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
        r = await c.get("/openapi.json")  # never behind the API key
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")
    return r.json()


def app_operations(app) -> set[tuple[str, str]]:
    out = set()
    for route in app.routes:
        for method in route.methods or ():
            if (method != "HEAD" and route.path != "/openapi.json" and route.include_in_schema
                    and not route.path.startswith(OTHER_API_PREFIXES)):
                out.add((method.lower(), route.path))
    return out


@pytest.mark.parametrize("api_key", [None, "sk-test"])
async def test_document_is_valid_openapi(api_key):
    doc = await fetch_doc(api_key)
    validate_openapi(doc)  # raises with the offending path if not
    assert doc["openapi"].startswith("3.1")


async def test_every_route_is_listed():
    doc = await fetch_doc()
    app = build_app(FakeAsyncEngine(), served_model_name="fake-model")
    documented = {(m, p) for p, item in doc["paths"].items() for m in item}
    assert documented == app_operations(app)


@pytest.mark.parametrize("api_key", [None, "sk-test"])
async def test_every_status_is_documented_with_the_openai_error_body(api_key):
    doc = await fetch_doc(api_key, max_body_bytes=1234)
    error = doc["components"]["schemas"]["ErrorResponse"]
    assert error["properties"]["error"]["required"] == ["message", "type", "param", "code"]
    for path, item in doc["paths"].items():
        for method, op in item.items():
            statuses = set(op["responses"])
            expected = {"200", "408"}  # 408: --header-timeout (every request), --body-timeout
            if method == "post" and path != "/ping":  # POST /ping reads no body
                expected |= {"400", "404", "413", "415"}  # 415: a body that is not application/json
            if path in GENERATE or path in ("/health", "/ping"):
                expected.add("503")
            if api_key and path in PROTECTED:
                expected.add("401")
                assert op["security"] == [{"bearer": []}]
            assert statuses == expected, (path, statuses)
            for status, resp in op["responses"].items():
                if status != "200":
                    schema = resp["content"]["application/json"]["schema"]
                    assert ERROR_REF in schema.get("allOf", [schema]), (path, status)
    assert "1234 bytes" in doc["paths"]["/tokenize"]["post"]["responses"]["413"]["description"]
    for path, item in doc["paths"].items():
        for method, op in item.items():
            timeout = op["responses"]["408"]["description"]
            assert "--header-timeout" in timeout
            assert ("--body-timeout" in timeout) == (method == "post"), (path, timeout)
    assert "Retry-After" in doc["paths"]["/v1/completions"]["post"]["responses"]["503"]["headers"]
    assert ("securitySchemes" in doc["components"]) == bool(api_key)


async def test_run_time_bounds_are_written_in():
    doc = await fetch_doc()
    text = json.dumps(doc)
    assert BOUND_KEY not in text
    # pydantic writes constraints it cannot express as "ge"/"le": that would be a silent no-op
    assert not re.search(r'"(ge|le|gt|lt)":', text)
    schemas = doc["components"]["schemas"]
    vocab, ctx = FakeAsyncEngine().tokenizer.vocab_size, FakeAsyncEngine().max_model_len
    tokens = schemas["DetokenizeRequest"]["properties"]["tokens"]["items"]
    assert (tokens["minimum"], tokens["maximum"]) == (0, vocab - 1)
    max_tokens = schemas["ChatCompletionRequest"]["properties"]["max_completion_tokens"]["anyOf"][0]
    assert (max_tokens["minimum"], max_tokens["maximum"]) == (1, ctx - 1)
    dimensions = schemas["EmbeddingRequest"]["properties"]["dimensions"]["anyOf"][0]
    assert (dimensions["minimum"], dimensions["maximum"]) == (1, FakeAsyncEngine.embedding_size)
    # each allowed token id is bounded by the vocabulary, as the server checks (CI's fuzz found a
    # body the schema allowed that the server refused)
    allowed = schemas["ChatCompletionRequest"]["properties"]["allowed_token_ids"]["anyOf"][0]["items"]
    assert (allowed["minimum"], allowed["maximum"]) == (0, vocab - 1)


def body_validator(doc: dict, name: str) -> Draft202012Validator:
    return Draft202012Validator({"$ref": f"#/components/schemas/{name}", "components": doc["components"]})


ADMISSION_KIND = {CompletionRequest: "completions", ChatCompletionRequest: "chat", TokenizeRequest: "tokenize"}


def server_accepts(model, body: dict) -> bool:
    """As the server reads a body: the admission bounds (app/admission.py, default limits, the fake
    engine's vocabulary), then the request model."""
    from pagedserve.app.admission import AdmissionLimits, check_body

    try:
        if model in ADMISSION_KIND:
            check_body(ADMISSION_KIND[model], body, AdmissionLimits(), FakeAsyncEngine().tokenizer.vocab_size)
        req = parse(model, body)
        if isinstance(req, TokenizeRequest):
            req.check()
        elif isinstance(req, (EmbeddingRequest, ScoreRequest)):
            pass  # nothing beyond the model
        else:
            req.check_supported()
        for message in getattr(req, "messages", None) or []:
            message.text()  # content parts are checked here
    except APIError as e:
        assert e.status == 400
        return False
    return True


# Bodies on both sides of each rule: the schema and the models must agree on every one.
COMPLETION_BODIES = [
    {"prompt": "x"}, {"prompt": ""}, {"prompt": []}, {"prompt": [""]}, {"prompt": ["a", "b"]},
    {"prompt": [0.0, 3]}, {"prompt": [1.5]}, {"prompt": [True]}, {"prompt": ["1"]}, {"prompt": [-1]},
    {"prompt": [[1], []]}, {"prompt": [[1, 2], [3]]}, {"prompt": 5}, {"prompt": "x", "n": 2.0},
    {"prompt": "x", "n": "2"}, {"prompt": "x", "n": True}, {"prompt": "x", "n": 129},
    {"prompt": "x", "max_tokens": 0}, {"prompt": "x", "max_tokens": 3.0},
    {"prompt": "x", "seed": -1}, {"prompt": "x", "seed": 2**63}, {"prompt": "x", "seed": 2**63 - 1},
    {"prompt": "x", "priority": -(2**63)}, {"prompt": "x", "priority": 2**63},
    {"prompt": "x", "logit_bias": {"12": 5}}, {"prompt": "x", "logit_bias": {"a": 1}},
    {"prompt": "x", "logit_bias": {"-1": 1}}, {"prompt": "x", "logit_bias": {"1" * 19: 1}},
    {"prompt": "x", "logit_bias": {"12": 101}}, {"prompt": "x", "logit_bias": {"١٢": 1}},
    {"prompt": "x", "stop": ""}, {"prompt": "x", "stop": ["a", ""]}, {"prompt": "x", "stop": ["a"]},
    {"prompt": "x", "stop_token_ids": [-1]}, {"prompt": "x", "stop_token_ids": [10**17]},
    {"prompt": "x", "top_k": -2}, {"prompt": "x", "top_k": -1}, {"prompt": "x", "temperature": "1"},
    {"prompt": "x", "stream": 1}, {"prompt": "x", "suffix": ""}, {"prompt": "x", "suffix": "tail"},
    {"prompt": "x", "cache_salt": ""}, {"prompt": "x", "cache_salt": "tenant"},
    {"prompt": "x", "logprobs": 21}, {"prompt": "x", "unknown": [1]},
    {"prompt": "x", "repetition_penalty": 5e-324}, {"prompt": "x", "repetition_penalty": 1.2},
    {"prompt": "x", "prompt_embeds": "AAAA"}, {"prompt": "x", "prompt_embeds": None},
    {"prompt": "x", "add_special_tokens": False}, {"prompt": "x", "use_beam_search": True},
    {"prompt": "x", "truncate_prompt_tokens": 2}, {"prompt": "x", "return_tokens_as_token_ids": True},
    {"prompt": "x", "allowed_token_ids": []}, {"prompt": "x", "allowed_token_ids": [1.0]},  # fuzzer
]
CHAT_BODIES = [
    {"messages": CHAT}, {"messages": []}, {"messages": [{"role": "wizard", "content": "x"}]},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}]},
    {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
    {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
    {"messages": [{"role": "assistant", "content": "x", "tool_calls": []}]},
    {"messages": [{"role": "assistant", "content": "x", "tool_calls": [{"id": "1"}]}]},
    {"messages": CHAT, "tools": []}, {"messages": CHAT, "tools": [{"type": "function"}]},
    {"messages": CHAT, "tool_choice": "none"}, {"messages": CHAT, "tool_choice": "auto"},
    {"messages": CHAT, "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
     "tool_choice": {"type": "function", "function": {"name": "f"}}, "parallel_tool_calls": False},
    {"messages": CHAT, "tools": [{"type": "function", "function": {"name": ""}}]},
    {"messages": CHAT, "tool_choice": {"type": "function"}}, {"messages": CHAT, "tool_choice": "any"},
    {"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
    {"messages": CHAT, "function_call": None}, {"messages": CHAT, "functions": [{}]},
    {"messages": CHAT, "response_format": {"type": "text"}}, {"messages": CHAT, "response_format": {}},
    {"messages": CHAT, "response_format": {"type": "json_object"}},
    {"messages": CHAT, "logprobs": True, "top_logprobs": 20}, {"messages": CHAT, "top_logprobs": 21},
    {"messages": CHAT, "max_completion_tokens": 0}, {"messages": CHAT, "max_tokens": 1},
    # vLLM's extras and OpenAI's other fields (app/extra_fields.py)
    {"messages": CHAT, "use_beam_search": True}, {"messages": CHAT, "use_beam_search": False},
    {"messages": CHAT, "logits_processors": ["a"]}, {"messages": CHAT, "logits_processors": []},
    {"messages": CHAT, "chat_template_kwargs": {"messages": 1}},
    {"messages": CHAT, "chat_template_kwargs": {"enable_thinking": False}},
    {"messages": CHAT, "truncate_prompt_tokens": 0}, {"messages": CHAT, "truncate_prompt_tokens": 5},
    {"messages": CHAT, "prompt_logprobs": 21}, {"messages": CHAT, "prompt_logprobs": 2},
    {"messages": CHAT, "modalities": ["audio"]}, {"messages": CHAT, "modalities": ["text"]},
    {"messages": CHAT, "vllm_xargs": {"a": 1}}, {"messages": CHAT, "kv_transfer_params": {}},
    {"messages": CHAT, "audio": {}}, {"messages": CHAT, "echo": True, "documents": [{"a": "b"}]},
    {"messages": CHAT, "stream": True, "stream_options": {"continuous_usage_stats": True}},
    {"messages": CHAT, "use_beam_search": 0}, {"messages": CHAT, "logits_processors": 0},  # fuzzer
    {"messages": CHAT, "vllm_xargs": ""}, {"messages": CHAT, "mm_processor_kwargs": []},
]


TOKENIZE_BODIES = [
    {"prompt": "x"}, {"prompt": ""}, {"messages": CHAT}, {"prompt": "x", "messages": CHAT}, {},
    {"messages": [{"role": "tool", "tool_calls": [None]}]},  # found by the fuzzer
    {"messages": [{"role": "assistant", "content": "x", "tool_calls": []}]},
    {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
]


EMBEDDING_BODIES = [
    {"input": "x"}, {"input": ""}, {"input": []}, {"input": [""]}, {"input": ["a", "b"]}, {"input": 5},
    {"input": [0.0, 3]}, {"input": [1.5]}, {"input": [True]}, {"input": ["1"]}, {"input": [-1]},
    {"input": [[1], []]}, {"input": [[1, 2], [3]]}, {"input": ["a"] * 2049}, {"input": [[1]] * 2049},
    {"input": "x", "encoding_format": "base64"}, {"input": "x", "encoding_format": "int8"},
    {"input": "x", "dimensions": 0}, {"input": "x", "dimensions": 2.0}, {"input": "x", "dimensions": "2"},
    {"input": "x", "pooling_type": "mean"}, {"input": "x", "pooling_type": "max"},
    {"input": "x", "normalize": False}, {"input": "x", "normalize": 0}, {"input": "x", "priority": 2**63},
    {"input": "x", "user": "u"}, {"input": "x", "unknown": 1}, {},
]
SCORE_BODIES = [
    {"text_1": "a", "text_2": "b"}, {"text_1": "a", "text_2": ["b", "c"]}, {"text_1": ["a"], "text_2": []},
    {"text_1": "", "text_2": "b"}, {"text_1": ["a", ""], "text_2": "b"}, {"text_1": 1, "text_2": "b"},
    {"text_1": "a"}, {"text_1": "a", "text_2": "b", "pooling_type": "cls"},
]


async def test_schema_and_models_agree():
    doc = await fetch_doc()
    for model, bodies in ((CompletionRequest, COMPLETION_BODIES), (ChatCompletionRequest, CHAT_BODIES),
                          (TokenizeRequest, TOKENIZE_BODIES), (EmbeddingRequest, EMBEDDING_BODIES),
                          (ScoreRequest, SCORE_BODIES)):
        validator = body_validator(doc, model.__name__)
        for body in bodies:
            assert validator.is_valid(body) == server_accepts(model, body), body


async def test_tokenize_needs_exactly_one_of_prompt_or_messages():
    doc = await fetch_doc()
    validator = body_validator(doc, "TokenizeRequest")
    for body, ok in [({"prompt": "x"}, True), ({"messages": CHAT}, True), ({}, False),
                     ({"prompt": "x", "messages": CHAT}, False), ({"prompt": None, "messages": CHAT}, True),
                     ({"prompt": "x", "messages": None}, True), ({"prompt": None}, False)]:
        assert validator.is_valid(body) == ok, body


@pytest.mark.parametrize("raw, param", [
    (b'{"prompt": "x", "priority": -9223372036854775809}', "priority"),
    (b'{"prompt": "x", "seed": 18446744073709551616}', "seed"),
    (b'{"prompt": [1, 100000000000000000000]}', "prompt"),
])
async def test_integers_past_64_bits_are_refused_not_rounded(client, engine, raw, param):
    # orjson reads them as rounded floats: -2**63 - 1 came back as -2**63, inside the bound
    r = await client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert engine.calls == []


@pytest.mark.parametrize("path, body", [
    ("/detokenize", {"tokens": [300]}),  # found by the fuzzer: 404 came first
    ("/v1/completions", {"prompt": [300]}),
    ("/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "function"}]}),
    ("/tokenize", {"prompt": "x", "messages": CHAT}),
    ("/v1/chat/completions", {"messages": CHAT, "truncate_prompt_tokens": 10**6}),
    ("/v1/completions", {"prompt": "x", "truncate_prompt_tokens": 10**6}),
    ("/v1/chat/completions", {"messages": CHAT, "chat_template": "x"}),  # untrusted server
])
async def test_a_body_the_schema_refuses_is_a_400_even_for_an_unknown_model(client, path, body):
    # the body is validated before the model is looked up, so the status follows the schema
    r = await client.post(path, json={**body, "model": "not-served"})
    assert r.status_code == 400, r.text


@pytest.mark.parametrize("part", ["head", "body"])
async def test_the_408_the_server_sends_is_the_documented_error_body(part):
    """The read-timeout answer (app/http_protocol.py, written on the socket before the app sees
    a request) is an HTTP response whose body the document's ErrorResponse schema accepts."""
    from pagedserve.app.http_protocol import _response_408

    doc = await fetch_doc()
    raw = _response_408(part, 12.0)
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    assert lines[0] == "HTTP/1.1 408 Request Timeout"
    headers = dict(line.split(": ", 1) for line in lines[1:])
    assert headers["content-type"] == "application/json"
    assert int(headers["content-length"]) == len(body) and headers["connection"] == "close"
    err = json.loads(body)
    body_validator(doc, "ErrorResponse").validate(err)
    flag = "--header-timeout" if part == "head" else "--body-timeout"
    assert err["error"]["code"] == "request_timeout" and flag in err["error"]["message"]
    assert "12 s" in err["error"]["message"]
