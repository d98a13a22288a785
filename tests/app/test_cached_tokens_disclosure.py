"""The prefix cache is not told to strangers (issue 37, finding 6): /v1/responses reports
``cached_tokens`` only with --enable-prompt-tokens-details (vLLM's flag) or to a salted request
(whose hits can only come from requests of its own salt). With the flag, chat and completions usage
carry vLLM's ``prompt_tokens_details`` too; without it their usage is unchanged."""
from __future__ import annotations

import httpx
import pytest

from pagedserve.app.server import build_app
from tests.app.fake_engine import FakeAsyncEngine


class CachedEngine(FakeAsyncEngine):
    """Every request found 32 of its prompt tokens in the prefix cache."""

    def script(self, call):
        outs = super().script(call)
        for out in outs:
            out.num_cached_tokens = 32
        return outs


def _client(details: bool) -> httpx.AsyncClient:
    app = build_app(CachedEngine(max_model_len=4096), served_model_name="fake-model", max_body_bytes=1 << 20,
                    enable_prompt_tokens_details=details)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


@pytest.mark.parametrize("stream", [False, True])
async def test_responses_hide_cached_tokens_from_an_unsalted_request(stream):
    async with _client(False) as c:
        body = {"model": "fake-model", "input": "Capital of France?", "stream": stream}
        r = await c.post("/v1/responses", json=body)
        assert r.status_code == 200, r.text
        usage = _responses_usage(r, stream)
        assert usage["input_tokens_details"] == {"cached_tokens": 0}
        r = await c.post("/v1/responses", json={**body, "cache_salt": "tenant-a"})
        assert _responses_usage(r, stream)["input_tokens_details"] == {"cached_tokens": 32}


async def test_the_flag_reports_cached_tokens_everywhere():
    async with _client(True) as c:
        r = await c.post("/v1/responses", json={"model": "fake-model", "input": "hi"})
        assert r.json()["usage"]["input_tokens_details"] == {"cached_tokens": 32}
        r = await c.post("/v1/chat/completions", json={"model": "fake-model",
                                                       "messages": [{"role": "user", "content": "hi"}]})
        assert r.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}
        r = await c.post("/v1/completions", json={"model": "fake-model", "prompt": "hi", "stream": True,
                                                  "stream_options": {"include_usage": True}})
        last = [line for line in r.text.split("\n\n") if line.startswith("data: {")][-1]
        assert '"prompt_tokens_details":{"cached_tokens":32}' in last


async def test_without_the_flag_chat_and_completions_usage_is_unchanged():
    async with _client(False) as c:
        r = await c.post("/v1/chat/completions", json={"model": "fake-model", "cache_salt": "s",
                                                       "messages": [{"role": "user", "content": "hi"}]})
        assert set(r.json()["usage"]) == {"prompt_tokens", "completion_tokens", "total_tokens"}
        r = await c.post("/v1/completions", json={"model": "fake-model", "prompt": "hi"})
        assert set(r.json()["usage"]) == {"prompt_tokens", "completion_tokens", "total_tokens"}


def _responses_usage(r: httpx.Response, stream: bool) -> dict:
    if not stream:
        return r.json()["usage"]
    import json

    events = [json.loads(line[len("data: "):]) for line in r.text.splitlines() if line.startswith("data: ")]
    done = [e for e in events if e["type"] == "response.completed"]
    return done[0]["response"]["usage"]
