"""Every request field that changes the output is implemented or refused with a 400 naming it;
unknown fields are accepted and logged once per name."""
from __future__ import annotations

import logging

import httpx
import pytest

from pagedserve.app.server import build_app
from tests.app.conftest import assert_openai_error, sse_payloads
from tests.app.fake_engine import FakeAsyncEngine

USER = [{"role": "user", "content": "Hi"}]
CHAT = {"messages": USER, "max_tokens": 3}
COMPLETION = {"prompt": "Hello there", "max_tokens": 3}


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {**CHAT, "use_beam_search": True, "stream": True}, "stream"),
    ("/v1/completions", {**COMPLETION, "use_beam_search": True, "logprobs": 1}, "logprobs"),
    ("/v1/completions", {**COMPLETION, "logits_processors": ["my.Processor"]}, "logits_processors"),
    ("/v1/chat/completions", {**CHAT, "kv_transfer_params": {"a": 1}}, "kv_transfer_params"),
    ("/v1/chat/completions", {**CHAT, "vllm_xargs": {"a": 1}}, "vllm_xargs"),
    ("/v1/completions", {**COMPLETION, "prompt_embeds": "AAAA"}, "prompt_embeds"),
    ("/v1/chat/completions", {**CHAT, "audio": {"voice": "x"}}, "audio"),
    ("/v1/chat/completions", {**CHAT, "modalities": ["text", "audio"]}, "modalities"),
    ("/v1/chat/completions", {**CHAT, "web_search_options": {}}, "web_search_options"),
    ("/v1/chat/completions", {**CHAT, "verbosity": "low"}, "verbosity"),
    ("/v1/chat/completions", {**CHAT, "mm_processor_kwargs": {"a": 1}}, "mm_processor_kwargs"),
    ("/v1/completions", {**COMPLETION, "stream": True, "prompt_logprobs": 1}, "prompt_logprobs"),
    ("/v1/chat/completions", {**CHAT, "chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ("/v1/chat/completions", {**CHAT, "chat_template": "{{ messages }}"}, "chat_template"),
])
async def test_fields_that_would_change_the_output_are_refused_by_name(client, engine, path, body, param):
    r = await client.post(path, json=body)
    assert_openai_error(r, 400, param)
    assert engine.calls == []


async def test_accepted_at_their_neutral_values(client):
    for body in ({**CHAT, "use_beam_search": False, "modalities": ["text"], "store": True,
                  "metadata": {"k": "v"}, "service_tier": "auto", "include_reasoning": False,
                  "spaces_between_special_tokens": False, "length_penalty": 1.0, "logits_processors": []},):
        r = await client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text


async def test_unknown_fields_are_accepted_and_logged_once_per_name(client, caplog):
    caplog.set_level(logging.WARNING, logger="pagedserve.app.extra_fields")
    for _ in range(2):
        r = await client.post("/v1/chat/completions", json={**CHAT, "frobnicate_zz": 1})
        assert r.status_code == 200
    lines = [rec.getMessage() for rec in caplog.records if "frobnicate_zz" in rec.getMessage()]
    assert len(lines) == 1 and "ignored" in lines[0]


async def test_truncate_prompt_tokens_keeps_the_last_n(client, engine):
    r = await client.post("/v1/completions", json={**COMPLETION, "truncate_prompt_tokens": 5})
    assert engine.calls[0].prompt_token_ids == list(b"there")
    assert r.json()["usage"]["prompt_tokens"] == 5
    r = await client.post("/v1/completions", json={**COMPLETION, "truncate_prompt_tokens": 50})
    assert engine.calls[1].prompt_token_ids == list(b"Hello there")  # shorter: as it is
    r = await client.post("/v1/chat/completions", json={**CHAT, "truncate_prompt_tokens": 4})
    assert engine.calls[2].prompt_token_ids == list(b"ant>")  # the end of "<user>Hi\n<assistant>"
    r = await client.post("/v1/completions", json={**COMPLETION, "truncate_prompt_tokens": 4,
                                                   "echo": True})
    assert r.json()["choices"][0]["text"].startswith("here")  # echo shows what the model read
    for path, body in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)):
        r = await client.post(path, json={**body, "truncate_prompt_tokens": engine.max_model_len})
        assert_openai_error(r, 400, "truncate_prompt_tokens")


async def test_add_special_tokens(client, engine):
    await client.post("/v1/completions", json={**COMPLETION, "add_special_tokens": False})
    await client.post("/v1/completions", json=COMPLETION)
    await client.post("/v1/chat/completions", json=CHAT)
    await client.post("/v1/chat/completions", json={**CHAT, "add_special_tokens": True})
    assert [flag for _, flag in engine.encode_calls] == [False, True, False, True]


async def test_prompt_logprobs_completions(client, engine):
    r = await client.post("/v1/completions", json={**COMPLETION, "prompt_logprobs": 1})
    assert engine.calls[0].params.prompt_logprobs == 1
    (choice,) = r.json()["choices"]
    plp = choice["prompt_logprobs"]
    assert len(plp) == len("Hello there") and plp[0] is None
    assert plp[1] == {str(ord("e")): {"logprob": -1.0, "rank": 1, "decoded_token": "e"}}


async def test_prompt_logprobs_chat_is_top_level(client, engine):
    r = await client.post("/v1/chat/completions", json={**CHAT, "prompt_logprobs": 0})
    body = r.json()
    assert engine.calls[0].params.prompt_logprobs == 0
    assert body["prompt_logprobs"][0] is None and len(body["prompt_logprobs"]) == len("<user>Hi\n<assistant>")
    r = await client.post("/v1/chat/completions", json=CHAT)
    assert r.json()["prompt_logprobs"] is None


async def test_chat_echo_prefixes_the_last_assistant_message(client, engine):
    msgs = USER + [{"role": "assistant", "content": "Sure: "}]
    r = await client.post("/v1/chat/completions", json={
        "messages": msgs, "max_tokens": 3, "echo": True, "add_generation_prompt": False,
        "continue_final_message": True})
    assert r.json()["choices"][0]["message"]["content"] == "Sure: Hel"
    r = await client.post("/v1/chat/completions", json={
        "messages": msgs, "max_tokens": 3, "echo": True, "add_generation_prompt": False,
        "continue_final_message": True, "stream": True})
    chunks = sse_payloads(r.text)[:-1]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant", "content": ""} and deltas[1] == {"content": "Sure: "}
    assert "".join(d.get("content", "") for d in deltas) == "Sure: Hel"
    # the last message is the user's: nothing to echo
    r = await client.post("/v1/chat/completions", json={**CHAT, "echo": True})
    assert r.json()["choices"][0]["message"]["content"] == "Hel"


async def test_chat_template_kwargs_documents_and_reasoning_effort_reach_the_template(client, engine):
    docs = [{"title": "t", "text": "x"}]
    r = await client.post("/v1/chat/completions", json={
        **CHAT, "chat_template_kwargs": {"enable_thinking": False}, "documents": docs,
        "reasoning_effort": "low"})
    assert r.status_code == 200
    assert engine.template_kwargs[-1] == {"enable_thinking": False, "documents": docs,
                                          "reasoning_effort": "low"}
    # the kwargs may set what the fields set, as in vLLM
    r = await client.post("/v1/chat/completions", json={
        **CHAT, "chat_template_kwargs": {"add_generation_prompt": False}})
    assert engine.chat_calls[-1][1] is False


async def test_request_chat_template_needs_the_trust_flag():
    engine = FakeAsyncEngine()
    app = build_app(engine, served_model_name="fake-model", trust_request_chat_template=True)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        r = await c.post("/v1/chat/completions", json={**CHAT, "chat_template": "T"})
    assert r.status_code == 200, r.text
    assert engine.template_kwargs[-1] == {"chat_template": "T"}


async def test_a_request_template_is_parsed_for_tools_off_the_loop_and_never_evaluated():
    """Whether a request's template reads ``tools`` was decided on the event loop by Jinja's
    analysis, which folds constants: ``{{ 7**30000000 }}`` froze the server for 50 s (issue 37)."""
    import threading
    import time

    from pagedserve.app.tools import prompt

    threads = []
    knows = prompt.template_knows_tools

    def spy(source):
        threads.append(threading.current_thread())
        return knows(source)

    engine = FakeAsyncEngine()
    app = build_app(engine, served_model_name="fake-model", trust_request_chat_template=True)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    template = "{{ tools }}{{ (7**30000000) % 10 }}{{ 'a'|center(10**10) }}{% for m in messages %}{% endfor %}"
    prompt.template_knows_tools = spy
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            t0 = time.monotonic()
            r = await c.post("/v1/chat/completions", json={**CHAT, "chat_template": template, "tools": tools,
                                                           "tool_choice": "none"})
            took = time.monotonic() - t0
    finally:
        prompt.template_knows_tools = knows
    assert r.status_code == 200, r.text
    assert took < 2.0
    assert threads and all(t is not threading.current_thread() for t in threads)
    assert prompt.template_knows_tools(template)  # and it does read tools


async def test_logprob_tokens_carry_real_bytes_and_token_ids_on_request(client):
    engine_reply = "€"  # three tokens of the fake byte tokenizer: E2 82 AC
    client_engine = FakeAsyncEngine(reply=engine_reply)
    app = build_app(client_engine, served_model_name="fake-model")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        r = await c.post("/v1/chat/completions", json={**CHAT, "logprobs": True, "top_logprobs": 1})
        content = r.json()["choices"][0]["logprobs"]["content"]
        assert [e["bytes"] for e in content] == [[0xE2], [0x82], [0xAC]]
        assert content[0]["top_logprobs"][0]["bytes"] == [0xE2]
        r = await c.post("/v1/chat/completions", json={**CHAT, "logprobs": True, "top_logprobs": 1,
                                                       "return_tokens_as_token_ids": True})
        content = r.json()["choices"][0]["logprobs"]["content"]
        assert [e["token"] for e in content] == ["token_id:226", "token_id:130", "token_id:172"]
        r = await c.post("/v1/completions", json={**COMPLETION, "logprobs": 1,
                                                  "return_tokens_as_token_ids": True})
        lp = r.json()["choices"][0]["logprobs"]
        assert lp["tokens"] == ["token_id:226", "token_id:130", "token_id:172"]
        assert set(lp["top_logprobs"][0]) == {"token_id:226"}


async def test_tokenize_takes_the_chat_fields_too(client, engine):
    # /tokenize must count what chat would send: same template options, same special tokens
    r = await client.post("/tokenize", json={"messages": USER, "chat_template_kwargs": {"x": 1},
                                             "return_token_strs": True})
    assert r.status_code == 200, r.text
    assert engine.template_kwargs[-1] == {"x": 1}
    assert r.json()["token_strs"] == list("<user>Hi\n<assistant>")
    assert engine.encode_calls[-1][1] is False  # chat's default
    await client.post("/tokenize", json={"messages": USER, "add_special_tokens": True})
    assert engine.encode_calls[-1][1] is True
    for body in ({"messages": USER}, {"prompt": "x"}):
        r = await client.post("/tokenize", json={**body, "chat_template": "T"})
        assert_openai_error(r, 400, "chat_template")
    r = await client.post("/tokenize", json={"prompt": "ab"})
    assert "token_strs" not in r.json() and engine.encode_calls[-1] == ("ab", True)


@pytest.mark.parametrize("path, body", [("/v1/chat/completions", CHAT), ("/tokenize", {"messages": USER})])
@pytest.mark.parametrize("key", ["self", "messages", "chat_template"])
async def test_template_kwargs_the_renderer_takes_itself_are_400_not_500(client, engine, path, body, key):
    # {"self": 1} reached render_chat(self, ...) as a second 'self': a TypeError and a 500.
    r = await client.post(path, json={**body, "chat_template_kwargs": {key: 1}})
    err = assert_openai_error(r, 400, "chat_template_kwargs")
    assert repr(key) in err["message"]
    assert engine.calls == [] and engine.chat_calls == []


def test_reserved_template_kwargs_cover_every_parameter_of_the_renderers():
    # Every named parameter of the render path is either an option the request may set through
    # chat_template_kwargs (as vLLM) or refused; none can reach the call twice.
    import inspect

    from pagedserve.app.extra_fields import OVERRIDABLE_TEMPLATE_KWARGS, RESERVED_TEMPLATE_KWARGS
    from pagedserve.engine.async_engine import AsyncEngine
    from pagedserve.engine.tokenizer import Tokenizer

    for fn in (AsyncEngine.render_chat, Tokenizer.apply_chat_template):
        for p in inspect.signature(fn).parameters.values():
            if p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL):
                continue
            assert p.name in RESERVED_TEMPLATE_KWARGS or p.name in OVERRIDABLE_TEMPLATE_KWARGS, p.name


def test_unknown_field_logging_stores_nothing_past_its_cap(monkeypatch):
    # One body with 100,000 unknown keys grew the once-per-name set to 100,000 names (the cap
    # was checked before storing, not while).
    from pagedserve.app import extra_fields
    from pagedserve.app.protocol import CompletionRequest

    monkeypatch.setattr(extra_fields, "_logged_ignored", set())
    body = {**COMPLETION, **{f"k{i}": 1 for i in range(100_000)}}
    extra_fields.log_ignored_fields(CompletionRequest, body)
    assert 0 < len(extra_fields._logged_ignored) <= extra_fields._MAX_LOGGED_NAMES
    full = {f"n{i}" for i in range(extra_fields._MAX_LOGGED_NAMES)}
    monkeypatch.setattr(extra_fields, "_logged_ignored", full)
    extra_fields.log_ignored_fields(CompletionRequest, {**COMPLETION, "another": 1})
    assert "another" not in full and len(full) == extra_fields._MAX_LOGGED_NAMES


@pytest.mark.parametrize("path,body", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)])
async def test_continuous_usage_stats_puts_the_usage_so_far_on_every_chunk(client, path, body):
    r = await client.post(path, json={**body, "stream": True, "max_tokens": 5,
                                      "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    assert r.status_code == 200, r.text
    chunks = sse_payloads(r.text)[:-1]
    usages = [c["usage"] for c in chunks]
    assert all(u is not None for u in usages)
    completion = [u["completion_tokens"] for u in usages]
    assert completion == sorted(completion) and completion[-1] == 5 and len(set(completion)) > 2
    assert all(u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] for u in usages)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
    # without include_usage it asks for nothing (as vLLM)
    r = await client.post(path, json={**body, "stream": True, "stream_options": {"continuous_usage_stats": True}})
    assert all("usage" not in c for c in sse_payloads(r.text)[:-1])
