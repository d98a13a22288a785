"""X-Request-Id on every response, /v1/models with vLLM's fields, /ping."""
from __future__ import annotations

import httpx

from pagedserve.app.server import build_app
from tests.app.conftest import sse_payloads
from tests.app.fake_engine import FakeAsyncEngine

CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


async def test_client_request_id_is_echoed_and_names_the_response(client, engine):
    r = await client.post("/v1/chat/completions", json=CHAT, headers={"X-Request-Id": "abc-123"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "abc-123"
    assert r.json()["id"] == "chatcmpl-abc-123"
    r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1},
                          headers={"X-Request-Id": "abc-123"})
    assert r.json()["id"] == "cmpl-abc-123" and r.headers["x-request-id"] == "abc-123"
    # the same client id twice: the engine's ids stay distinct
    ids = [c.request_id for c in engine.calls]
    assert len(set(ids)) == 2 and all("abc-123" in i for i in ids)


async def test_a_request_id_is_generated_when_none_is_given(client):
    r1 = await client.post("/v1/chat/completions", json=CHAT)
    r2 = await client.post("/v1/chat/completions", json=CHAT)
    rid1, rid2 = r1.headers["x-request-id"], r2.headers["x-request-id"]
    assert rid1 and rid2 and rid1 != rid2
    assert r1.json()["id"] == f"chatcmpl-{rid1}"


async def test_body_request_id_as_vllm_header_wins(client):
    r = await client.post("/v1/chat/completions", json={**CHAT, "request_id": "from-body"})
    assert r.headers["x-request-id"] == "from-body" and r.json()["id"] == "chatcmpl-from-body"
    r = await client.post("/v1/chat/completions", json={**CHAT, "request_id": "from-body"},
                          headers={"X-Request-Id": "from-header"})
    assert r.headers["x-request-id"] == "from-header"


async def test_request_id_on_errors_streams_and_401():
    app = build_app(FakeAsyncEngine(), served_model_name="fake-model", api_key="k")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        r = await c.post("/v1/chat/completions", json=CHAT, headers={"X-Request-Id": "r1"})
        assert r.status_code == 401 and r.headers["x-request-id"] == "r1"
        auth = {"Authorization": "Bearer k", "X-Request-Id": "r2"}
        r = await c.post("/v1/chat/completions", json={"messages": []}, headers=auth)
        assert r.status_code == 400 and r.headers["x-request-id"] == "r2"
        r = await c.get("/nope", headers=auth)
        assert r.status_code == 404 and r.headers["x-request-id"] == "r2"
        r = await c.post("/v1/chat/completions", json={**CHAT, "stream": True}, headers=auth)
        assert r.headers["x-request-id"] == "r2"
        assert sse_payloads(r.text)[0]["id"] == "chatcmpl-r2"
        r = await c.get("/health", headers={"X-Request-Id": "x" * 300})  # unusable: replaced
        assert r.headers["x-request-id"] != "x" * 300 and len(r.headers["x-request-id"]) == 32


async def test_models_has_vllm_fields(client):
    r = await client.get("/v1/models")
    (card,) = r.json()["data"]
    assert card["id"] == "fake-model" and card["object"] == "model"
    assert card["max_model_len"] == 128 and card["root"] and card["parent"] is None
    assert isinstance(card["owned_by"], str) and isinstance(card["created"], int)
    (perm,) = card["permission"]
    assert perm["object"] == "model_permission" and perm["id"].startswith("modelperm-")
    assert perm["allow_sampling"] is True and perm["allow_logprobs"] is True
    assert perm["organization"] == "*" and perm["group"] is None and perm["is_blocking"] is False


async def test_ping_get_and_post(client, engine):
    for method in ("GET", "POST"):
        r = await client.request(method, "/ping")
        assert r.status_code == 200, method
    engine.dead = True
    r = await client.get("/ping")
    assert r.status_code == 503
