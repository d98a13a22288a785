"""`serve`'s logs (issue 40 item 4): --log-format json (one JSON object per line: time, level,
logger, message, the request id where a record concerns a request) and an access log at INFO, one
line per HTTP request, on by default and off with --disable-access-log (vLLM's
--disable-uvicorn-access-log). Never a request body or an API key. A real server's lines:
tests/e2e/test_log_format_e2e.py."""
from __future__ import annotations

import io
import json
import logging

import httpx
import pytest

from pagedserve.app.cli import build_parser
from pagedserve.app.server import build_app
from pagedserve.app.server_config import ServerConfig
from pagedserve.contracts.log_format import REQUEST_ID, JsonFormatter, configure_logging, current_format
from tests.app.fake_engine import FakeAsyncEngine

SECRET = "sk-very-secret-key"
PROMPT = "a prompt nobody may read in the log"


def _client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app, client=("10.1.2.3", 4567)),
                             base_url="http://127.0.0.1:8000")


def _access(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "pagedserve.access"]


def _parse(argv: list[str]):
    argv = ["serve", *argv]
    return build_parser(argv).parse_args(argv)


async def test_one_access_line_per_request_at_info(caplog):
    caplog.set_level(logging.INFO)
    app = build_app(FakeAsyncEngine(), served_model_name="fake-model", api_key=SECRET)
    async with _client(app) as c:
        ok = await c.post("/v1/chat/completions", headers={"Authorization": f"Bearer {SECRET}",
                                                           "X-Request-Id": "rid-123"},
                          json={"model": "fake-model", "messages": [{"role": "user", "content": PROMPT}]})
        denied = await c.get("/v1/models?api_key=" + SECRET)  # no key: 401, and the query is not logged
        missing = await c.get("/nowhere", headers={"Authorization": f"Bearer {SECRET}"})
    assert ok.status_code == 200 and denied.status_code == 401 and missing.status_code == 404
    lines = _access(caplog)
    assert [(r.method, r.path, r.status) for r in lines] == [
        ("POST", "/v1/chat/completions", 200), ("GET", "/v1/models", 401), ("GET", "/nowhere", 404)]
    assert all(r.levelno == logging.INFO for r in lines)
    first = lines[0]
    assert first.request_id == "rid-123" and first.client == "10.1.2.3:4567"
    assert isinstance(first.duration_ms, float) and first.duration_ms >= 0
    assert "rid-123" in first.getMessage() and "POST /v1/chat/completions" in first.getMessage()
    assert lines[1].request_id == denied.headers["x-request-id"]
    everything = "\n".join(r.getMessage() + repr(r.__dict__) for r in caplog.records if r.name != "httpx")
    assert SECRET not in everything and PROMPT not in everything


async def test_streams_are_logged_once_when_they_end(caplog):
    caplog.set_level(logging.INFO)
    app = build_app(FakeAsyncEngine(), served_model_name="fake-model")
    async with _client(app) as c:
        r = await c.post("/v1/completions", json={"model": "fake-model", "prompt": "x", "stream": True})
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
    assert [(r.path, r.status) for r in _access(caplog)] == [("/v1/completions", 200)]


async def test_access_log_off(caplog):
    caplog.set_level(logging.INFO)
    app = build_app(FakeAsyncEngine(), served_model_name="fake-model", access_log=False)
    async with _client(app) as c:
        assert (await c.get("/health")).status_code == 200
    assert _access(caplog) == []


def test_access_log_flags():
    assert _parse([]).access_log is True
    assert _parse(["--disable-access-log"]).access_log is False
    assert _parse(["--disable-uvicorn-access-log"]).access_log is False  # vLLM's name
    assert ServerConfig.from_args(_parse(["--disable-uvicorn-access-log"])).access_log is False
    assert ServerConfig().access_log is True


def test_log_format_flag():
    assert _parse([]).log_format == "text"
    assert _parse(["--log-format", "json"]).log_format == "json"
    with pytest.raises(SystemExit):
        _parse(["--log-format", "xml"])


def test_json_formatter_one_object_per_line():
    fmt = JsonFormatter(process="worker 1")
    rec = logging.LogRecord("pagedserve.engine.x", logging.WARNING, __file__, 1, "two\nlines %d", (7,), None)
    rec.request_id = "r1"
    line = fmt.format(rec)
    assert "\n" not in line
    obj = json.loads(line)
    assert obj["level"] == "WARNING" and obj["logger"] == "pagedserve.engine.x" and obj["message"] == "two\nlines 7"
    assert obj["request_id"] == "r1" and obj["process"] == "worker 1" and obj["time"].endswith("Z")
    try:
        raise ValueError("boom")
    except ValueError:
        import sys

        rec = logging.LogRecord("a", logging.ERROR, __file__, 1, "failed", (), sys.exc_info())
    obj = json.loads(fmt.format(rec))
    assert "request_id" not in obj and "ValueError: boom" in obj["exception"]


@pytest.fixture
def json_log(monkeypatch):
    """The process's logging set up as `serve --log-format json` does, into a string; put back after.
    Yields a function that returns the lines written so far, parsed."""
    from pagedserve.contracts import log_format

    stream = io.StringIO()
    monkeypatch.setattr("sys.stderr", stream)
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    configure_logging("info", "json")
    try:
        yield lambda: [json.loads(line) for line in stream.getvalue().splitlines()]
    finally:
        for h in [h for h in root.handlers if h not in handlers]:
            root.removeHandler(h)
        root.setLevel(level)
        monkeypatch.setitem(log_format._state, "format", "text")
        logging.captureWarnings(False)


def test_configure_logging_json_with_the_request_id_of_the_task(json_log):
    assert current_format() == "json"
    logging.getLogger("uvicorn.error").info("uvicorn's line")
    token = REQUEST_ID.set("req-9")
    try:
        logging.getLogger("pagedserve.app.x").warning("inside a request")
    finally:
        REQUEST_ID.reset(token)
    logging.getLogger("pagedserve.app.x").debug("below the level")
    assert [(o["logger"], o["message"], o.get("request_id")) for o in json_log()] == [
        ("uvicorn.error", "uvicorn's line", None), ("pagedserve.app.x", "inside a request", "req-9")]


async def test_a_request_log_record_carries_its_id(json_log):
    """A record logged while serving a request (here the unexpected-error log) names the request,
    and the access line goes through the same formatter."""
    engine = FakeAsyncEngine()

    def broken(*a, **k):
        raise RuntimeError("kaboom")

    engine.generate = broken
    app = build_app(engine, served_model_name="fake-model")
    async with _client(app) as c:
        r = await c.post("/v1/completions", headers={"X-Request-Id": "rid-err"},
                         json={"model": "fake-model", "prompt": "x"})
    assert r.status_code == 500
    lines = json_log()
    errors = [o for o in lines if o["level"] == "ERROR"]
    assert errors and all(o.get("request_id") == "rid-err" for o in errors), lines
    access = [o for o in lines if o["logger"] == "pagedserve.access"]
    assert [(o["method"], o["path"], o["status"], o["request_id"], o["client"]) for o in access] == [
        ("POST", "/v1/completions", 500, "rid-err", "10.1.2.3:4567")]
    assert isinstance(access[0]["duration_ms"], float)
