"""`serve --log-format json` and the access log on a real server process (issue 40 item 4): every
line the server and its worker process write is one JSON object; each HTTP request gets one access
line with its request id; no API key or prompt is logged; --disable-uvicorn-access-log (vLLM's
name) turns the access lines off. The formatter and the middleware alone: tests/app/test_access_log.py."""
from __future__ import annotations

import json

import httpx

from pagedserve.loadtest.local_server import LocalServer, tiny_args

KEY = "sk-log-test-key-0123"
PROMPT = "a prompt that must stay out of the log"


def _chat(url: str, headers: dict) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", headers=headers, timeout=120,
                      json={"model": "tiny", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 3})


def test_json_lines_with_request_ids_and_an_access_log():
    server = LocalServer([*tiny_args(512, 64), "--served-model-name", "tiny", "--log-format", "json",
                          "--api-key", KEY], log_prefix="pagedserve-e2e-")
    try:
        r = _chat(server.url, {"Authorization": f"Bearer {KEY}", "X-Request-Id": "e2e-rid-1"})
        assert r.status_code == 200, r.text
        assert httpx.get(server.url + "/v1/models", timeout=30).status_code == 401  # no key
    finally:
        assert server.stop() == 0, server.output()
    out = server.output()
    lines = [json.loads(line) for line in out.splitlines() if line.strip()]  # every line: one object
    assert all({"time", "level", "logger", "message"} <= set(o) for o in lines)
    assert any(o.get("process") == "worker 0" for o in lines), out  # the worker's lines too
    assert any(o["logger"] == "pagedserve.serve" and o["message"].endswith("| ready") for o in lines)
    access = [o for o in lines if o["logger"] == "pagedserve.access"]
    chat = [o for o in access if o["path"] == "/v1/chat/completions"]
    assert [(o["method"], o["status"], o["request_id"], o["level"]) for o in chat] == [
        ("POST", 200, "e2e-rid-1", "INFO")], access
    assert chat[0]["client"].startswith("127.0.0.1:") and chat[0]["duration_ms"] > 0
    assert [o["status"] for o in access if o["path"] == "/v1/models"] == [401]
    assert KEY not in out and PROMPT not in out


def test_text_log_without_access_lines():
    server = LocalServer([*tiny_args(512, 64), "--served-model-name", "tiny", "--disable-uvicorn-access-log"],
                         log_prefix="pagedserve-e2e-")
    try:
        assert _chat(server.url, {}).status_code == 200
    finally:
        assert server.stop() == 0, server.output()
    out = server.output()
    assert "pagedserve.serve: serving tiny on http://" in out  # the text format, as before
    assert "pagedserve.access" not in out and "/v1/chat/completions" not in out
