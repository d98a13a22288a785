"""A text prompt that cannot fit the context is refused before it is tokenized (issue 22 follow-up).

Tokenizing holds the interpreter (the Rust tokenizer keeps the GIL, ~0.75 s per MiB), so a
multi-MB text prompt froze the event loop although it ran on a pool thread. No text longer than
max_model_len x the longest token (in characters) can fit, so such a text is a 400 naming the
limit without being encoded; with ``truncate_prompt_tokens`` only the end of the text that could
still matter is encoded. The fake engine's tokens are bytes (at most 1 character a token) and
its context is 128 tokens: the bound is 128 characters."""
from __future__ import annotations

import httpx
import pytest

from pagedserve.app.admission import AdmissionLimits
from pagedserve.app.server import build_app
from tests.app.conftest import assert_openai_error
from tests.app.fake_engine import FakeAsyncEngine

LONG = "The quick brown fox. " * 10_000  # 210,000 characters: far past 128 x 1
CTX = 128


@pytest.fixture
async def bounded():
    engine = FakeAsyncEngine(max_model_len=CTX)
    engine.tokenizer.max_token_chars = 1  # a byte a token: never more than one character
    app = build_app(engine, served_model_name="fake-model", max_body_bytes=16 * 1024 * 1024,
                    limits=AdmissionLimits())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
        yield c, engine


def too_long(r: httpx.Response, param: str) -> dict:
    err = assert_openai_error(r, 400, param=param)
    assert err["code"] == "context_length_exceeded", err
    assert f"{CTX} tokens" in err["message"] and "characters" in err["message"], err
    assert "--max-model-len" in err["message"], err
    return err


async def test_completion_text_past_the_bound_is_refused_unencoded(bounded):
    client, engine = bounded
    r = await client.post("/v1/completions", json={"prompt": LONG, "max_tokens": 2})
    err = too_long(r, "prompt")
    assert str(len(LONG)) in err["message"]
    assert engine.encode_calls == [] and engine.calls == []
    # one of several prompts is enough
    r = await client.post("/v1/completions", json={"prompt": ["hi", LONG], "max_tokens": 2})
    too_long(r, "prompt")
    assert all(len(text) <= CTX for text, _ in engine.encode_calls) and engine.calls == []
    # at the bound the text is tokenized as before (and refused by its token count if it must be)
    r = await client.post("/v1/completions", json={"prompt": "x" * (CTX - 4), "max_tokens": 2})
    assert r.status_code == 200, r.text


async def test_completion_truncation_encodes_only_the_end_that_can_matter(bounded):
    client, engine = bounded
    r = await client.post("/v1/completions", json={"prompt": LONG, "max_tokens": 2,
                                                   "truncate_prompt_tokens": 5})
    assert r.status_code == 200, r.text
    [(text, _)] = engine.encode_calls
    assert LONG.endswith(text) and len(text) < 200  # the end, a few tokens' worth, not 210,000
    assert engine.calls[0].prompt_token_ids == list(LONG[-5:].encode())  # the same last 5 tokens


async def test_chat_rendered_text_past_the_bound_is_refused_unencoded(bounded):
    client, engine = bounded
    messages = [{"role": "user", "content": LONG}]
    r = await client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
    too_long(r, "messages")
    assert len(engine.chat_calls) == 1 and engine.encode_calls == [] and engine.calls == []
    r = await client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2,
                                                        "truncate_prompt_tokens": 7})
    assert r.status_code == 200, r.text
    [(text, _)] = engine.encode_calls
    rendered = f"<user>{LONG}\n<assistant>"
    assert rendered.endswith(text) and len(text) < 200
    assert engine.calls[0].prompt_token_ids == list(rendered[-7:].encode())


async def test_embedding_text_past_the_bound_is_refused_unencoded(bounded):
    client, engine = bounded
    for value in (LONG, ["short", LONG]):
        r = await client.post("/v1/embeddings", json={"input": value})
        too_long(r, "input")
    assert all(len(text) <= CTX for text, _ in engine.encode_calls)
    r = await client.post("/v1/score", json={"text_1": "a", "text_2": LONG})
    too_long(r, "text_2")
    assert all(len(text) <= CTX for text, _ in engine.encode_calls)


async def test_no_bound_without_one_from_the_tokenizer(bounded):
    # A tokenizer that may drop characters (max_token_chars None) gets no character bound: its
    # text is tokenized and judged by its token count, as before.
    client, engine = bounded
    engine.tokenizer.max_token_chars = None
    r = await client.post("/v1/completions", json={"prompt": "y" * 300, "max_tokens": 2})
    err = assert_openai_error(r, 400, param="prompt")
    assert err["code"] == "context_length_exceeded" and "300 tokens" in err["message"]
    assert engine.encode_calls == [("y" * 300, True)]
