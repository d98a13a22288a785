"""When stream events go out, and that every client can read them: the chat role chunk goes with
the first token (benchmark clients time TTFT at the first chunk with choices), and no SSE
comment pings by default (vLLM's benchmark client loses every event after one)."""
from __future__ import annotations

import asyncio

import orjson

from pagedserve.app.server import build_app
from tests.app.asgi_stream import AsgiRun, read_like_vllm_bench, until
from tests.app.conftest import sse_payloads
from tests.app.fake_engine import FakeAsyncEngine

CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stream": True,
        "stream_options": {"include_usage": True}}


def body_text(run: AsgiRun) -> str:
    return b"".join(run.chunks).decode()


async def test_chat_role_chunk_waits_for_the_first_token(app, engine):
    engine.first_output_gate = asyncio.Event()
    run = AsgiRun(app, "POST", "/v1/chat/completions", CHAT)
    await until(lambda: engine.calls)  # submitted; the engine holds its first output
    for _ in range(200):
        await asyncio.sleep(0)
    assert b"data:" not in b"".join(run.chunks), "a chunk went out before the engine produced"
    engine.first_output_gate.set()
    await run.finish()
    events = sse_payloads(body_text(run))
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert events[1]["choices"][0]["delta"] == {"content": "H"}
    assert events[-1] == "[DONE]"


async def test_n2_each_choice_gets_its_role_before_its_first_content(client):
    r = await client.post("/v1/chat/completions", json={**CHAT, "n": 2})
    chunks = sse_payloads(r.text)[:-1]
    seen: dict[int, list] = {0: [], 1: []}
    for c in chunks:
        for ch in c["choices"]:
            seen[ch["index"]].append(ch["delta"])
    for deltas in seen.values():
        assert deltas[0] == {"role": "assistant", "content": ""}
        assert all("role" not in d for d in deltas[1:])
    assert "".join(d.get("content", "") for d in seen[1]) == "[1] "


async def run_slow_stream(path: str, body: dict, ping: float | None) -> AsgiRun:
    engine = FakeAsyncEngine()
    engine.delay = 0.02  # 30 deltas: a stream several ping intervals long
    kwargs = {} if ping is None else {"sse_ping_interval": ping}
    app = build_app(engine, served_model_name="fake-model", **kwargs)
    run = AsgiRun(app, "POST", path, body)
    await run.finish()
    assert run.status == 200
    return run


async def test_no_pings_by_default_and_a_chunk_stripping_client_gets_every_event():
    body = {**CHAT, "max_tokens": 30}
    run = await run_slow_stream("/v1/chat/completions", body, ping=None)
    assert b": ping" not in b"".join(run.chunks)
    expected = sse_payloads(body_text(run))
    got = read_like_vllm_bench(run.chunks)
    assert got[-1] == "[DONE]"
    assert [orjson.loads(e) for e in got[:-1]] == expected[:-1]
    assert expected[-2]["usage"]["completion_tokens"] == 30
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in expected[:-2])
    assert text == "Hello world, this is a fake rep"[:30]


async def test_completions_stream_also_reaches_a_chunk_stripping_client():
    body = {"prompt": "Hi", "max_tokens": 30, "stream": True, "stream_options": {"include_usage": True}}
    run = await run_slow_stream("/v1/completions", body, ping=0)
    got = read_like_vllm_bench(run.chunks)
    assert got[-1] == "[DONE]" and orjson.loads(got[-2])["usage"]["completion_tokens"] == 30
    assert len(got) == 32


async def test_pings_on_request_and_what_they_do_to_such_a_client():
    body = {**CHAT, "max_tokens": 30}
    run = await run_slow_stream("/v1/chat/completions", body, ping=0.005)
    assert any(c.startswith(b": ping") for c in run.chunks)
    # a standard SSE reader skips the comments ...
    assert sse_payloads(body_text(run))[-1] == "[DONE]"
    # ... the benchmark's reader does not: the reason pings are off by default
    assert "[DONE]" not in read_like_vllm_bench(run.chunks)


def test_serve_sends_no_pings_unless_asked():
    from pagedserve.app.cli import build_parser

    argv = ["serve"]
    assert build_parser(argv).parse_args(argv).sse_ping_interval == 0
    argv = ["serve", "--sse-ping-interval", "15"]
    assert build_parser(argv).parse_args(argv).sse_ping_interval == 15
