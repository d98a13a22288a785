"""The routes that do not generate: models, tokenize / detokenize, health, version, metrics and
the OpenAPI document."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import Response

from app.errors import APIError
from app.protocol import DetokenizeRequest, TokenizeRequest, parse
from app.responses import ORJSONResponse


def server_version() -> str:
    try:
        import importlib.metadata

        return importlib.metadata.version("pagedserve")
    except Exception:  # not installed (running from a checkout)
        return "0.1.0"


class InfoRoutes:
    """Mixin of OpenAIServer (with RouteBase and ChatRoute)."""

    async def models(self, request: Request) -> Response:
        return ORJSONResponse({"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": self.created,
            "owned_by": "pagedserve", "root": self.model_name, "parent": None,
            "max_model_len": self.engine.max_model_len,
        }]})

    async def tokenize(self, request: Request) -> Response:
        req = parse(TokenizeRequest, await self.read_json(request))
        req.check()
        messages = tools = None
        if req.messages is not None:
            messages, tools = self.template_messages(req.messages, [t.as_dict() for t in req.tools or []])
        self.check_model(req.model)  # after the body: what the schema refuses is a 400 first
        if messages is not None:
            if req.continue_final_message and req.add_generation_prompt:
                raise APIError.bad_request("continue_final_message and add_generation_prompt cannot "
                                           "both be true", param="continue_final_message")
            _, ids = await self.chat_prompt(messages, req.add_generation_prompt,
                                            req.continue_final_message, tools)
        else:
            ids = list(await self.engine.encode(req.prompt, add_special_tokens=req.add_special_tokens))
        return ORJSONResponse({"count": len(ids), "max_model_len": self.engine.max_model_len,
                               "tokens": ids})

    async def detokenize(self, request: Request) -> Response:
        req = parse(DetokenizeRequest, await self.read_json(request))
        self.check_ids(req.tokens, "tokens")
        self.check_model(req.model)  # after the body: what the schema refuses is a 400 first
        return ORJSONResponse({"prompt": await self.decode(req.tokens)})

    async def health(self, request: Request) -> Response:
        """``{"status": "ok" | "restarting" | "dead"}``, 200 only when ok (what balancers route on)."""
        status = getattr(self.engine, "health_status", None)  # an engine without restarts: is_healthy
        state = status() if status is not None else ("ok" if self.engine.is_healthy() else "dead")
        if state == "ok":
            return ORJSONResponse({"status": "ok"})
        err = (APIError.overloaded("The engine is restarting its workers; retry shortly.")
               if state == "restarting" else APIError.engine_dead())
        return ORJSONResponse({"status": state, **err.body()}, status_code=err.status,
                              headers=err.headers)

    async def version(self, request: Request) -> Response:
        return ORJSONResponse({"version": server_version()})

    async def metrics_route(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)


def openapi_route(engine: Any, name: str, api_key: str | None,
                   max_body_bytes: int) -> Callable[[Request], Any]:
    """GET /openapi.json: the document is built once, from what this server enforces."""
    from app.openapi import build_openapi

    body = orjson.dumps(build_openapi(
        served_model_name=name, max_model_len=engine.max_model_len,
        vocab_size=getattr(engine.tokenizer, "vocab_size", None), api_key=bool(api_key),
        max_body_bytes=max_body_bytes, version=server_version()))

    async def openapi(request: Request) -> Response:
        return Response(body, media_type="application/json")

    return openapi
