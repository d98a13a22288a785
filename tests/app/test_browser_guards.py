"""What a web page can make a browser send (issue 37, finding 7). A page may POST ``text/plain``
(or form data, or a body without a Content-Type) cross-origin without a preflight, so a JSON route
refuses any body that is not ``application/json`` with 415 (as vLLM's FastAPI routes), before it is
read. And DNS rebinding turns a page's own origin into this server: without --api-key, only a Host
header naming the bound address, localhost or --allowed-hosts is served (400 otherwise)."""
from __future__ import annotations

import httpx
import pytest

from app.server import build_app
from tests.app.conftest import assert_openai_error
from tests.app.fake_engine import FakeAsyncEngine

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}
JSON_ROUTES = ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings", "/v1/score",
               "/score", "/tokenize", "/detokenize", "/v1/load_lora_adapter", "/v1/unload_lora_adapter"]


def _client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1:8000")


@pytest.mark.parametrize("path", JSON_ROUTES)
@pytest.mark.parametrize("content_type", [None, "text/plain", "text/plain;charset=UTF-8",
                                          "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                                          "application/jsonx", "application/json-seq"])
async def test_a_body_that_is_not_json_is_refused_with_415(tmp_path, path, content_type):
    engine = FakeAsyncEngine()
    app = build_app(engine, served_model_name="fake-model", allow_runtime_lora_updating=True,
                    lora_roots=[str(tmp_path)])
    headers = {} if content_type is None else {"content-type": content_type}
    async with _client(app) as c:
        body = b'{"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "prompt": "hi"}'
        r = await c.post(path, content=body, headers=headers)
    err = assert_openai_error(r, 415, None)
    assert err["code"] == "unsupported_media_type" and "application/json" in err["message"]
    assert engine.calls == []


@pytest.mark.parametrize("content_type", ["application/json", "application/json; charset=utf-8",
                                          "Application/JSON"])
async def test_json_bodies_are_served(content_type):
    app = build_app(FakeAsyncEngine(), served_model_name="fake-model")
    async with _client(app) as c:
        r = await c.post("/v1/chat/completions", content=httpx.Request("POST", "/", json=CHAT).content,
                         headers={"content-type": content_type})
    assert r.status_code == 200, r.text
