"""A tiny OpenAI-compatible server for the load-test tests.

It streams SSE completions / chat completions with usage, has vLLM-style /tokenize and
/detokenize over a word-level tokenizer (one whitespace-separated word = one token), and
a "faulty" mode that cycles through the failures a benchmark must survive:
request i % 5 == 0 ok, 1 HTTP 500, 2 connection dropped mid-stream, 3 malformed event,
4 stream without [DONE]. Every answer's usage is logged in `state.usage` so tests can
compare the client's counts with what the server said.
"""
from __future__ import annotations

import asyncio
import socket
import threading
import time
from dataclasses import dataclass, field

import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

MODEL = "mock-model"
FAULTS = ("ok", "http500", "drop", "malformed", "nodone")


@dataclass
class MockState:
    mode: str = "ok"  # ok | faulty
    ttft_s: float = 0.02
    itl_s: float = 0.002
    tokenize: bool = True  # False: no /tokenize, clients must fall back
    count: int = 0
    usage: list[tuple[int, int]] = field(default_factory=list)  # (prompt, completion) of full answers
    faults: dict[str, int] = field(default_factory=dict)
    vocab: dict[str, int] = field(default_factory=dict)
    words: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def word_id(self, w: str) -> int:
        with self.lock:
            if w not in self.vocab:
                self.vocab[w] = len(self.words)
                self.words.append(w)
            return self.vocab[w]


def _sse(obj) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def create_app(state: MockState) -> Starlette:
    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "mock"}]})

    async def tokenize(request: Request) -> Response:
        if not state.tokenize:
            return JSONResponse({"detail": "Not Found"}, 404)
        body = await request.json()
        ids = [state.word_id(w) for w in str(body["prompt"]).split()]
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": 4096})

    async def detokenize(request: Request) -> Response:
        if not state.tokenize:
            return JSONResponse({"detail": "Not Found"}, 404)
        body = await request.json()
        words = state.words
        return JSONResponse({"prompt": " ".join(words[i] for i in body["tokens"] if 0 <= i < len(words))})

    async def generate(request: Request, chat: bool) -> Response:
        body = await request.json()
        with state.lock:
            idx = state.count
            state.count += 1
        fault = FAULTS[idx % len(FAULTS)] if state.mode == "faulty" else "ok"
        state.faults[fault] = state.faults.get(fault, 0) + 1
        if fault == "http500":
            return JSONResponse({"error": {"message": "mock internal error", "type": "server_error"}}, 500)
        if chat:
            text = " ".join(str(m.get("content", "")) for m in body["messages"])
        else:
            text = str(body["prompt"])
        prompt_tokens = len(text.split())
        n = int(body.get("max_tokens") or 16)
        rid = f"cmpl-{idx}"
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(piece: str, finish: str | None = None) -> dict:
            if chat:
                choice = {"index": 0, "delta": {"content": piece}, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": piece, "finish_reason": finish}
            return {"id": rid, "object": obj, "created": int(time.time()), "model": MODEL, "choices": [choice]}

        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}
        if not body.get("stream"):
            await asyncio.sleep(state.ttft_s + state.itl_s * n)
            state.usage.append((prompt_tokens, n))
            full = " tok" * n
            choice = {"index": 0, "finish_reason": "length"}
            if chat:
                choice["message"] = {"role": "assistant", "content": full}
            else:
                choice["text"] = full
            return JSONResponse({"id": rid, "object": obj.replace(".chunk", ""), "model": MODEL,
                                 "choices": [choice], "usage": usage})

        async def stream():
            if chat:
                first = chunk("")
                first["choices"][0]["delta"] = {"role": "assistant", "content": ""}
                yield _sse(first)
            await asyncio.sleep(state.ttft_s)
            sent = 0
            step = 0
            while sent < n:
                # one or two tokens per event, so counting events would give the wrong total
                k = min(1 + step % 2, n - sent)
                sent += k
                step += 1
                yield _sse(chunk(" tok" * k, "length" if sent == n else None))
                if fault == "drop" and sent >= n // 2:
                    raise ConnectionResetError("mock drops the connection")
                if fault == "malformed" and sent >= n // 2:
                    yield b"data: {this is not json\n\n"
                await asyncio.sleep(state.itl_s)
            final = chunk("")
            final["choices"] = []
            final["usage"] = usage
            yield _sse(final)
            if fault == "ok":
                state.usage.append((prompt_tokens, n))
                yield b"data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    async def completions(request: Request) -> Response:
        return await generate(request, chat=False)

    async def chat_completions(request: Request) -> Response:
        return await generate(request, chat=True)

    return Starlette(
        routes=[
            Route("/v1/models", models),
            Route("/tokenize", tokenize, methods=["POST"]),
            Route("/detokenize", detokenize, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        ]
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class AppServer:
    """Runs an ASGI app with uvicorn in a background thread on 127.0.0.1 (a free port)."""

    def __init__(self, app):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="critical", lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    def __enter__(self):
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("mock server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)


class MockServer(AppServer):
    """The mock OpenAI app served on 127.0.0.1; `state` shows what it answered."""

    def __init__(self, mode: str = "ok", **kwargs):
        self.state = MockState(mode=mode, **kwargs)
        super().__init__(create_app(self.state))


if __name__ == "__main__":
    import sys

    with MockServer(mode=sys.argv[1] if len(sys.argv) > 1 else "ok") as srv:
        print(srv.base_url, flush=True)
        try:
            while True:
                time.sleep(1)
        except KeyboardInterrupt:
            pass
