"""Admission before work (issue 22): what one request may ask for is bounded before anything is
built for it, and a request past a bound gets a 400 (413 for a body) in OpenAI's format that
names the field and the limit. The fake engine's vocabulary is 256 tokens, its context 128."""
from __future__ import annotations

import httpx
import pytest

from pagedserve.app.admission import AdmissionLimits
from pagedserve.app.server import build_app
from tests.app.conftest import assert_openai_error
from tests.app.fake_engine import FakeAsyncEngine

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
COMPLETION = {"prompt": "hi", "max_tokens": 3}
ROUTES = [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)]
BIG_BODY = 64 * 1024 * 1024


@pytest.fixture
async def make_client():
    clients = []

    async def make(**limits):
        engine = FakeAsyncEngine()
        app = build_app(engine, served_model_name="fake-model", max_body_bytes=BIG_BODY,
                        limits=AdmissionLimits(**limits))
        c = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")
        clients.append(c)
        return c, engine, app.state.server

    yield make
    for c in clients:
        await c.aclose()


def refused(r: httpx.Response, param: str, limit: int, flag: str, status: int = 400) -> dict:
    err = assert_openai_error(r, status, param=param)
    assert str(limit) in err["message"] and flag in err["message"], err
    return err


@pytest.mark.parametrize("path,body", ROUTES)
@pytest.mark.parametrize("field,value,flag", [
    ("stop", [f"s{i}" for i in range(9)], "--max-stop-sequences"),
    ("stop_token_ids", list(range(9)), "--max-stop-token-ids"),
    ("bad_words", [f"w{i}" for i in range(9)], "--max-bad-words"),
    ("logit_bias", {str(i): 1.0 for i in range(9)}, "--max-logit-bias"),
])
async def test_list_fields_past_their_limit_are_400(make_client, path, body, field, value, flag):
    client, engine, _ = await make_client(max_stop_sequences=8, max_stop_token_ids=8, max_bad_words=8,
                                          max_logit_bias=8)
    r = await client.post(path, json={**body, field: value})
    refused(r, field, 8, flag)
    assert engine.calls == []
    # at the limit: served
    r = await client.post(path, json={**body, field: value[:8] if isinstance(value, list)
                                      else dict(list(value.items())[:8])})
    assert r.status_code == 200, r.text


async def test_huge_stop_list_is_refused_before_any_per_item_work(make_client, monkeypatch):
    # Refused from the list's length alone: the request model never validates the 50,000 strings
    # and no SamplingParams dedups or compiles them.
    import pagedserve.app.completions_route as route
    client, engine, server = await make_client()
    validated, built = [], []
    real_parse = route.parse
    monkeypatch.setattr(route, "parse", lambda *a, **k: validated.append(a) or real_parse(*a, **k))
    real_build = server.fanout.build_params
    server.fanout.build_params = lambda kw: built.append(kw) or real_build(kw)
    r = await client.post("/v1/completions", json={**COMPLETION, "stop": [f"stop{i}" for i in range(50_000)]})
    refused(r, "stop", AdmissionLimits().max_stop_sequences, "--max-stop-sequences")
    assert validated == [] and built == [] and engine.encode_calls == [] and engine.calls == []
    # the spies see a request within the limit
    r = await client.post("/v1/completions", json={**COMPLETION, "stop": ["a"]})
    assert len(validated) == 1 and len(built) == 1


@pytest.mark.parametrize("path,body", ROUTES)
async def test_logit_bias_outside_the_vocabulary_is_400(make_client, path, body):
    client, engine, _ = await make_client()
    r = await client.post(path, json={**body, "logit_bias": {"5": 1.0, "256": 1.0}})
    err = assert_openai_error(r, 400, param="logit_bias")
    assert "256" in err["message"] and "vocabulary" in err["message"]
    assert engine.calls == []
    r = await client.post(path, json={**body, "logit_bias": {"255": 1.0}})
    assert r.status_code == 200, r.text


async def test_too_many_messages_and_tools_are_400(make_client):
    client, engine, _ = await make_client(max_messages=4, max_tools=2)
    messages = [{"role": "user", "content": "x"}] * 5
    refused(await client.post("/v1/chat/completions", json={**CHAT, "messages": messages}),
            "messages", 4, "--max-messages")
    refused(await client.post("/tokenize", json={"messages": messages}), "messages", 4, "--max-messages")
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    refused(await client.post("/v1/chat/completions", json={**CHAT, "tools": [tool] * 3}),
            "tools", 2, "--max-tools")
    refused(await client.post("/tokenize", json={"messages": messages[:1], "tools": [tool] * 3}),
            "tools", 2, "--max-tools")
    assert engine.calls == [] and engine.chat_calls == []


async def test_too_many_prompts_is_400(make_client):
    client, engine, _ = await make_client(max_prompts=3)
    refused(await client.post("/v1/completions", json={**COMPLETION, "prompt": ["a"] * 4}),
            "prompt", 3, "--max-prompts")
    refused(await client.post("/v1/completions", json={**COMPLETION, "prompt": [[42]] * 4}),
            "prompt", 3, "--max-prompts")
    # one token-id prompt is one prompt, however long
    r = await client.post("/v1/completions", json={**COMPLETION, "prompt": [42] * 10})
    assert r.status_code == 200, r.text
    assert engine.encode_calls == []


async def test_fan_out_is_refused_before_anything_is_built(make_client):
    # 2,000 prompts x n 128 = 256,000 choices: refused from the two numbers, before a prompt is
    # checked or tokenized and before a single choice (or its SamplingParams) is built.
    client, engine, server = await make_client(max_prompts=4096)
    built, prompted, made = [], [], []
    real_build = server.fanout.build_params
    server.fanout.build_params = lambda kw: built.append(kw) or real_build(kw)
    real_prompts, real_make = server.completion.completion_prompts, server.fanout.make_choices
    server.completion.completion_prompts = lambda req: prompted.append(req) or real_prompts(req)
    server.fanout.make_choices = lambda *a, **k: made.append(a) or real_make(*a, **k)
    r = await client.post("/v1/completions", json={"prompt": [[42]] * 2000, "n": 128, "max_tokens": 1})
    err = refused(r, "n", AdmissionLimits().max_request_choices, "--max-request-choices")
    assert "256000" in err["message"]
    assert prompted == [] and made == [] and built == [] and engine.calls == []
    # the spies see a request within the limit: its params built once, a choice per prompt x n
    r = await client.post("/v1/completions", json={"prompt": [[42]] * 2, "n": 3, "max_tokens": 1})
    assert r.status_code == 200, r.text
    assert len(prompted) == 1 and len(made) == 1 and len(built) == 1 and len(engine.calls) == 6


@pytest.mark.parametrize("path,body", ROUTES)
async def test_best_of_and_beam_width_count_as_choices(make_client, path, body):
    client, engine, _ = await make_client(max_request_choices=4)
    r = await client.post(path, json={**body, "n": 2, "best_of": 5, "use_beam_search": True})
    refused(r, "best_of", 4, "--max-request-choices")
    r = await client.post(path, json={**body, "n": 5})
    refused(r, "n", 4, "--max-request-choices")
    r = await client.post(path, json={**body, "n": 4})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("path,body", ROUTES)
async def test_token_commitment_past_the_limit_is_400(make_client, path, body):
    # 4 choices x (2 prompt tokens + 30) = 128 tokens (chat: more prompt tokens: the template)
    client, engine, _ = await make_client(max_request_tokens=100)
    r = await client.post(path, json={**body, "n": 4, "max_tokens": 30})
    err = refused(r, "max_tokens", 100, "--max-request-tokens")
    assert err["code"] == "request_limit_exceeded"
    assert engine.calls == []
    r = await client.post(path, json={**body, "n": 1, "max_tokens": 30})
    assert r.status_code == 200, r.text


async def test_logprobs_bounded_by_max_logprobs(make_client):
    client, engine, _ = await make_client(max_logprobs=3)
    refused(await client.post("/v1/completions", json={**COMPLETION, "logprobs": 4}),
            "logprobs", 3, "--max-logprobs")
    refused(await client.post("/v1/chat/completions", json={**CHAT, "logprobs": True, "top_logprobs": 4}),
            "top_logprobs", 3, "--max-logprobs")
    refused(await client.post("/v1/completions", json={**COMPLETION, "prompt_logprobs": 4}),
            "prompt_logprobs", 3, "--max-logprobs")
    assert engine.calls == []
    r = await client.post("/v1/completions", json={**COMPLETION, "logprobs": 3})
    assert r.status_code == 200, r.text


async def test_logprobs_above_20_where_the_server_allows_them(make_client):
    # --max-logprobs 50: the request model no longer stops at a hard-coded 20
    client, engine, _ = await make_client(max_logprobs=50)
    r = await client.post("/v1/completions", json={**COMPLETION, "logprobs": 30})
    assert r.status_code == 200, r.text
    assert engine.calls[-1].params.logprobs == 30
    r = await client.post("/v1/chat/completions", json={**CHAT, "logprobs": True, "top_logprobs": 50})
    assert r.status_code == 200, r.text
    refused(await client.post("/v1/completions", json={**COMPLETION, "logprobs": 51}),
            "logprobs", 50, "--max-logprobs")
    client, engine, _ = await make_client(max_logprobs=-1)  # no cap
    r = await client.post("/v1/completions", json={**COMPLETION, "prompt_logprobs": 200})
    assert r.status_code == 200, r.text


def test_max_logprobs_is_the_engines_number():
    # The engine serves whatever its max_logprobs says (tests/engine/test_max_logprobs.py): the
    # admission limit may be above vLLM's default 20, or -1 (no cap), never below that.
    AdmissionLimits(max_logprobs=50)
    AdmissionLimits(max_logprobs=-1)
    with pytest.raises(ValueError, match="max_logprobs"):
        AdmissionLimits(max_logprobs=-2)
    with pytest.raises(ValueError, match="max_stop_sequences"):
        AdmissionLimits(max_stop_sequences=-1)


@pytest.mark.parametrize("path,body", [
    ("/tokenize", {"prompt": "x" * 5000}),
    ("/detokenize", {"tokens": [65] * 2000}),
])
async def test_tokenize_bodies_are_bounded(make_client, path, body):
    client, engine, _ = await make_client(max_tokenize_body_bytes=4096)
    r = await client.post(path, json=body)
    err = assert_openai_error(r, 413)
    assert "4096" in err["message"] and "--max-tokenize-body-bytes" in err["message"]
    assert engine.encode_calls == []


async def test_tokenize_return_token_strs_is_bounded(make_client):
    client, engine, _ = await make_client(max_tokenize_body_bytes=1 << 20, max_token_strs=10)
    r = await client.post("/tokenize", json={"prompt": "x" * 11, "return_token_strs": True})
    refused(r, "return_token_strs", 10, "--max-token-strs")
    r = await client.post("/tokenize", json={"prompt": "x" * 11})
    assert r.status_code == 200 and r.json()["count"] == 11
    r = await client.post("/tokenize", json={"prompt": "x" * 10, "return_token_strs": True})
    assert r.status_code == 200 and r.json()["token_strs"] == ["x"] * 10


def test_limit_flags_share_the_config_field_names():
    import argparse
    import dataclasses

    from pagedserve.app.serve_cmd import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--max-stop-sequences", "7", "--max-logit-bias", "9"])
    limits = AdmissionLimits.from_args(args)
    assert limits.max_stop_sequences == 7 and limits.max_logit_bias == 9
    defaults = AdmissionLimits()
    for f in dataclasses.fields(AdmissionLimits):
        flag = "--" + f.name.replace("_", "-")
        assert flag in parser.format_help(), flag
        if f.name not in ("max_stop_sequences", "max_logit_bias"):
            assert getattr(limits, f.name) == getattr(defaults, f.name)


@pytest.mark.parametrize("maximum", [0, 1, 9, 10, 19, 100, 255, 999, 1000, 4095, 49151])
def test_int_range_pattern_matches_exactly_the_ids_up_to_maximum(maximum):
    import re

    from pagedserve.app.admission import int_range_pattern

    pattern = re.compile(int_range_pattern(maximum))
    for i in range(0, maximum * 2 + 20):
        assert bool(pattern.match(str(i))) == (i <= maximum), (i, pattern.pattern)
    for key in ("00", "01", "-1", "", "1a", " 1"):
        assert not pattern.match(key), key


def test_the_limits_are_published_in_the_schema():
    from pagedserve.app.openapi import build_openapi

    limits = AdmissionLimits(max_stop_sequences=7, max_logit_bias=9, max_messages=11, max_tools=5,
                             max_prompts=13, max_logprobs=4, max_stop_token_ids=6, max_bad_words=8,
                             max_tokenize_body_bytes=1000)
    doc = build_openapi(served_model_name="m", max_model_len=64, vocab_size=256, api_key=False,
                        max_body_bytes=4096, version="0", limits=limits)
    schemas = doc["components"]["schemas"]

    def branch(props, name, type_):
        node = props[name]
        return node if node.get("type") == type_ else next(b for b in node["anyOf"] if b.get("type") == type_)

    for req in ("CompletionRequest", "ChatCompletionRequest"):
        props = schemas[req]["properties"]
        assert branch(props, "stop", "array")["maxItems"] == 7
        assert branch(props, "stop_token_ids", "array")["maxItems"] == 6
        assert branch(props, "bad_words", "array")["maxItems"] == 8
        bias = branch(props, "logit_bias", "object")
        assert bias["maxProperties"] == 9 and list(bias["patternProperties"]) == ["^(0|[1-9]|[1-9][0-9]{1}|1[0-9]{2}|2[0-4][0-9]{1}|25[0-4]|255)$"]
        assert branch(props, "prompt_logprobs", "integer")["maximum"] == 4
    comp = schemas["CompletionRequest"]["properties"]
    assert branch(comp, "logprobs", "integer")["maximum"] == 4
    assert [b.get("maxItems") for b in comp["prompt"]["anyOf"]] == [None, 13, None, 13]
    chat = schemas["ChatCompletionRequest"]["properties"]
    assert chat["messages"]["maxItems"] == 11 and branch(chat, "tools", "array")["maxItems"] == 5
    assert branch(chat, "top_logprobs", "integer")["maximum"] == 4
    tok = schemas["TokenizeRequest"]["properties"]
    assert branch(tok, "messages", "array")["maxItems"] == 11 and branch(tok, "tools", "array")["maxItems"] == 5
    assert "1000 bytes" in doc["paths"]["/tokenize"]["post"]["responses"]["413"]["description"]
    assert "4096 bytes" in doc["paths"]["/v1/completions"]["post"]["responses"]["413"]["description"]
    assert "x-pagedserve-limit" not in str(doc)


@pytest.mark.parametrize("path,body,echo", [
    ("/v1/completions", {**COMPLETION, "prompt": ["ab", "cd"], "prompt_logprobs": 1}, False),
    ("/v1/completions", {**COMPLETION, "prompt": ["ab", "cd"], "logprobs": 1, "echo": True}, True),
    ("/v1/chat/completions", {**CHAT, "prompt_logprobs": 1}, False),
])
async def test_prompt_logprobs_are_computed_once_per_prompt_not_per_choice(make_client, path, body, echo):
    # n choices of one prompt each ran a full prefill without the prefix cache for the same
    # prompt logprobs; one per prompt is enough, the others share it.
    client, engine, _ = await make_client()
    r = await client.post(path, json={**body, "n": 3})
    assert r.status_code == 200, r.text
    asked = [c.params.prompt_logprobs is not None for c in engine.calls]
    assert asked == [int(c.request_id.rsplit("-", 1)[1]) == 0 for c in engine.calls] and sum(asked) >= 1
    choices = r.json()["choices"]
    if path == "/v1/completions":
        for p in range(2):
            group = choices[p * 3:(p + 1) * 3]
            if echo:
                tops = [c["logprobs"]["top_logprobs"][:2] for c in group]
            else:
                tops = [c["prompt_logprobs"] for c in group]
            assert tops[0] is not None and tops[0][1] is not None and tops.count(tops[0]) == 3, tops
    else:
        assert r.json()["prompt_logprobs"][1] is not None


async def test_streamed_echo_logprobs_still_get_prompt_logprobs_for_every_choice(make_client):
    client, engine, _ = await make_client()
    r = await client.post("/v1/completions", json={**COMPLETION, "logprobs": 1, "echo": True, "n": 2,
                                                    "stream": True})
    assert r.status_code == 200
    assert all(c.params.prompt_logprobs == 1 for c in engine.calls) and len(engine.calls) == 2


# ---- found while checking "What must hold" (issue 22 follow-up) ------------------------------


async def test_choices_share_one_validation_of_the_request_lists(make_client, monkeypatch):
    # allowed_token_ids (up to the vocabulary), stop, bad_words, logit_bias were validated again
    # for every choice on the loop: 1,024 choices x a vocabulary-sized list is seconds. The lists
    # are validated once per request; the other choices are siblings that differ in max_tokens,
    # seed and prompt_logprobs only.
    from pagedserve.engine.sampling_params import SamplingParams

    client, engine, _ = await make_client()
    validated = []
    real = SamplingParams._check_token_masks
    monkeypatch.setattr(SamplingParams, "_check_token_masks", lambda self: validated.append(1) or real(self))
    r = await client.post("/v1/completions", json={
        "prompt": ["ab", "abcd"], "n": 3, "max_tokens": 2, "seed": 7, "stop": ["zz"], "prompt_logprobs": 1,
        "allowed_token_ids": list(range(200)), "logit_bias": {"5": 1.0}})
    assert r.status_code == 200, r.text
    assert len(validated) == 1
    params = [c.params for c in engine.calls]
    assert [p.seed for p in params] == [7, 8, 9] * 2
    assert [p.prompt_logprobs for p in params] == [1, None, None] * 2
    assert all(p.allowed_token_ids == list(range(200)) and p.stop == ["zz"] and p.logit_bias == {5: 1.0}
               and p.max_tokens == 2 and p.n == 1 for p in params)


@pytest.mark.parametrize("path,body", ROUTES)
async def test_allowed_token_ids_longer_than_the_vocabulary_are_400(make_client, path, body):
    client, engine, server = await make_client()
    validated = []
    real_build = server.fanout.build_params
    server.fanout.build_params = lambda kw: validated.append(kw) or real_build(kw)
    r = await client.post(path, json={**body, "allowed_token_ids": list(range(256)) * 2})
    err = assert_openai_error(r, 400, param="allowed_token_ids")
    assert "512" in err["message"] and "256" in err["message"]
    assert validated == [] and engine.calls == []
    r = await client.post(path, json={**body, "allowed_token_ids": list(range(256))})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("path,field", [("/v1/completions", "prompt"), ("/v1/embeddings", "input")])
async def test_token_id_prompts_past_the_context_are_refused_before_validation(make_client, monkeypatch,
                                                                                 path, field):
    # A 6 MB body of token ids took ~2 s of the loop to validate id by id before the context check
    # refused it; its length alone says it cannot fit.
    import pagedserve.app.completions_route as completions_route
    import pagedserve.app.embeddings_route as embeddings_route
    client, engine, _ = await make_client()
    validated = []
    for module in (completions_route, embeddings_route):
        real_parse = module.parse
        monkeypatch.setattr(module, "parse", lambda *a, _real=real_parse, **k: validated.append(a) or _real(*a, **k))
    extra = {"max_tokens": 1} if field == "prompt" else {}
    for value in ([5] * 100_000, [[5] * 3, [5] * 100_000]):
        r = await client.post(path, json={field: value, **extra})
        err = assert_openai_error(r, 400, param=field)
        assert err["code"] == "context_length_exceeded" and "100000" in err["message"], err
    assert validated == [] and engine.calls == []
    if field == "prompt":  # truncation keeps the end of a long id list: validated and served
        r = await client.post(path, json={field: [5] * 1000, "max_tokens": 1, "truncate_prompt_tokens": 10})
        assert r.status_code == 200, r.text


# ---- string lengths (issue 37 item 1) ------------------------------------------------------------
# Each string and the characters of each list of strings are bounded: one 1,000,000-character stop
# string froze the event loop 0.75 s (its matcher is built a character at a time on the loop).

STRING_LIMITS = {"max_stop_chars": 100, "max_bad_words_chars": 100, "max_name_chars": 100,
                 "max_tools_bytes": 1000, "max_chat_template_chars": 100}


def _code(r: httpx.Response) -> str:
    return r.json()["error"]["code"]


@pytest.mark.parametrize("path,body", ROUTES)
@pytest.mark.parametrize("field,value,at_limit,flag,code", [
    ("stop", "x" * 101, "x" * 100, "--max-stop-chars", "limit_exceeded"),
    ("stop", ["a", "x" * 101], ["a", "x" * 99], "--max-stop-chars", "limit_exceeded"),
    ("stop", ["x" * 60, "y" * 41], ["x" * 60, "y" * 40], "--max-stop-chars", "request_limit_exceeded"),
    ("bad_words", ["x" * 101], ["x" * 100], "--max-bad-words-chars", "limit_exceeded"),
    ("bad_words", ["x" * 60, "y" * 41], ["x" * 60, "y" * 40], "--max-bad-words-chars", "request_limit_exceeded"),
    ("cache_salt", "s" * 101, "s" * 100, "--max-name-chars", "limit_exceeded"),
    ("user", "u" * 101, "u" * 100, "--max-name-chars", "limit_exceeded"),
    ("request_id", "r" * 101, "r" * 100, "--max-name-chars", "limit_exceeded"),
])
async def test_strings_past_their_length_are_400(make_client, path, body, field, value, at_limit, flag, code):
    client, engine, _ = await make_client(**STRING_LIMITS)
    r = await client.post(path, json={**body, field: value})
    refused(r, field, 100, flag)
    assert _code(r) == code and engine.calls == []
    r = await client.post(path, json={**body, field: at_limit})
    assert r.status_code == 200, r.text


def _tool(name="get_weather", description="Weather of a city"):
    return {"type": "function", "function": {"name": name, "description": description,
                                             "parameters": {"type": "object", "properties": {}}}}


def _chat(**extra):
    return {**CHAT, "tool_choice": "none", **extra}


@pytest.mark.parametrize("path,body,param,flag", [
    ("/v1/chat/completions", _chat(tools=[_tool(name="f" * 101)]), "tools.0.function.name", "--max-name-chars"),
    ("/v1/chat/completions", _chat(tools=[_tool(), _tool(description="d" * 1000)]), "tools", "--max-tools-bytes"),
    ("/v1/chat/completions", _chat(tools=[_tool()], tool_choice={"type": "function", "function": {"name": "f" * 101}}),
     "tool_choice.function.name", "--max-name-chars"),
    ("/v1/chat/completions", _chat(messages=[{"role": "user", "content": "hi", "name": "n" * 101}]),
     "messages.0.name", "--max-name-chars"),
    ("/v1/chat/completions", _chat(messages=[
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "i" * 101, "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]),
     "messages.1.tool_calls.0.id", "--max-name-chars"),
    ("/v1/chat/completions", _chat(messages=[
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f" * 101, "arguments": "{}"}}]}]),
     "messages.1.tool_calls.0.function.name", "--max-name-chars"),
    ("/v1/chat/completions", _chat(messages=[{"role": "user", "content": "hi"},
                                             {"role": "tool", "tool_call_id": "t" * 101, "content": "x"}]),
     "messages.1.tool_call_id", "--max-name-chars"),
    ("/v1/chat/completions", _chat(chat_template="{{ messages }}" + " " * 100), "chat_template",
     "--max-chat-template-chars"),
    ("/tokenize", {"messages": CHAT["messages"], "tools": [_tool(description="d" * 1000)]}, "tools",
     "--max-tools-bytes"),
    ("/tokenize", {"messages": CHAT["messages"], "chat_template": "{{ messages }}" + " " * 100}, "chat_template",
     "--max-chat-template-chars"),
    ("/v1/responses", {"input": "hi", "tools": [{"type": "function", "name": "f" * 101, "parameters": {}}]},
     "tools.0.name", "--max-name-chars"),
    ("/v1/responses", {"input": "hi", "tools": [{"type": "function", "name": "f", "description": "d" * 1000}]},
     "tools", "--max-tools-bytes"),
    ("/v1/responses", {"input": "hi", "request_id": "r" * 101}, "request_id", "--max-name-chars"),
    ("/v1/embeddings", {"input": "hi", "user": "u" * 101}, "user", "--max-name-chars"),
    ("/score", {"text_1": "a", "text_2": "b", "request_id": "r" * 101}, "request_id", "--max-name-chars"),
])
async def test_names_tools_and_templates_past_their_length_are_400(make_client, path, body, param, flag):
    client, engine, _ = await make_client(**STRING_LIMITS)
    refused(await client.post(path, json=body), param, 1000 if "tools-bytes" in flag else 100, flag)
    assert engine.calls == []


async def test_tools_at_their_size_limit_are_served(make_client):
    import orjson

    client, engine, _ = await make_client(**STRING_LIMITS)
    tools = [_tool()]
    pad = 1000 - len(orjson.dumps([_tool(description="")]))
    tools = [_tool(description="d" * pad)]
    assert len(orjson.dumps(tools)) == 1000
    r = await client.post("/v1/chat/completions", json=_chat(tools=tools))
    assert r.status_code == 200, r.text


async def test_a_megabyte_stop_string_is_refused_before_any_per_character_work(make_client, monkeypatch):
    """Before the request model validates it, before any SamplingParams or stop matcher."""
    import pagedserve.app.completions_route as route
    from pagedserve.engine.stop_matcher import StopMatcher

    client, engine, server = await make_client()
    validated, built = [], []
    real_parse = route.parse
    monkeypatch.setattr(route, "parse", lambda *a, **k: validated.append(a) or real_parse(*a, **k))
    monkeypatch.setattr(StopMatcher, "__init__", lambda *a: built.append(a))
    for stop in ("x" * 1_000_000, ["x" * 200] * 200):
        r = await client.post("/v1/completions", json={**COMPLETION, "stop": stop})
        refused(r, "stop", AdmissionLimits().max_stop_chars, "--max-stop-chars")
    assert validated == [] and built == [] and engine.calls == []


def test_string_limits_are_published_in_the_schema():
    from pagedserve.app.openapi import build_openapi

    limits = AdmissionLimits(**STRING_LIMITS)
    doc = build_openapi(served_model_name="m", max_model_len=64, vocab_size=256, api_key=False,
                        max_body_bytes=4096, version="0", limits=limits, trust_request_chat_template=True)
    schemas = doc["components"]["schemas"]

    def strings(node):
        return [b for b in node.get("anyOf", [node]) if b.get("type") == "string"]

    comp = schemas["CompletionRequest"]["properties"]
    stop = comp["stop"]["anyOf"]
    assert [b["maxLength"] for b in stop if b.get("type") == "string"] == [100]
    assert [b["items"]["maxLength"] for b in stop if b.get("type") == "array"] == [100]
    assert "100 characters in all" in str(comp["stop"]) and "--max-stop-chars" in str(comp["stop"])
    bad = next(b for b in comp["bad_words"]["anyOf"] if b.get("type") == "array")
    assert bad["items"]["maxLength"] == 100 and "--max-bad-words-chars" in str(comp["bad_words"])
    for name in ("user", "cache_salt", "request_id"):
        assert [b["maxLength"] for b in strings(comp[name])] == [100], name
    chat = schemas["ChatCompletionRequest"]["properties"]
    assert [b["maxLength"] for b in strings(chat["chat_template"])] == [100]
    assert "1000 bytes" in str(chat["tools"]) and "--max-tools-bytes" in str(chat["tools"])
    assert schemas["FunctionDefinition"]["properties"]["name"]["maxLength"] == 100
    assert "x-pagedserve" not in str(doc)


def test_the_work_a_stop_list_costs_on_the_loop_is_small_at_the_default_limit():
    """The stop matcher is built as the request is added, on the event loop, in time linear in
    the characters (engine/stop_matcher.py): at --max-stop-chars it must stay a few milliseconds
    (about 6 ms measured here, on a loaded 2-core box; a 1,000,000-character string took 0.7 s)."""
    import time

    from pagedserve.engine.stop_matcher import StopMatcher

    limit = AdmissionLimits().max_stop_chars
    per = limit // AdmissionLimits().max_stop_sequences
    stops = tuple(f"{i:04d}" + "x" * (per - 4) for i in range(AdmissionLimits().max_stop_sequences))
    assert sum(map(len, stops)) == limit

    def build() -> float:
        t0 = time.process_time()
        StopMatcher(stops)
        return time.process_time() - t0

    assert min(build() for _ in range(3)) < 0.1
