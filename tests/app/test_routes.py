"""Routes against the fake engine: request → SamplingParams, fan-out, response shapes."""
from __future__ import annotations

from tests.app.conftest import sse_payloads

REPLY = "Hello world, this is a fake reply."


async def test_completion_string_prompt(client, engine):
    r = await client.post("/v1/completions", json={"model": "fake-model", "prompt": "Hi there"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == "fake-model"
    assert body["id"].startswith("cmpl-")
    # OpenAI's default max_tokens for completions is 16
    assert body["choices"] == [{"index": 0, "text": REPLY[:16], "logprobs": None,
                                "finish_reason": "length", "stop_reason": None}]
    assert body["usage"] == {"prompt_tokens": 8, "completion_tokens": 16, "total_tokens": 24}
    (call,) = engine.calls
    assert call.prompt_token_ids == list(b"Hi there") and call.prompt == "Hi there"
    assert call.params.max_tokens == 16 and call.params.n == 1


async def test_completion_prompt_forms_and_fan_out(client, engine):
    r = await client.post("/v1/completions", json={"prompt": ["ab", "cde"], "n": 2, "max_tokens": 40})
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in body["choices"]] == [REPLY, "[1] " + REPLY, REPLY, "[1] " + REPLY]
    assert [c.prompt_token_ids for c in engine.calls] == [list(b"ab")] * 2 + [list(b"cde")] * 2
    assert len({c.request_id for c in engine.calls}) == 4
    # prompt tokens are counted once per prompt, completion tokens over every choice
    assert body["usage"]["prompt_tokens"] == 5
    assert body["usage"]["completion_tokens"] == 2 * len(REPLY) + 2 * len("[1] " + REPLY)

    engine.calls.clear()
    r = await client.post("/v1/completions", json={"prompt": [72, 105], "max_tokens": 3})
    assert r.json()["choices"][0]["text"] == "Hel"
    assert engine.calls[0].prompt_token_ids == [72, 105] and engine.calls[0].prompt is None

    engine.calls.clear()
    r = await client.post("/v1/completions", json={"prompt": [[72], [105, 33]], "max_tokens": 2})
    assert [c["index"] for c in r.json()["choices"]] == [0, 1]
    assert [c.prompt_token_ids for c in engine.calls] == [[72], [105, 33]]
    assert r.json()["usage"]["prompt_tokens"] == 3


async def test_completion_sampling_fields_reach_the_engine(client, engine):
    r = await client.post("/v1/completions", json={
        "prompt": "x", "max_tokens": 20, "temperature": 0.7, "top_p": 0.9, "top_k": 5, "min_p": 0.1,
        "repetition_penalty": 1.2, "presence_penalty": 0.5, "frequency_penalty": -0.5,
        "ignore_eos": True, "min_tokens": 2, "stop_token_ids": [7, 8], "priority": 3,
        "include_stop_str_in_output": True, "skip_special_tokens": False, "seed": 11, "n": 2,
        "stop": ["zz"], "logit_bias": {"65": 5.0}, "unknown_field": "ignored like OpenAI",
    })
    assert r.status_code == 200, r.text
    p0, p1 = (c.params for c in engine.calls)
    assert (p0.temperature, p0.top_p, p0.top_k, p0.min_p) == (0.7, 0.9, 5, 0.1)
    assert (p0.repetition_penalty, p0.presence_penalty, p0.frequency_penalty) == (1.2, 0.5, -0.5)
    assert p0.ignore_eos and p0.min_tokens == 2 and p0.stop_token_ids == [7, 8]
    assert p0.include_stop_str_in_output and not p0.skip_special_tokens
    assert p0.stop == ["zz"] and p0.logit_bias == {65: 5.0} and p0.max_tokens == 20
    # choice i is seeded seed + i: distinct choices, reproducible run to run
    assert (p0.seed, p1.seed) == (11, 12)
    assert [c.priority for c in engine.calls] == [3, 3]


async def test_completion_stop_and_echo(client, engine):
    r = await client.post("/v1/completions", json={"prompt": "Q:", "stop": "world", "max_tokens": 50,
                                                   "echo": True})
    choice = r.json()["choices"][0]
    assert choice["text"] == "Q:Hello "
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == "world"
    assert r.json()["usage"]["completion_tokens"] == len("Hello ")

    r = await client.post("/v1/completions", json={"prompt": [81, 58], "echo": True, "max_tokens": 2})
    assert r.json()["choices"][0]["text"] == "Q:He"


async def test_completion_logprobs_shape(client, engine):
    r = await client.post("/v1/completions", json={"prompt": "Q", "max_tokens": 3, "logprobs": 3})
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["tokens"] == ["H", "e", "l"]
    assert lp["token_logprobs"] == [-0.25, -0.25, -0.25]
    assert lp["top_logprobs"] == [{"H": -0.25, "A": -2.0, "B": -3.0},
                                  {"e": -0.25, "A": -2.0, "B": -3.0},
                                  {"l": -0.25, "A": -2.0, "B": -3.0}]
    assert lp["text_offset"] == [0, 1, 2]
    assert engine.calls[0].params.logprobs == 3 and engine.calls[0].params.prompt_logprobs is None

    # echo + logprobs: prompt positions first (the first one has no logprob), offsets continue
    r = await client.post("/v1/completions", json={"prompt": "QR", "max_tokens": 2, "logprobs": 0,
                                                   "echo": True})
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["tokens"] == ["Q", "R", "H", "e"]
    assert lp["token_logprobs"] == [None, -1.0, -0.25, -0.25]
    assert lp["top_logprobs"][0] is None and lp["top_logprobs"][2] == {"H": -0.25}
    assert lp["text_offset"] == [0, 1, 2, 3]
    assert engine.calls[-1].params.prompt_logprobs == 0


async def test_completion_stream_matches_non_stream(client, engine):
    r = await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 12, "stream": True,
                                                   "n": 2, "stream_options": {"include_usage": True}})
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse_payloads(r.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    usage_chunk = chunks.pop()
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"] == {"prompt_tokens": 2, "completion_tokens": 24, "total_tokens": 26}
    texts = {0: "", 1: ""}
    finish = {}
    for ch in chunks:
        assert ch["object"] == "text_completion" and ch["usage"] is None
        assert ch["id"] == usage_chunk["id"]
        (c,) = ch["choices"]
        texts[c["index"]] += c["text"]
        if c["finish_reason"]:
            finish[c["index"]] = c["finish_reason"]
    assert texts == {0: REPLY[:12], 1: ("[1] " + REPLY)[:12]}
    assert finish == {0: "length", 1: "length"}


async def test_completion_stream_without_usage_and_echo(client):
    r = await client.post("/v1/completions", json={"prompt": "P", "max_tokens": 3, "stream": True,
                                                   "echo": True, "logprobs": 1})
    events = sse_payloads(r.text)
    assert events[-1] == "[DONE]"
    assert all("usage" not in e for e in events[:-1])
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == "PHel"
    offsets = [o for e in events[:-1] for o in e["choices"][0]["logprobs"]["text_offset"]]
    assert offsets == [0, 1, 2, 3]


async def test_chat_completion(client, engine):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "you"}]}]
    r = await client.post("/v1/chat/completions", json={"model": "fake-model", "messages": messages,
                                                        "max_completion_tokens": 5, "max_tokens": 99})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "Hello"},
                                "logprobs": None, "finish_reason": "length", "stop_reason": None}]
    rendered = "<system>Be brief.\n<user>Hi you\n<assistant>"
    assert engine.chat_calls == [([{"role": "system", "content": "Be brief."},
                                   {"role": "user", "content": "Hi you"}], True, False)]
    assert engine.calls[0].prompt_token_ids == list(rendered.encode())
    assert engine.calls[0].params.max_tokens == 5  # max_completion_tokens wins
    assert body["usage"] == {"prompt_tokens": len(rendered), "completion_tokens": 5,
                             "total_tokens": len(rendered) + 5}


async def test_chat_default_max_tokens_is_the_rest_of_the_context(client, engine):
    r = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}]})
    prompt_len = len("<user>Hi\n<assistant>")
    assert engine.calls[0].params.max_tokens == engine.max_model_len - prompt_len
    assert r.json()["choices"][0]["message"]["content"] == REPLY
    assert r.json()["choices"][0]["finish_reason"] == "stop"


async def test_chat_continue_final_message(client, engine):
    r = await client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Sure"}],
        "add_generation_prompt": False, "continue_final_message": True, "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert engine.chat_calls[-1][1:] == (False, True)
    assert engine.calls[0].prompt_token_ids == list(b"<user>Hi\n<assistant>Sure")


async def test_chat_logprobs(client, engine):
    r = await client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "logprobs": True,
        "top_logprobs": 2, "n": 2, "seed": 5})
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    content = body["choices"][0]["logprobs"]["content"]
    assert content[0] == {"token": "H", "logprob": -0.25, "bytes": [72], "top_logprobs": [
        {"token": "H", "logprob": -0.25, "bytes": [72]},
        {"token": "A", "logprob": -2.0, "bytes": [65]}]}
    assert [e["token"] for e in content] == ["H", "e"]
    assert engine.calls[0].params.logprobs == 2 and engine.calls[1].params.seed == 6

    r = await client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "logprobs": True})
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert content == [{"token": "H", "logprob": -0.25, "bytes": [72], "top_logprobs": []}]


async def test_chat_stream(client, engine):
    r = await client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "stream": True,
        "stream_options": {"include_usage": True}})
    events = sse_payloads(r.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[0]["choices"][0]["finish_reason"] is None
    body = chunks[1:-1]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in body) == "Hello"
    assert [c["choices"][0]["finish_reason"] for c in body] == [None] * (len(body) - 1) + ["length"]
    assert all("role" not in c["choices"][0]["delta"] for c in body)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
    assert all(c["usage"] is None for c in chunks[:-1])


async def test_chat_stream_n2_roles_first(client):
    r = await client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "stream": True, "n": 2})
    chunks = sse_payloads(r.text)[:-1]
    roles = [c for c in chunks if "role" in c["choices"][0]["delta"]]
    assert sorted(c["choices"][0]["index"] for c in roles) == [0, 1]
    texts = {0: "", 1: ""}
    for c in chunks:
        texts[c["choices"][0]["index"]] += c["choices"][0]["delta"].get("content", "")
    assert texts == {0: "Hel", 1: "[1]"}
    assert all("usage" not in c for c in chunks)


async def test_models_tokenize_detokenize_health_version(client, engine):
    r = await client.get("/v1/models")
    data = r.json()["data"]
    assert r.json()["object"] == "list" and data[0]["id"] == "fake-model"
    assert data[0]["object"] == "model" and data[0]["max_model_len"] == 128

    r = await client.post("/tokenize", json={"prompt": "abc"})
    assert r.json() == {"count": 3, "max_model_len": 128, "tokens": [97, 98, 99]}
    r = await client.post("/tokenize", json={"messages": [{"role": "user", "content": "x"}]})
    assert r.json()["tokens"] == list(b"<user>x\n<assistant>")
    r = await client.post("/detokenize", json={"tokens": [104, 105]})
    assert r.json() == {"prompt": "hi"}

    r = await client.get("/health")
    assert r.status_code == 200
    r = await client.get("/version")
    assert r.status_code == 200 and isinstance(r.json()["version"], str)
    engine.dead = True
    r = await client.get("/health")
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
