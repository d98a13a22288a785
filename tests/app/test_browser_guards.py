"""What a web page can make a browser send (issue 37, finding 7). A page may POST ``text/plain``
(or form data, or a body without a Content-Type) cross-origin without a preflight, so a JSON route
refuses any body that is not ``application/json`` with 415 (as vLLM's FastAPI routes), before it is
read. And DNS rebinding turns a page's own origin into this server: without --api-key, only a Host
header naming the bound address, localhost or --allowed-hosts is served (400 otherwise)."""
from __future__ import annotations

import httpx
import pytest

from pagedserve.app.server import build_app
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


# ---- Host header (DNS rebinding) --------------------------------------------------------------

async def _status(app, host: str | None, path: str = "/v1/models") -> httpx.Response:
    async with _client(app) as c:
        req = c.build_request("GET", path)
        if host is None:
            del req.headers["host"]
        else:
            req.headers["host"] = host
        return await c.send(req)


def _served(bind: str, api_key: str | None = None, allowed: list[str] | None = None):
    from pagedserve.app.trusted_host import TrustedHosts

    hosts = TrustedHosts.for_server(bind, api_key, allowed)
    return build_app(FakeAsyncEngine(), served_model_name="fake-model", api_key=api_key, trusted_hosts=hosts)


@pytest.mark.parametrize("host", ["127.0.0.1:8000", "127.0.0.1", "localhost:8000", "LOCALHOST", "[::1]:8000"])
async def test_without_an_api_key_the_bound_address_and_localhost_are_served(host):
    assert (await _status(_served("127.0.0.1"), host)).status_code == 200


@pytest.mark.parametrize("path", ["/v1/models", "/health", "/metrics", "/v1/chat/completions"])
@pytest.mark.parametrize("host", ["attacker.example:8000", "attacker.example", "127.0.0.1.nip.io:8000",
                                  "localhost.attacker.example", "10.1.2.3:8000", "", "[::1", "a b"])
async def test_without_an_api_key_another_host_is_refused_with_400(host, path):
    r = await _status(_served("127.0.0.1"), host, path)
    err = assert_openai_error(r, 400, None)
    assert err["code"] == "invalid_host" and "--allowed-hosts" in err["message"]
    assert "x-request-id" in r.headers


async def test_a_request_without_a_host_header_is_refused():
    assert (await _status(_served("127.0.0.1"), None)).status_code == 400


async def test_allowed_hosts_add_names_and_wildcards():
    app = _served("127.0.0.1", allowed=["api.example.com", "*.internal.example"])
    for host in ("api.example.com", "API.example.com:443", "a.internal.example", "b.c.internal.example:1"):
        assert (await _status(app, host)).status_code == 200, host
    for host in ("example.com", "internal.example", "xapi.example.com", "evil.example"):
        assert (await _status(app, host)).status_code == 400, host
    assert (await _status(_served("127.0.0.1", allowed=["*"]), "anything.example")).status_code == 200


async def test_a_wildcard_bind_serves_ip_literals_but_no_other_name():
    """Bound to every address, the server is reached by any of its IPs; a rebinding page's Host is
    always a DNS name, so IP literals stay allowed and names need --allowed-hosts."""
    for bind in ("0.0.0.0", "::"):
        app = _served(bind)
        for host in ("10.1.2.3:8000", "192.168.1.5", "[fe80::1]:8000", "localhost:8000"):
            assert (await _status(app, host)).status_code == 200, (bind, host)
        assert (await _status(app, "myhost.lan:8000")).status_code == 400
        assert (await _status(_served(bind, allowed=["myhost.lan"]), "myhost.lan:8000")).status_code == 200


async def test_a_server_bound_to_a_name_serves_that_name():
    assert (await _status(_served("myhost.lan"), "myhost.lan:8000")).status_code == 200
    assert (await _status(_served("10.0.0.7"), "10.0.0.7:8000")).status_code == 200
    assert (await _status(_served("10.0.0.7"), "10.0.0.8:8000")).status_code == 400


async def test_with_an_api_key_every_host_is_served_unless_allowed_hosts_is_given():
    """A page cannot send the key, so --api-key already stops it; --allowed-hosts still applies
    when the operator gives it."""
    from pagedserve.app.trusted_host import TrustedHosts

    assert TrustedHosts.for_server("127.0.0.1", "sk", None) is None
    app = _served("127.0.0.1", api_key="sk")
    async with _client(app) as c:
        r = await c.get("/v1/models", headers={"host": "attacker.example", "authorization": "Bearer sk"})
    assert r.status_code == 200
    app = _served("127.0.0.1", api_key="sk", allowed=["api.example.com"])
    assert (await _status(app, "attacker.example", "/health")).status_code == 400
    assert (await _status(app, "api.example.com", "/health")).status_code == 200


def test_build_app_checks_no_host_by_default():
    """In-process apps (tests, embedding the ASGI app) choose; `serve` always passes the check."""
    app = build_app(FakeAsyncEngine(), served_model_name="fake-model")
    assert not any(m.cls.__name__ == "HostCheckMiddleware" for m in app.user_middleware)


def test_serve_flags():
    from pagedserve.app.cli import build_parser
    from pagedserve.app.serve_cmd import check_access
    from pagedserve.contracts.config import ConfigError

    def args(*argv):
        a = build_parser(["serve", *argv]).parse_args(["serve", *argv])
        check_access(a)
        return a

    hosts = args("--allowed-hosts", "a.example, *.b.example").trusted_hosts
    assert hosts.allows("a.example:8000") and hosts.allows("x.b.example") and not hosts.allows("c.example")
    assert args("--api-key", "k").trusted_hosts is None
    assert args("--allowed-hosts", '["*"]').trusted_hosts.allows("x.example")
    with pytest.raises(ConfigError, match="--allowed-hosts 'a.\\*.example'"):
        args("--allowed-hosts", "a.*.example")
    help_text = _serve_help()
    assert "--allowed-hosts" in help_text and "DNS" in help_text
    for flag in ("--lora-root", "--max-runtime-loras", "--show-model-paths", "--enable-prompt-tokens-details"):
        assert flag in help_text, flag  # issue 37's other flags, in the same place


def _serve_help() -> str:
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    return subprocess.run([sys.executable, "-m", "pagedserve.app.cli", "serve", "--help"], cwd=root, capture_output=True,
                          text=True, timeout=120).stdout


async def test_openapi_documents_both_refusals():
    from openapi_spec_validator import validate as validate_openapi

    r = await _status(_served("127.0.0.1"), "127.0.0.1:8000", "/openapi.json")
    doc = r.json()
    validate_openapi(doc)
    assert "invalid_host" in doc["paths"]["/v1/models"]["get"]["responses"]["400"]["description"]
    assert "invalid_host" in doc["paths"]["/v1/chat/completions"]["post"]["responses"]["400"]["description"]
    assert "unsupported_media_type" in doc["paths"]["/v1/chat/completions"]["post"]["responses"]["415"]["description"]
