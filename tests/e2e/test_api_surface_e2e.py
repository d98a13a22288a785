"""The OpenAI surface against a real `pagedserve serve` (tiny random model, the default model's
tokenizer): logprob bytes of partial characters, X-Request-Id, /ping, /v1/models, vLLM's extra
fields end to end, and a stream read the way `vllm bench serve` reads it."""
from __future__ import annotations

import httpx
import pytest

from tests.app.asgi_stream import read_like_vllm_bench
from tests.e2e.test_server_e2e import ServerProcess

pytestmark = pytest.mark.slow

USER = [{"role": "user", "content": "Say something in Japanese."}]


@pytest.fixture(scope="module")
def server():
    s = ServerProcess("--trust-request-chat-template")
    yield s
    assert s.stop() == 0, s.output()


def post(server, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60, **kw)


def test_logprob_bytes_join_into_the_reply(server):
    # Bias the reply towards tokens that are parts of characters (byte-level pieces).
    from pagedserve.engine.tokenizer import Tokenizer

    tok = Tokenizer.from_model(None)
    ids = tok.encode(" 日本語", add_special_tokens=False)
    r = post(server, "/v1/chat/completions", {
        "messages": USER, "max_tokens": 12, "temperature": 0, "logprobs": True, "top_logprobs": 2,
        "logit_bias": {str(i): 100 for i in ids}})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    content = choice["logprobs"]["content"]
    joined = b"".join(bytes(e["bytes"]) for e in content)
    assert joined.decode("utf-8", errors="replace") == choice["message"]["content"]
    partial = [e for e in content if e["token"].endswith("\ufffd")]
    assert partial and all(bytes(e["bytes"]) != "\ufffd".encode() for e in partial)


def test_request_id_ping_models(server):
    r = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2},
             headers={"X-Request-Id": "e2e-1"})
    assert r.headers["x-request-id"] == "e2e-1" and r.json()["id"] == "cmpl-e2e-1"
    assert httpx.get(server.url + "/ping").status_code == 200
    assert httpx.post(server.url + "/ping").status_code == 200
    card = httpx.get(server.url + "/v1/models").json()["data"][0]
    assert card["max_model_len"] == 2048 and card["permission"][0]["object"] == "model_permission"


def test_extra_fields_end_to_end(server):
    r = post(server, "/v1/completions", {"prompt": "The capital of France is", "max_tokens": 2,
                                         "prompt_logprobs": 1, "truncate_prompt_tokens": 3})
    assert r.status_code == 200, r.text
    body = r.json()
    plp = body["choices"][0]["prompt_logprobs"]
    assert body["usage"]["prompt_tokens"] == 3 and len(plp) == 3 and plp[0] is None
    assert all(len(e) in (1, 2) for e in plp[1:])
    r = post(server, "/v1/chat/completions", {
        "messages": USER, "max_tokens": 2, "chat_template": "{{ messages[0]['content'] }} =>",
        "chat_template_kwargs": {"unused": 1}})
    assert r.status_code == 200, r.text
    tokens = httpx.post(server.url + "/tokenize", json={"prompt": USER[0]["content"] + " =>",
                                                        "add_special_tokens": False}).json()["count"]
    assert r.json()["usage"]["prompt_tokens"] == tokens
    r = post(server, "/v1/chat/completions", {**{"messages": USER}, "use_beam_search": True, "stream": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream"
    r = post(server, "/v1/chat/completions", {**{"messages": USER}, "use_beam_search": True, "n": 2,
                                              "max_tokens": 4})
    assert r.status_code == 200 and len(r.json()["choices"]) == 2, r.text


def test_a_stream_read_like_vllm_bench(server):
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=60, json={
            "messages": USER, "max_tokens": 40, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}) as r:
        chunks = list(r.iter_raw())
    events = read_like_vllm_bench(chunks)
    assert events[-1] == "[DONE]" and '"completion_tokens":40' in events[-2]
