"""Every error status in OpenAI's format, and the app keeps serving after each."""
from __future__ import annotations

import logging

import orjson
import pytest

from tests.app.conftest import assert_openai_error, sse_payloads

CHAT = {"messages": [{"role": "user", "content": "Hi"}]}


async def test_malformed_json_and_bad_bodies(client):
    r = await client.post("/v1/completions", content=b'{"prompt": "x",',
                          headers={"content-type": "application/json"})
    assert "not valid JSON" in assert_openai_error(r, 400)["message"]
    r = await client.post("/v1/completions", content=b"", headers={"content-type": "application/json"})
    assert "empty" in assert_openai_error(r, 400)["message"]
    r = await client.post("/v1/completions", content=b"[1, 2]", headers={"content-type": "application/json"})
    assert "JSON object" in assert_openai_error(r, 400)["message"]


@pytest.mark.parametrize("body, param, words", [
    ({"prompt": "x", "temperature": "hot"}, "temperature", "valid number"),
    ({"prompt": "x", "temperature": 3}, "temperature", "less than or equal to 2"),
    ({"prompt": "x", "n": 0}, "n", "greater than or equal to 1"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
    ({"prompt": "x", "logprobs": 21}, "logprobs", "at most 20 (--max-logprobs)"),
    ({"prompt": "x", "stop": [""]}, "stop", "must not be empty"),
    ({"prompt": "x", "logit_bias": {"a": 1}}, "logit_bias", "token ids"),
    ({"prompt": []}, "prompt", "must not be empty"),
    ({"prompt": [1, "a"]}, "prompt", "prompt must be"),
    ({"prompt": 5}, "prompt", "prompt must be"),
    ({}, "prompt", "required"),
])
async def test_invalid_completion_fields_name_the_field(client, body, param, words):
    err = assert_openai_error(await client.post("/v1/completions", json=body), 400, param)
    assert words in err["message"] and err["type"] == "invalid_request_error"


@pytest.mark.parametrize("body, param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ({"messages": [{"content": "x"}]}, "messages.0.role"),
    ({**CHAT, "top_logprobs": 3}, "top_logprobs"),
    ({**CHAT, "stream_options": {"include_usage": True}}, "stream_options"),
    ({**CHAT, "add_generation_prompt": True, "continue_final_message": True}, "continue_final_message"),
    ({**CHAT, "add_generation_prompt": False, "continue_final_message": True}, "continue_final_message"),
])
async def test_invalid_chat_fields(client, body, param):
    assert_openai_error(await client.post("/v1/chat/completions", json=body), 400, param)


async def test_engine_side_validation_is_a_400_with_the_param(client):
    # min_tokens > max_tokens is checked by SamplingParams, not by the schema
    r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "min_tokens": 5})
    err = assert_openai_error(r, 400, "min_tokens")
    assert "max_tokens" in err["message"]


async def test_chat_template_failure_is_a_400(client):
    r = await client.post("/v1/chat/completions",
                          json={"messages": [{"role": "tool", "content": "x", "tool_call_id": "1"}]})
    assert "template" in assert_openai_error(r, 400, "messages")["message"]


async def test_unknown_model_404(client):
    r = await client.post("/v1/completions", json={"model": "gpt-9", "prompt": "x"})
    err = assert_openai_error(r, 404, "model")
    assert "gpt-9" in err["message"] and err["code"] == "model_not_found"
    r = await client.post("/v1/chat/completions", json={**CHAT, "model": "gpt-9"})
    assert_openai_error(r, 404, "model")


async def test_unknown_route_and_method_are_openai_errors(client):
    assert_openai_error(await client.get("/v1/nothing"), 404)
    assert_openai_error(await client.get("/v1/completions"), 405)


async def test_context_length_errors_say_the_numbers(client, engine):
    r = await client.post("/v1/completions", json={"prompt": "x" * 130})
    err = assert_openai_error(r, 400, "prompt")
    assert "128" in err["message"] and "130" in err["message"]
    r = await client.post("/v1/completions", json={"prompt": "x" * 100, "max_tokens": 50})
    err = assert_openai_error(r, 400, "max_tokens")
    assert "128" in err["message"] and "150" in err["message"] and "100 in the prompt" in err["message"]
    r = await client.post("/v1/chat/completions", json={**CHAT, "max_completion_tokens": 200})
    assert_openai_error(r, 400, "max_completion_tokens")
    r = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "y" * 200}]})
    assert_openai_error(r, 400, "messages")
    # completions default of 16 is cut to the room left, not refused
    r = await client.post("/v1/completions", json={"prompt": "x" * 120})
    assert r.status_code == 200 and engine.calls[-1].params.max_tokens == 8
    assert not engine.running


async def test_oversized_body_413(client):
    big = {"prompt": "x" * 5000}
    err = assert_openai_error(await client.post("/v1/completions", json=big), 413)
    assert "4096" in err["message"]

    async def chunks():  # no Content-Length: the streamed size is checked
        for _ in range(10):
            yield b" " * 1000

    r = await client.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert "content-length" not in r.request.headers
    assert_openai_error(r, 413)


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "x", "suffix": "tail"}, "suffix"),
    ("/v1/completions", {"prompt": "x", "best_of": 3}, "best_of"),
    ("/v1/chat/completions", {**CHAT, "functions": [{"name": "f"}]}, "functions"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, "messages"),
])
async def test_unsupported_features_400(client, path, body, param):
    err = assert_openai_error(await client.post(path, json=body), 400, param)
    assert "not supported" in err["message"]


async def test_supported_lookalikes_pass(client):
    r = await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 1, "tool_choice": "none",
                                                        "response_format": {"type": "text"}, "best_of": 1})
    assert r.status_code == 200, r.text


async def test_overloaded_503_with_retry_after(client, engine):
    engine.overloaded = True
    r = await client.post("/v1/completions", json={"prompt": "x"})
    assert_openai_error(r, 503)
    assert r.headers["retry-after"] == "1"
    engine.overloaded = False
    assert (await client.post("/v1/completions", json={"prompt": "x"})).status_code == 200


async def test_overloaded_on_second_choice_aborts_the_first(client, engine):
    calls = 0
    real = engine.generate

    def generate(*a, **kw):
        nonlocal calls
        calls += 1
        if calls == 2:
            engine.overloaded = True
        return real(*a, **kw)

    engine.generate = generate
    r = await client.post("/v1/completions", json={"prompt": "x", "n": 3})
    assert_openai_error(r, 503)
    assert engine.aborted == [engine.calls[0].request_id]


async def test_dead_engine_503(client, engine):
    engine.dead = True
    r = await client.post("/v1/chat/completions", json=CHAT)
    assert assert_openai_error(r, 503)["code"] == "engine_dead"
    assert "retry-after" not in r.headers


async def test_rejected_request_400(client, engine):
    engine.reject = "prompt + max_tokens do not fit in the KV cache (10 blocks)"
    err = assert_openai_error(await client.post("/v1/completions", json={"prompt": "x"}), 400)
    assert "KV cache" in err["message"]


async def test_unexpected_error_500_without_trace(client, engine, caplog):
    def boom(*a, **kw):
        raise KeyError("secret internal detail")

    engine.generate = boom
    with caplog.at_level(logging.ERROR, logger="pagedserve.app.errors"):
        r = await client.post("/v1/completions", json={"prompt": "x"})
    err = assert_openai_error(r, 500)
    assert "secret" not in r.text and "Traceback" not in r.text and err["type"] == "server_error"
    assert any("secret internal detail" in rec.getMessage() or rec.exc_info for rec in caplog.records)
    engine.generate = type(engine).generate.__get__(engine)
    assert (await client.post("/v1/completions", json={"prompt": "x"})).status_code == 200


async def test_error_mid_stream_sends_error_event_then_done(client, engine):
    engine.fail_after = 3
    r = await client.post("/v1/completions", json={"prompt": "x", "stream": True})
    assert r.status_code == 200
    events = sse_payloads(r.text)
    assert [e["choices"][0]["text"] for e in events[:3]] == ["H", "e", "l"]
    assert events[3]["error"]["code"] == "engine_dead"
    assert set(events[3]["error"]) == {"message", "type", "param", "code"}
    # Clients written for vLLM read until [DONE]: it follows the error event, and nothing else.
    assert events[4:] == ["[DONE]"]


async def test_engine_error_mid_stream_read_line_by_line_ends_with_done(client, engine):
    """An engine-side failure (finish_reason "error") mid-stream, read as a streaming client
    reads it: the error event, then ``data: [DONE]``, then the body ends."""
    real = engine.script

    def script(call):
        outs = real(call)[:3]
        outs[2].outputs[0].finish_reason = "error"
        outs[2].finished = True
        outs[2].error = "worker crashed"
        return outs

    engine.script = script
    body = {"messages": [{"role": "user", "content": "Hi"}], "stream": True}
    lines = []
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                lines.append(line[len("data: "):])
    assert lines[-1] == "[DONE]"
    err = orjson.loads(lines[-2])["error"]
    assert "worker crashed" in err["message"] and err["type"] == "server_error"
    assert all("error" not in orjson.loads(x) for x in lines[:-2])


async def test_engine_error_finish_reason_is_an_error(client, engine):
    real = engine.script

    def script(call):
        outs = real(call)
        last = outs[1]
        last.outputs[0].finish_reason = "error"
        last.finished = True
        last.error = "worker crashed"
        return outs[:2]

    engine.script = script
    r = await client.post("/v1/completions", json={"prompt": "x"})
    err = assert_openai_error(r, 500)
    assert "worker crashed" in err["message"]


async def test_token_ids_out_of_vocab_are_400(client, engine):
    # an id past the vocabulary must never reach the model (it would fail the whole step)
    for prompt in ([300], [[1], [2, 256]], [-1]):
        err = assert_openai_error(await client.post("/v1/completions", json={"prompt": prompt}), 400, "prompt")
        assert "out of range" in err["message"] or "negative" in err["message"]
    assert_openai_error(await client.post("/detokenize", json={"tokens": [65, 256]}), 400, "tokens")
    assert engine.calls == []


async def test_stream_refused_at_submission_is_a_real_status(client, engine):
    engine.overloaded = True
    r = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert_openai_error(r, 503)
    assert r.headers["retry-after"] == "1"
    engine.overloaded, engine.dead = False, True
    r = await client.post("/v1/completions", json={"prompt": "x", "stream": True})
    assert assert_openai_error(r, 503)["code"] == "engine_dead"


async def test_negative_seed_is_refused_by_sampling_params(client):
    err = assert_openai_error(await client.post("/v1/completions", json={"prompt": "x", "seed": -1}), 400, "seed")
    assert "seed" in err["message"]
