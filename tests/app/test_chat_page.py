"""GET /: the chat page (app/chat_page.py, issue 40 item 3). Served from the package's static
files with a strict Content-Security-Policy, not behind --api-key (the API it calls is), answered
only for a trusted Host like every route, and gone with --disable-chat-page. The page in a real
browser: tests/e2e/test_chat_page_e2e.py."""
from __future__ import annotations

import re
import tomllib
from pathlib import Path

import httpx
import pytest

from pagedserve.app.chat_page import PAGE_FILES
from pagedserve.app.cli import build_parser
from pagedserve.app.server import build_app
from pagedserve.app.server_config import ServerConfig
from pagedserve.app.trusted_host import TrustedHosts
from tests.app.conftest import assert_openai_error
from tests.app.fake_engine import FakeAsyncEngine

ROOT = Path(__file__).resolve().parents[2]


def _client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1:8000")


async def test_the_page_and_its_files_are_served():
    async with _client(build_app(FakeAsyncEngine(), served_model_name="fake-model")) as c:
        page = await c.get("/")
        js = await c.get("/static/chat.js")
        css = await c.get("/static/chat.css")
        head = await c.head("/")
    assert page.status_code == 200 and page.headers["content-type"] == "text/html; charset=utf-8"
    assert js.status_code == 200 and js.headers["content-type"].startswith("text/javascript")
    assert css.status_code == 200 and css.headers["content-type"].startswith("text/css")
    assert head.status_code == 200
    # what the page loads is exactly what is served, and nothing from another origin
    assert set(re.findall(r'(?:src|href)="(/[^"]*)"', page.text)) == {"/static/chat.js", "/static/chat.css"}
    assert "http://" not in page.text and "https://" not in page.text
    for r in (page, js, css):
        csp = r.headers["content-security-policy"]
        assert "default-src 'none'" in csp and "script-src 'self'" in csp and "connect-src 'self'" in csp
        assert r.headers["x-content-type-options"] == "nosniff"
    # the API the page speaks: the models list, a streamed chat with JSON bodies and the bearer key
    assert "/v1/models" in js.text and "/v1/chat/completions" in js.text
    assert '"Content-Type"] = "application/json"' in js.text and '"Bearer "' in js.text
    assert "AbortController" in js.text and "reasoning_content" in js.text and "localStorage" in js.text


async def test_the_page_is_not_behind_the_api_key_but_the_api_is():
    app = build_app(FakeAsyncEngine(), served_model_name="fake-model", api_key="sk-page")
    async with _client(app) as c:
        for path in PAGE_FILES:
            assert (await c.get(path)).status_code == 200, path
        assert_openai_error(await c.get("/v1/models"), 401)
        assert_openai_error(await c.post("/v1/chat/completions", json={"messages": []}), 401)
        r = await c.get("/v1/models", headers={"Authorization": "Bearer sk-page"})
    assert r.status_code == 200 and r.json()["data"][0]["id"] == "fake-model"


async def test_the_page_streams_through_the_guards_as_the_browser_sends():
    """The request the page makes (same origin, JSON, a Host the server serves) is served, streamed."""
    app = build_app(FakeAsyncEngine(), served_model_name="fake-model",
                    trusted_hosts=TrustedHosts.for_server("127.0.0.1", None, None))
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "stream": True,
            "max_tokens": 4, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    async with _client(app) as c:
        r = await c.post("/v1/chat/completions", json=body,
                         headers={"Origin": "http://127.0.0.1:8000", "Content-Type": "application/json"})
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        assert r.text.rstrip().endswith("data: [DONE]") and '"completion_tokens"' in r.text
        # a rebinding page's Host gets the page no more than the API
        refused = await c.get("/", headers={"Host": "attacker.example:8000"})
    assert_openai_error(refused, 400)


async def test_disable_chat_page_turns_it_off():
    app = build_app(FakeAsyncEngine(), served_model_name="fake-model", chat_page=False)
    async with _client(app) as c:
        for path in PAGE_FILES:
            assert_openai_error(await c.get(path), 404)
        assert (await c.get("/v1/models")).status_code == 200


def test_serve_flag():
    args = build_parser(["serve"]).parse_args(["serve"])
    assert args.chat_page is True and ServerConfig.from_args(args).chat_page is True
    args = build_parser(["serve"]).parse_args(["serve", "--disable-chat-page"])
    assert args.chat_page is False and ServerConfig.from_args(args).chat_page is False


def test_the_static_files_are_package_data():
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["pagedserve.app"]
    shipped = {p.name for pattern in data for p in (ROOT / "pagedserve" / "app").glob(pattern)}
    assert {name for name, _ in PAGE_FILES.values()} <= shipped
