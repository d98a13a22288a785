"""The routes that do not generate: models, tokenize / detokenize, health, version, metrics and
the OpenAPI document."""
from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

import orjson
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import Response

from pagedserve.app.admission import AdmissionLimits, refuse
from pagedserve.app.chat_prompt import ChatPrompts
from pagedserve.app.errors import APIError
from pagedserve.app.prompt_options import chat_template_options
from pagedserve.app.metrics import ServerMetrics
from pagedserve.app.protocol import DetokenizeRequest, TokenizeRequest, parse
from pagedserve.app.request_checks import RequestChecks
from pagedserve.app.responses import ORJSONResponse
from pagedserve.engine.client import EngineClient


def server_version() -> str:
    from pagedserve import __version__

    return __version__


class InfoRoutes:
    """The routes that do not generate, over the request checks, the chat prompts (/tokenize
    with messages) and the metrics."""

    def __init__(self, engine: EngineClient, served_model_name: str, checks: RequestChecks,
                 prompts: ChatPrompts, metrics: ServerMetrics, trust_request_chat_template: bool = False,
                 show_model_paths: bool = False) -> None:
        self.engine = engine
        self.model_name = served_model_name
        self.checks = checks
        self.prompts = prompts
        self.metrics = metrics
        self.trust_request_chat_template = trust_request_chat_template
        self.show_model_paths = show_model_paths  # --show-model-paths: ``root`` is a path, not a name
        self.created = int(time.time())

    async def models(self, request: Request) -> Response:
        """vLLM's model card: ``root`` is the model the name serves (its served name; its path with
        --show-model-paths, as vLLM: a file system path is nobody's business by default),
        ``permission`` the fixed OpenAI-era permission object vLLM still sends."""
        root = (self.engine.config.model.model or self.model_name) if self.show_model_paths else self.model_name
        cards = [self._card(name, root, None) for name in self.checks.model_names]
        cards += [self._card(name, root, self.model_name)
                  for name, root in self.checks.adapters.cards(self.show_model_paths)]
        return ORJSONResponse({"object": "list", "data": cards})

    def _card(self, name: str, root: str, parent: str | None) -> dict:
        """One model card; a LoRA adapter's ``parent`` is the base model."""
        return {
            "id": name, "object": "model", "created": self.created,
            "owned_by": "pagedserve", "root": root, "parent": parent,
            "max_model_len": self.engine.max_model_len,
            "permission": [{
                "id": f"modelperm-{uuid.uuid4().hex}", "object": "model_permission",
                "created": self.created, "allow_create_engine": False, "allow_sampling": True,
                "allow_logprobs": True, "allow_search_indices": False, "allow_view": True,
                "allow_fine_tuning": False, "organization": "*", "group": None, "is_blocking": False,
            }],
        }

    async def tokenize(self, request: Request) -> Response:
        req = parse(TokenizeRequest, await self.checks.read_admitted(request, "tokenize"))
        req.check()
        options = chat_template_options(req, self.trust_request_chat_template)  # also refuses
        messages = tools = None
        if req.messages is not None:
            messages, tools = await self.prompts.template_messages(req.messages, [t.as_dict() for t in req.tools or []],
                                                     options.get("chat_template"))
        self.checks.check_model(req.model)  # after the body: what the schema refuses is a 400 first
        if messages is not None:
            if req.continue_final_message and req.add_generation_prompt:
                raise APIError.bad_request("continue_final_message and add_generation_prompt cannot "
                                           "both be true", param="continue_final_message")
            # As chat: no special tokens beyond the template's unless asked (vLLM's default).
            special = req.add_special_tokens if "add_special_tokens" in req.model_fields_set else False
            _, ids = await self.prompts.chat_prompt(messages, req.add_generation_prompt,
                                            req.continue_final_message, special, options, tools)
        else:
            ids = list(await self.engine.encode(req.prompt, add_special_tokens=req.add_special_tokens))
        body = {"count": len(ids), "max_model_len": self.engine.max_model_len, "tokens": ids}
        if req.return_token_strs:  # off the loop where the engine can (up to max_token_strs ids)
            limit = self.checks.limits.max_token_strs
            if len(ids) > limit:
                raise refuse("return_token_strs", f"return_token_strs asks for {len(ids)} token strings",
                             "max_token_strs", limit)
            body["token_strs"] = await self.engine.convert_ids_to_tokens(ids)
        return ORJSONResponse(body)

    async def detokenize(self, request: Request) -> Response:
        req = parse(DetokenizeRequest, await self.checks.read_json(
            request, self.checks.limits.max_tokenize_body_bytes, "--max-tokenize-body-bytes"))
        self.checks.check_ids(req.tokens, "tokens")
        self.checks.check_model(req.model)  # after the body: what the schema refuses is a 400 first
        return ORJSONResponse({"prompt": await self.engine.decode(req.tokens, skip_special_tokens=False)})

    async def health(self, request: Request) -> Response:
        """``{"status": "ok" | "restarting" | "dead"}``, 200 only when ok (what balancers route on)."""
        state = self.engine.health_status()
        replicas = self.engine.replica_states()  # data parallel: ok while any replica is
        extra = {"replicas": replicas} if replicas is not None else {}
        if state == "ok":
            return ORJSONResponse({"status": "ok", **extra})
        err = (APIError.overloaded("The engine is restarting its workers; retry shortly.")
               if state == "restarting" else APIError.engine_dead())
        return ORJSONResponse({"status": state, **extra, **err.body()}, status_code=err.status,
                              headers=err.headers)

    async def version(self, request: Request) -> Response:
        return ORJSONResponse({"version": server_version()})

    async def metrics_route(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)


def openapi_route(engine: EngineClient, name: str, api_key: str | None, max_body_bytes: int,
                  trust_request_chat_template: bool = False,
                  limits: AdmissionLimits | None = None, lora_runtime_routes: bool = False,
                  host_check: bool = False) -> Callable[[Request], Any]:
    """GET /openapi.json: the document is built once, from what this server enforces."""
    from pagedserve.app.openapi import build_openapi

    body = orjson.dumps(build_openapi(
        served_model_name=name, max_model_len=engine.max_model_len,
        vocab_size=engine.tokenizer.vocab_size, api_key=bool(api_key),
        max_body_bytes=max_body_bytes, version=server_version(),
        trust_request_chat_template=trust_request_chat_template,
        embedding_size=engine.embedding_size, limits=limits, lora_runtime_routes=lora_runtime_routes,
        host_check=host_check))

    async def openapi(request: Request) -> Response:
        return Response(body, media_type="application/json")

    return openapi
