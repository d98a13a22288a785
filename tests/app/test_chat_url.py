"""`pagedserve chat --url URL` (app/chat_remote.py, issue 40 item 4): the chat loop against a
running OpenAI-compatible server, no model loaded. Here against canned answers (httpx.MockTransport);
against a real server: tests/e2e/test_chat_page_e2e.py."""
from __future__ import annotations

import io
import json

import httpx
import pytest

from pagedserve.app.chat_remote import RemoteChat, RemoteError, api_base, request_body
from pagedserve.app.cli import build_parser


def chat_args(*argv: str):
    return build_parser(["chat"]).parse_args(["chat", *argv])


@pytest.mark.parametrize("url", ["http://h:8000", "http://h:8000/", "http://h:8000/v1", "http://h:8000/v1/", "h:8000"])
def test_api_base(url):
    assert api_base(url) == "http://h:8000/v1"


def test_request_body_sends_vllm_extras_only_when_set():
    msgs = [{"role": "user", "content": "hi"}]
    body = request_body(chat_args("--url", "x"), "m", msgs)
    assert body == {"model": "m", "messages": msgs, "stream": True, "max_tokens": 256, "temperature": 0.0}
    body = request_body(chat_args("--url", "x", "--top-k", "5", "--min-p", "0.1", "--top-p", "0.9", "--seed", "3",
                                  "--stop", "END", "--ignore-eos", "--repetition-penalty", "1.2"), "m", msgs)
    assert (body["top_k"], body["min_p"], body["top_p"], body["seed"], body["stop"], body["ignore_eos"],
            body["repetition_penalty"]) == (5, 0.1, 0.9, 3, ["END"], True, 1.2)


def sse(*events) -> bytes:
    return b"".join(b"data: " + (e if isinstance(e, bytes) else json.dumps(e).encode()) + b"\n\n" for e in events)


def chunk(**delta) -> dict:
    return {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}


def remote(handler, key: str | None = "sk-x") -> RemoteChat:
    return RemoteChat("http://h/v1", key, httpx.Client(transport=httpx.MockTransport(handler)))


def test_a_streamed_answer_with_reasoning_apart():
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        body = b": ping\n\n" + sse(chunk(role="assistant"), chunk(reasoning_content="hmm "),
                                   chunk(content="Hel"), chunk(content="lo"),
                                   {"choices": [], "usage": {"completion_tokens": 3}}, b"[DONE]")
        return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})

    out, thinking = io.StringIO(), io.StringIO()
    answer = remote(handler).stream({"model": "m"}, out, thinking)
    assert answer == out.getvalue() == "Hello" and thinking.getvalue() == "hmm "
    assert seen[0].url == "http://h/v1/chat/completions" and seen[0].headers["authorization"] == "Bearer sk-x"


@pytest.mark.parametrize("response, words", [
    (httpx.Response(401, json={"error": {"message": "Incorrect API key", "type": "x"}}), "401 Unauthorized: Incorrect API key"),
    (httpx.Response(200, content=sse(chunk(content="a"), {"error": {"message": "engine died"}}, b"[DONE]")), "engine died"),
    (httpx.Response(200, content=sse(chunk(content="a"))), "without [DONE]"),
    (httpx.Response(200, content=b"data: not json\n\n"), "not an SSE stream"),
    (httpx.Response(200, content=sse([1, 2])), "not a chat completion chunk"),
])
def test_a_refusal_or_broken_stream_is_a_remote_error(response, words):
    with pytest.raises(RemoteError, match=words.replace("[", r"\[").replace("]", r"\]")):
        remote(lambda request: response).stream({"model": "m"}, io.StringIO(), io.StringIO())


def test_first_model_and_its_errors():
    models = {"object": "list", "data": [{"id": "tiny", "object": "model"}, {"id": "lora", "object": "model"}]}
    assert remote(lambda r: httpx.Response(200, json=models)).first_model() == "tiny"
    with pytest.raises(RemoteError, match="lists no model"):
        remote(lambda r: httpx.Response(200, json={"data": []})).first_model()
    with pytest.raises(RemoteError, match="401"):
        remote(lambda r: httpx.Response(401, json={"error": {"message": "key"}}), None).first_model()

    def down(request):
        raise httpx.ConnectError("connection refused")

    with pytest.raises(RemoteError, match="cannot reach http://h/v1"):
        remote(down).first_model()
