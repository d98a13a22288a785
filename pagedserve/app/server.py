"""Starlette app: the OpenAI-compatible routes in front of an AsyncEngine.

One object per route family, each given its collaborators when it is built: the completions,
chat and embeddings routes (app.completions_route, app.chat_route, app.embeddings_route) and the
routes that do not generate (app.info_routes), the Responses API on the chat route's path
(app.responses_api), over the request checks (app.request_checks), the
fan-out of a request into one engine request per choice (app.fanout), the logprob format
(app.logprob_format) and the chat prompts (app.chat_prompt). OpenAIServer holds them.
This module builds them and the app: routes, error handling, middleware. Every error leaves as an
OpenAI-format body; a stream that fails midway sends one error event, then ``[DONE]``.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from pagedserve.app.anthropic_api.route import routes as anthropic_routes
from pagedserve.app.ollama_api.route import routes as ollama_routes
from pagedserve.app.access_log import AccessLogMiddleware
from pagedserve.app.auth import APIKeyMiddleware
from pagedserve.app.chat_page import chat_page_routes
from pagedserve.app.chat_prompt import ChatPrompts
from pagedserve.app.chat_route import ChatRoute
from pagedserve.app.completions_route import CompletionsRoute
from pagedserve.app.embeddings_route import EmbeddingsRoute
from pagedserve.app.errors import APIError, to_api_error
from pagedserve.app.fanout import ChoiceFanOut, ClientDisconnected, shutdown_error
from pagedserve.app.info_routes import InfoRoutes, openapi_route
from pagedserve.app.logprob_format import LogprobFormat
from pagedserve.app.lora_adapters import LoRAAdapters, check_roots, request_scope
from pagedserve.app.metrics import HTTPErrorCounter, ServerMetrics
from pagedserve.app.replica_metrics import ReplicaStatsCollector
from pagedserve.app.request_id import RequestIdMiddleware
from pagedserve.app.responses import error_response
from pagedserve.app.request_checks import RequestChecks
from pagedserve.app.server_config import ServerConfig
from pagedserve.app.trusted_host import HostCheckMiddleware
from pagedserve.app.responses_api.route import ResponsesRoute
from pagedserve.app.reasoning.output import check_parser_name
from pagedserve.contracts.config import ConfigError
from pagedserve.engine.client import EngineClient
from pagedserve.engine.replicas import ReplicatedEngine

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class OpenAIServer:
    """The route families of one engine and what they share (``app.state.server``)."""

    checks: RequestChecks
    fanout: ChoiceFanOut
    logprob_format: LogprobFormat
    prompts: ChatPrompts
    completion: CompletionsRoute
    chat: ChatRoute
    embedding: EmbeddingsRoute
    info: InfoRoutes
    responses: ResponsesRoute


def build_server(engine: EngineClient, name: str, config: ServerConfig, metrics: ServerMetrics,
                 adapters: LoRAAdapters | None = None) -> OpenAIServer:
    """Each route family with its collaborators (``name``: the model's served name; ``adapters``:
    the LoRA adapters served by name)."""
    c = config
    check_parser_name(c.reasoning_parser)
    checks = RequestChecks(engine, name, c.max_body_bytes, c.limits, c.other_names, adapters)
    fanout = ChoiceFanOut(engine, metrics, c.enable_prompt_tokens_details)
    logprob_format = LogprobFormat(engine)
    prompts = ChatPrompts(engine, checks)
    chat = ChatRoute(engine, name, checks, prompts, fanout, logprob_format, c.tool_config, c.sse_ping_interval,
                     c.trust_request_chat_template, c.reasoning_parser)
    return OpenAIServer(
        checks=checks, fanout=fanout, logprob_format=logprob_format, prompts=prompts,
        completion=CompletionsRoute(engine, name, checks, fanout, logprob_format, c.sse_ping_interval),
        chat=chat, responses=ResponsesRoute(chat, c.sse_ping_interval),
        embedding=EmbeddingsRoute(engine, name, checks, fanout, metrics),
        info=InfoRoutes(engine, name, checks, prompts, metrics, c.trust_request_chat_template, c.show_model_paths))


def _wrap(handler: Callable[[Request], Any]) -> Callable[[Request], Any]:
    async def endpoint(request: Request) -> Response:
        try:
            with request_scope():  # the LoRA adapters it resolves stay loaded until it returns
                return await handler(request)
        except (ClientDisconnected, ClientDisconnect):  # also gone in the middle of its body
            return Response(status_code=499)
        except asyncio.CancelledError:
            # uvicorn cancels the requests still running when --shutdown-timeout runs out. The
            # client is still there: tell it what a stream cut by the shutdown says (503).
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()
            return error_response(to_api_error(shutdown_error()))
        except Exception as e:  # noqa: BLE001 - every error leaves in OpenAI format
            return error_response(to_api_error(e))

    return endpoint


async def _http_exception(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    messages = {404: f"Not found: {request.url.path}",
                405: f"Method {request.method} is not allowed on {request.url.path}"}
    err = APIError(exc.status_code, messages.get(exc.status_code, str(exc.detail)),
                   "invalid_request_error", None, None, headers=dict(exc.headers or {}))
    return error_response(err)


async def _unexpected(request: Request, exc: Exception) -> Response:
    return error_response(to_api_error(exc))


def build_app(engine: EngineClient, config: ServerConfig | None = None, *, lifespan: Any = None,
              **options: Any) -> Starlette:
    """The ASGI app for one engine. Metrics live in a registry of their own (``app.state.metrics``).
    ``config``: the server's options (app/server_config.py says what each does); ``options``: the
    same as keywords, for a config built here (``build_app(engine, api_key="k")``); not both.
    ``lifespan``: Starlette's. ``config.lora_modules`` are checked now (a bad one raises ConfigError),
    and ``allow_runtime_lora_updating`` needs ``lora_roots`` (ConfigError without)."""
    if config is None:
        config = ServerConfig(**options)
    elif options:
        raise TypeError(f"build_app takes a ServerConfig or its options as keywords, not both: {sorted(options)}")
    c = config
    name = c.served_model_name or engine.model_name
    if c.allow_runtime_lora_updating and not c.lora_roots:
        raise ConfigError("--allow-runtime-lora-updating needs --lora-root DIR: the directories under which "
                          "/v1/load_lora_adapter may read adapters")
    adapters = LoRAAdapters(engine, name, bool(engine.config.lora.enable_lora), check_roots(c.lora_roots or ()),
                            c.max_runtime_loras)
    for module in c.lora_modules or ():
        try:
            adapters.add(module.name, module.path, module.base_model_name)
        except APIError as e:  # at start-up: a config error (serve prints it and exits)
            raise ConfigError(f"--lora-modules {module.name}: {e.message}") from None
    per_replica = ReplicaStatsCollector(engine, name) if isinstance(engine, ReplicatedEngine) else None
    metrics = ServerMetrics(engine, name, per_replica)
    s = build_server(engine, name, c, metrics, adapters)
    routes = [
        Route("/v1/completions", _wrap(s.completion.completions), methods=["POST"]),
        Route("/v1/chat/completions", _wrap(s.chat.chat_completions), methods=["POST"]),
        Route("/v1/responses", _wrap(s.responses.responses), methods=["POST"]),
        *anthropic_routes(s.chat, _wrap),  # /v1/messages (app/anthropic_api)
        *ollama_routes(s.chat, s.embedding, _wrap),  # /api/... (app/ollama_api)
        Route("/v1/embeddings", _wrap(s.embedding.embeddings), methods=["POST"]),
        Route("/v1/score", _wrap(s.embedding.score), methods=["POST"]),
        Route("/score", _wrap(s.embedding.score), methods=["POST"]),  # vLLM serves both paths
        Route("/v1/models", _wrap(s.info.models), methods=["GET"]),
        Route("/tokenize", _wrap(s.info.tokenize), methods=["POST"]),
        Route("/detokenize", _wrap(s.info.detokenize), methods=["POST"]),
        Route("/health", _wrap(s.info.health), methods=["GET"]),
        Route("/ping", _wrap(s.info.health), methods=["GET", "POST"]),  # vLLM's (SageMaker) liveness
        Route("/version", _wrap(s.info.version), methods=["GET"]),
        Route("/metrics", _wrap(s.info.metrics_route), methods=["GET"]),
        Route("/openapi.json", openapi_route(engine, name, c.api_key, c.max_body_bytes,
                                             c.trust_request_chat_template, s.checks.limits,
                                             c.allow_runtime_lora_updating, c.trusted_hosts is not None),
              methods=["GET"]),
    ]
    if c.allow_runtime_lora_updating:  # else absent, as vLLM's without VLLM_ALLOW_RUNTIME_LORA_UPDATING
        routes += [Route("/v1/load_lora_adapter", _wrap(partial(adapters.load_route, checks=s.checks)),
                         methods=["POST"]),
                   Route("/v1/unload_lora_adapter", _wrap(partial(adapters.unload_route, checks=s.checks)),
                         methods=["POST"])]
    if c.chat_page:  # GET /: the chat page (app/chat_page.py)
        routes += chat_page_routes()
    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={HTTPException: _http_exception, Exception: _unexpected})
    if c.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=c.api_key)
    if c.trusted_hosts is not None:  # before the API key is asked; its 400s are counted
        app.add_middleware(HostCheckMiddleware, hosts=c.trusted_hosts)
    app.add_middleware(HTTPErrorCounter, metrics=metrics)  # sees 401s too
    if c.allowed_origins:  # browsers' preflight (OPTIONS) is answered before the API key is asked
        app.add_middleware(CORSMiddleware, allow_origins=c.allowed_origins, allow_methods=["*"],
                           allow_headers=["*"], expose_headers=["X-Request-Id"])
    app.add_middleware(RequestIdMiddleware)  # every response carries X-Request-Id
    if c.access_log:  # outermost: times every request, and logs the id the one above set
        app.add_middleware(AccessLogMiddleware)
    app.state.metrics = metrics
    app.state.server = s
    return app
