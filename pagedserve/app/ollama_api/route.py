"""Ollama's API: ``/api/chat`` and ``/api/generate`` run on the chat route's path (the body
translated by app/ollama_api/translate.py, then ``ChatRoute.start``: admission, template, tools,
reasoning split, sampling, the engine call) and answer as Ollama does, one JSON object or NDJSON
lines (``stream`` defaults to true) ending with ``done: true``, ``done_reason`` and the counts and
durations (ns) Ollama reports. ``/api/embed`` (and the older ``/api/embeddings``) run on the
embeddings route's path. ``/api/tags``, ``/api/ps``, ``/api/show`` and ``/api/version`` describe the
served model; the model-management routes (pull, push, create, copy, delete, blobs) answer a clear
error: this server serves the model it was started with. Errors: ``{"error": "..."}``."""
from __future__ import annotations

import hashlib
import os
import time
from collections.abc import AsyncIterator
from datetime import datetime, timezone
from typing import Any

import anyio
import orjson
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse

from pagedserve.app.admission import check_body
from pagedserve.app.chat_route import ChatRoute
from pagedserve.app.embeddings_protocol import EmbeddingRequest
from pagedserve.app.embeddings_route import EmbeddingsRoute
from pagedserve.app.errors import APIError, to_api_error
from pagedserve.app.fanout import ClientDisconnected, end_unfinished
from pagedserve.app.info_routes import server_version
from pagedserve.app.protocol import parse
from pagedserve.app.request_id import response_and_engine_ids
from pagedserve.app.responses import ORJSONResponse
from pagedserve.app.streaming import close_all
from pagedserve.app.ollama_api.errors import error_response
from pagedserve.app.ollama_api.translate import chat_body, embed_body, generate_body, model_name
from pagedserve.app.translated_chat import ChatPieces, read_body, start_chat

# The Ollama API version /api/version reports: the release whose API these routes follow (clients
# such as Open WebUI compare it against the features they use).
OLLAMA_API_VERSION = "0.9.0"
NDJSON = "application/x-ndjson"
_MANAGEMENT = ("pull", "push", "create", "copy", "delete", "blobs/{digest}")


def _now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def _guard(handler):
    async def endpoint(request: Request) -> Response:
        try:
            return await handler(request)
        except (ClientDisconnected, ClientDisconnect):
            raise
        except Exception as e:  # noqa: BLE001 - every error leaves in Ollama's shape
            return error_response(to_api_error(e))

    return endpoint


class NDJSONResponse(StreamingResponse):
    """NDJSON lines; the engine streams are closed once the response ends however it ends (done, the
    client gone, the handler cancelled): an unfinished request is aborted, and ``on_close`` runs."""

    def __init__(self, lines: AsyncIterator[dict[str, Any]], streams: list[Any], on_close: Any) -> None:
        async def body() -> AsyncIterator[bytes]:
            try:
                async for line in lines:
                    yield orjson.dumps(line) + b"\n"
            except Exception as e:  # noqa: BLE001 - reported in the stream, as Ollama does
                yield orjson.dumps({"error": to_api_error(e).message}) + b"\n"

        super().__init__(body(), media_type=NDJSON)
        self._streams = list(streams)
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await close_all(self._streams, self._on_close)


class OllamaRoutes:
    def __init__(self, chat: ChatRoute, embedding: EmbeddingsRoute) -> None:
        self.chat = chat
        self.embedding = embedding
        self.modified_at = _now()

    def routes(self) -> list[tuple[str, Any, list[str]]]:
        """(path, endpoint, methods) of every route (the app wraps each as its others)."""
        out = [("/api/chat", _guard(self.chat_route), ["POST"]),
               ("/api/generate", _guard(self.generate), ["POST"]),
               ("/api/embed", _guard(self.embed), ["POST"]),
               ("/api/embeddings", _guard(self.embeddings_legacy), ["POST"]),
               ("/api/tags", _guard(self.tags), ["GET"]),
               ("/api/ps", _guard(self.ps), ["GET"]),
               ("/api/show", _guard(self.show), ["POST"]),
               ("/api/version", _guard(self.version), ["GET"])]
        for name in _MANAGEMENT:
            out.append((f"/api/{name}", _guard(self.management), ["POST", "DELETE", "HEAD", "GET"]))
        return out

    # ---- generation ---------------------------------------------------------------------------

    async def chat_route(self, request: Request) -> Response:
        data = await read_body(self.chat, request)
        return await self._generate(request, data, chat_body, "message")

    async def generate(self, request: Request) -> Response:
        data = await read_body(self.chat, request)
        return await self._generate(request, data, generate_body, "response")

    async def _generate(self, request: Request, data: Any, translate: Any, kind: str) -> Response:
        stream = not (isinstance(data, dict) and data.get("stream") is False)  # Ollama streams by default
        if isinstance(data, dict) and not data.get("messages" if kind == "message" else "prompt"):
            self.chat.checks.check_model(model_name(data))
            reason = "unload" if data.get("keep_alive") == 0 else "load"  # Ollama's load / unload call
            line = {"model": data["model"], "created_at": _now(), "done": True, "done_reason": reason}
            line.update({"message": {"role": "assistant", "content": ""}} if kind == "message" else {"response": ""})
            return ORJSONResponse(line)
        body = translate(data)
        model = data["model"]
        run = await start_chat(self.chat, request, body, "chatcmpl" if kind == "message" else "cmpl")
        pieces = ChatPieces(run, self.chat)
        if stream:
            return NDJSONResponse(self._lines(pieces, model, kind), run.streams,
                                  lambda: end_unfinished(run.choices, ClientDisconnected()))
        whole = await self.chat.fanout.until_disconnect(request, self._whole(pieces, model, kind), run.streams,
                                                        run.choices)
        return ORJSONResponse(whole)

    def _line(self, model: str, kind: str, text: str = "", thinking: str = "",
              calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        line: dict[str, Any] = {"model": model, "created_at": _now()}
        if kind == "message":
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if thinking:
                message["thinking"] = thinking
            if calls:
                message["tool_calls"] = calls
            line["message"] = message
        else:
            line["response"] = text
            if thinking:
                line["thinking"] = thinking
        line["done"] = False
        return line

    def _done(self, line: dict[str, Any], pieces: ChatPieces) -> dict[str, Any]:
        end = pieces.end_ns or time.monotonic_ns()
        first = pieces.first_token_ns or end
        line.update({"done": True, "done_reason": "length" if pieces.finish_reason == "length" else "stop",
                     "total_duration": end - pieces.start_ns, "load_duration": 0,
                     "prompt_eval_count": pieces.prompt_tokens, "prompt_eval_duration": first - pieces.start_ns,
                     "eval_count": pieces.output_tokens, "eval_duration": end - first})
        return line

    async def _lines(self, pieces: ChatPieces, model: str, kind: str) -> AsyncIterator[dict[str, Any]]:
        calls = Calls()
        async for piece in pieces.pieces():
            if piece.kind == "call":
                calls.add(piece.call)
            elif piece.kind == "text":
                yield self._line(model, kind, text=piece.text)
            else:
                yield self._line(model, kind, thinking=piece.text)
        if calls.calls:  # Ollama sends a reply's calls whole, in a message of their own
            yield self._line(model, kind, calls=calls.wire())
        yield self._done(self._line(model, kind), pieces)

    async def _whole(self, pieces: ChatPieces, model: str, kind: str) -> dict[str, Any]:
        text: list[str] = []
        thinking: list[str] = []
        calls = Calls()
        async for piece in pieces.pieces():
            if piece.kind == "call":
                calls.add(piece.call)
            else:
                (text if piece.kind == "text" else thinking).append(piece.text)
        line = self._line(model, kind, "".join(text), "".join(thinking), calls.wire() if calls.calls else None)
        return self._done(line, pieces)

    # ---- embeddings ---------------------------------------------------------------------------

    async def embed(self, request: Request) -> Response:
        return await self._embed(request, legacy=False)

    async def embeddings_legacy(self, request: Request) -> Response:
        return await self._embed(request, legacy=True)

    async def _embed(self, request: Request, legacy: bool) -> Response:
        start = time.monotonic_ns()
        data = await read_body(self.chat, request)
        body = embed_body(data, legacy)
        route = self.embedding
        check_body("embeddings", body, route.checks.limits, route.engine.tokenizer.vocab_size,
                   route.engine.max_model_len)
        req = parse(EmbeddingRequest, body)
        inputs = await route.pooling_inputs(req.input, req.add_special_tokens, "input")
        route.checks.check_base_model(req.model, "embeddings")
        params = route.pooling_params(None, True, req.dimensions)
        _, engine_id = response_and_engine_ids(request, "embd", None)
        outs = await route.pool_all(request, inputs, params, engine_id, 0, None)
        vectors = [memoryview(o.outputs.data_bytes).cast("f").tolist() for o in outs]
        if legacy:
            return ORJSONResponse({"embedding": vectors[0]})
        n = sum(len(ids) for _, ids in inputs)
        return ORJSONResponse({"model": data["model"], "embeddings": vectors,
                               "total_duration": time.monotonic_ns() - start, "load_duration": 0,
                               "prompt_eval_count": n})

    # ---- the served model ---------------------------------------------------------------------

    def _details(self) -> dict[str, Any]:
        path = self.chat.engine.config.model.model or ""
        hf = self.chat.engine.config.model.hf_config or {}
        family = str(hf.get("model_type") or "")
        return {"parent_model": "", "format": "gguf" if path.endswith(".gguf") else "safetensors",
                "family": family, "families": [family] if family else None, "parameter_size": "",
                "quantization_level": ""}

    def _size(self) -> int:
        """Bytes of the model's weights on disk (a file, or a directory's weight files); 0 when unknown."""
        path = self.chat.engine.config.model.model
        try:
            if path and os.path.isfile(path):
                return os.path.getsize(path)
            if path and os.path.isdir(path):
                return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)
                           if f.endswith((".safetensors", ".gguf", ".bin")))
        except OSError:
            pass
        return 0

    def _names(self) -> list[str]:
        return list(self.chat.checks.model_names)

    def _card(self, name: str) -> dict[str, Any]:
        return {"name": name, "model": name, "modified_at": self.modified_at, "size": self._size(),
                "digest": hashlib.sha256(name.encode()).hexdigest(), "details": self._details()}

    async def tags(self, request: Request) -> Response:
        return ORJSONResponse({"models": [self._card(n) for n in self._names()]})

    async def ps(self, request: Request) -> Response:
        cards = [{**self._card(n), "expires_at": "0001-01-01T00:00:00Z", "size_vram": 0,
                  "context_length": self.chat.engine.max_model_len} for n in self._names()]
        return ORJSONResponse({"models": cards})

    async def show(self, request: Request) -> Response:
        data = await read_body(self.chat, request)
        if not isinstance(data, dict):
            raise APIError.bad_request("the request body must be a JSON object")
        if not data.get("model") and data.get("name"):
            data["model"] = data["name"]  # the older field
        name = model_name(data)
        if name not in self.chat.checks.model_names:
            raise APIError(404, f"model '{data['model']}' not found", "not_found_error")
        template = self.chat.engine.tokenizer.chat_template or ""
        capabilities = ["completion"]
        if self.chat.tool_config.enable_auto_tool_choice:
            capabilities.append("tools")
        if self.chat.reasoning_parser:
            capabilities.append("thinking")
        return ORJSONResponse({"modelfile": "", "parameters": "", "template": template, "details": self._details(),
                               "model_info": {"general.architecture": self._details()["family"],
                                              "general.context_length": self.chat.engine.max_model_len},
                               "capabilities": capabilities, "modified_at": self.modified_at})

    async def version(self, request: Request) -> Response:
        return ORJSONResponse({"version": OLLAMA_API_VERSION, "pagedserve": server_version()})

    async def management(self, request: Request) -> Response:
        action = request.url.path.removeprefix("/api/").split("/")[0]
        raise APIError(501, f"/api/{action} is not supported by this server: it serves the model it was started "
                            f"with ({self.chat.model_name!r}); pull, push, create, copy and delete models with "
                            "Ollama itself", "invalid_request_error")


class Calls:
    """A reply's tool calls, their argument pieces joined; Ollama's form (arguments as an object)."""

    def __init__(self) -> None:
        self.calls: dict[int, list[Any]] = {}  # index -> [name, argument pieces]

    def add(self, delta: Any) -> None:
        if delta.id is not None:
            self.calls[delta.index] = [delta.name, []]
        self.calls[delta.index][1].append(delta.arguments)

    def wire(self) -> list[dict[str, Any]]:
        out = []
        for index, (name, pieces) in sorted(self.calls.items()):
            try:
                args = orjson.loads("".join(pieces) or "{}")
            except orjson.JSONDecodeError:
                args = {}
            out.append({"function": {"index": index, "name": name, "arguments": args}})
        return out


def routes(chat: ChatRoute, embedding: EmbeddingsRoute, wrap: Any) -> list[Any]:
    """Ollama's routes (``wrap``: app.server's, for disconnects and the LoRA scope)."""
    from starlette.routing import Route

    return [Route(path, wrap(endpoint), methods=methods)
            for path, endpoint, methods in OllamaRoutes(chat, embedding).routes()]
