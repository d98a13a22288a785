from __future__ import annotations

import httpx
import orjson
import pytest

from pagedserve.app.server import build_app
from tests.app.fake_engine import FakeAsyncEngine


@pytest.fixture
def engine() -> FakeAsyncEngine:
    return FakeAsyncEngine()


@pytest.fixture
def app(engine):
    return build_app(engine, served_model_name="fake-model", max_body_bytes=4096)


@pytest.fixture
async def client(app):
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
        yield c


def sse_payloads(text: str) -> list:
    """Parse an OpenAI SSE body strictly: only `data: ` events, each ended by a blank line."""
    assert text.endswith("\n\n"), text[-50:]
    events = text.split("\n\n")[:-1]
    out = []
    for ev in events:
        if ev.startswith(":"):  # keep-alive comment
            continue
        assert ev.startswith("data: ") and "\n" not in ev, ev
        data = ev[len("data: "):]
        out.append(data if data == "[DONE]" else orjson.loads(data))
    return out


def assert_openai_error(resp: httpx.Response, status: int, param: str | None = "<any>") -> dict:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"].startswith("application/json")
    body = resp.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if param != "<any>":
        assert err["param"] == param, err
    return err
