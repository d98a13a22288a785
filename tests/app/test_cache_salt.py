"""cache_salt (vLLM's field): passed to the engine for every choice; an empty salt is a 400."""
from __future__ import annotations

import pytest

from tests.app.conftest import assert_openai_error

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
COMPLETION = {"prompt": ["ab", "cd"], "max_tokens": 3, "n": 2}


@pytest.mark.parametrize("path,body", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)])
@pytest.mark.parametrize("stream", [False, True])
async def test_cache_salt_reaches_the_engine_for_every_choice(client, engine, path, body, stream):
    r = await client.post(path, json={**body, "stream": stream, "cache_salt": "tenant-42"})
    assert r.status_code == 200, r.text
    assert engine.calls and [c.cache_salt for c in engine.calls] == ["tenant-42"] * len(engine.calls)
    engine.calls.clear()
    r = await client.post(path, json={**body, "stream": stream})
    assert r.status_code == 200, r.text
    assert engine.calls and all(c.cache_salt is None for c in engine.calls)


@pytest.mark.parametrize("path,body", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)])
@pytest.mark.parametrize("salt", ["", 7, ["x"]])
async def test_bad_cache_salt_is_a_400(client, engine, path, body, salt):
    r = await client.post(path, json={**body, "cache_salt": salt})
    err = assert_openai_error(r, 400, param="cache_salt")
    assert "cache_salt" in err["message"]
    assert engine.calls == []


EMBED = {"input": ["ab", "cd"]}
SCORE = {"text_1": "ab", "text_2": ["cd", "ef"]}


@pytest.mark.parametrize("path,body", [("/v1/embeddings", EMBED), ("/v1/score", SCORE), ("/score", SCORE)])
async def test_pooling_routes_take_cache_salt_for_every_input(client, engine, path, body):
    r = await client.post(path, json={**body, "cache_salt": "tenant-42"})
    assert r.status_code == 200, r.text
    assert engine.calls and [c.cache_salt for c in engine.calls] == ["tenant-42"] * len(engine.calls)
    engine.calls.clear()
    r = await client.post(path, json=body)
    assert r.status_code == 200, r.text
    assert engine.calls and all(c.cache_salt is None for c in engine.calls)


@pytest.mark.parametrize("path,body", [("/v1/embeddings", EMBED), ("/v1/score", SCORE)])
@pytest.mark.parametrize("salt", ["", 7])
async def test_bad_pooling_cache_salt_is_a_400(client, engine, path, body, salt):
    r = await client.post(path, json={**body, "cache_salt": salt})
    assert_openai_error(r, 400, param="cache_salt")
    assert engine.calls == []
