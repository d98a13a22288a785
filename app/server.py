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

from app.admission import AdmissionLimits
from app.anthropic_api.route import routes as anthropic_routes
from app.ollama_api.route import routes as ollama_routes
from app.auth import APIKeyMiddleware
from app.chat_page import chat_page_routes
from app.chat_prompt import ChatPrompts
from app.chat_route import ChatRoute
from app.completions_route import CompletionsRoute
from app.embeddings_route import EmbeddingsRoute
from app.errors import APIError, to_api_error
from app.fanout import ChoiceFanOut, ClientDisconnected, shutdown_error
from app.info_routes import InfoRoutes, openapi_route
from app.logprob_format import LogprobFormat
from app.lora_adapters import DEFAULT_MAX_RUNTIME_LORAS, LoRAAdapters, LoRAModule, check_roots, request_scope
from app.metrics import HTTPErrorCounter, ServerMetrics
from app.replica_metrics import ReplicaStatsCollector
from app.request_id import RequestIdMiddleware
from app.responses import error_response
from app.request_checks import RequestChecks
from app.trusted_host import HostCheckMiddleware, TrustedHosts
from app.responses_api.route import ResponsesRoute
from app.reasoning.output import check_parser_name
from app.tools.plan import ToolConfig
from contracts.config import ConfigError
from engine.client import EngineClient
from engine.replicas import ReplicatedEngine

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024


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


def build_server(engine: EngineClient, name: str, max_body_bytes: int, metrics: ServerMetrics, *,
                 sse_ping_interval: float = 0.0, trust_request_chat_template: bool = False,
                 tool_config: ToolConfig | None = None, limits: AdmissionLimits | None = None,
                 reasoning_parser: str | None = None, other_names: tuple[str, ...] = (),
                 adapters: LoRAAdapters | None = None, enable_prompt_tokens_details: bool = False,
                 show_model_paths: bool = False) -> OpenAIServer:
    """Each route family with its collaborators (``other_names``: the model's further served names;
    ``adapters``: the LoRA adapters served by name)."""
    check_parser_name(reasoning_parser)
    checks = RequestChecks(engine, name, max_body_bytes, limits if limits is not None else AdmissionLimits(),
                           other_names, adapters)
    fanout = ChoiceFanOut(engine, metrics, enable_prompt_tokens_details)
    logprob_format = LogprobFormat(engine)
    prompts = ChatPrompts(engine, checks)
    chat = ChatRoute(engine, name, checks, prompts, fanout, logprob_format,
                     tool_config if tool_config is not None else ToolConfig(), sse_ping_interval,
                     trust_request_chat_template, reasoning_parser)
    return OpenAIServer(
        checks=checks, fanout=fanout, logprob_format=logprob_format, prompts=prompts,
        completion=CompletionsRoute(engine, name, checks, fanout, logprob_format, sse_ping_interval),
        chat=chat, responses=ResponsesRoute(chat, sse_ping_interval),
        embedding=EmbeddingsRoute(engine, name, checks, fanout, metrics),
        info=InfoRoutes(engine, name, checks, prompts, metrics, trust_request_chat_template, show_model_paths))


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


def build_app(engine: EngineClient, *, served_model_name: str | None = None, api_key: str | None = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, lifespan: Any = None,
              sse_ping_interval: float = 0.0, trust_request_chat_template: bool = False,
              tool_config: ToolConfig | None = None, limits: AdmissionLimits | None = None,
              reasoning_parser: str | None = None, other_names: tuple[str, ...] = (),
              allowed_origins: list[str] | None = None, lora_modules: list[LoRAModule] | None = None,
              allow_runtime_lora_updating: bool = False, enable_prompt_tokens_details: bool = False,
              lora_roots: list[str] | None = None, max_runtime_loras: int = DEFAULT_MAX_RUNTIME_LORAS,
              show_model_paths: bool = False, trusted_hosts: TrustedHosts | None = None,
              chat_page: bool = True) -> Starlette:
    """The ASGI app for one engine. Metrics live in a registry of their own (``app.state.metrics``).
    ``sse_ping_interval``: seconds between SSE comment pings on streams (0 = none, as vLLM).
    ``trust_request_chat_template``: render a request's own ``chat_template`` (else 400).
    ``tool_config``: app.tools.plan.ToolConfig (--enable-auto-tool-choice, --tool-call-parser).
    ``limits``: app.admission.AdmissionLimits, what one request may ask for (default: the flags'
    defaults). ``reasoning_parser``: --reasoning-parser (app/reasoning), None = off.
    ``other_names``: --served-model-name's names after the first (requests may use any; responses
    carry the first). ``allowed_origins``: --allowed-origins (CORS), None = no CORS headers.
    ``lora_modules``: the adapters served by name from the start (--lora-modules; each checked
    now: a bad one raises APIError); ``allow_runtime_lora_updating``: the load / unload routes
    answer (--allow-runtime-lora-updating), reading only under ``lora_roots`` (--lora-root, required
    then: ConfigError without) and loading at most ``max_runtime_loras`` adapters
    (--max-runtime-loras). ``show_model_paths``: /v1/models shows the model's and adapters' paths
    as ``root`` (--show-model-paths; else their names). ``enable_prompt_tokens_details``: usage tells every
    caller how many prompt tokens the prefix cache served (--enable-prompt-tokens-details; without
    it only /v1/responses tells, and only a salted request). ``trusted_hosts``: the Host headers
    answered (app/trusted_host.py, what `serve` passes from --host, --api-key and --allowed-hosts);
    None = any. ``chat_page``: GET / serves the chat page (app/chat_page.py; off with
    --disable-chat-page: a 404)."""
    name = served_model_name or engine.model_name
    if allow_runtime_lora_updating and not lora_roots:
        raise ConfigError("--allow-runtime-lora-updating needs --lora-root DIR: the directories under which "
                          "/v1/load_lora_adapter may read adapters")
    adapters = LoRAAdapters(engine, name, bool(engine.config.lora.enable_lora), check_roots(lora_roots or ()),
                            max_runtime_loras)
    for module in lora_modules or ():
        try:
            adapters.add(module.name, module.path, module.base_model_name)
        except APIError as e:  # at start-up: a config error (serve prints it and exits)
            raise ConfigError(f"--lora-modules {module.name}: {e.message}") from None
    per_replica = ReplicaStatsCollector(engine, name) if isinstance(engine, ReplicatedEngine) else None
    metrics = ServerMetrics(engine, name, per_replica)
    s = build_server(engine, name, max_body_bytes, metrics, sse_ping_interval=sse_ping_interval,
                     trust_request_chat_template=trust_request_chat_template, tool_config=tool_config,
                     limits=limits, reasoning_parser=reasoning_parser, other_names=other_names,
                     adapters=adapters, enable_prompt_tokens_details=enable_prompt_tokens_details,
                     show_model_paths=show_model_paths)
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
        Route("/openapi.json", openapi_route(engine, name, api_key, max_body_bytes,
                                             trust_request_chat_template, s.checks.limits,
                                             allow_runtime_lora_updating, trusted_hosts is not None),
              methods=["GET"]),
    ]
    if allow_runtime_lora_updating:  # else absent, as vLLM's without VLLM_ALLOW_RUNTIME_LORA_UPDATING
        routes += [Route("/v1/load_lora_adapter", _wrap(partial(adapters.load_route, checks=s.checks)),
                         methods=["POST"]),
                   Route("/v1/unload_lora_adapter", _wrap(partial(adapters.unload_route, checks=s.checks)),
                         methods=["POST"])]
    if chat_page:
        routes += chat_page_routes()
    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={HTTPException: _http_exception, Exception: _unexpected})
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    if trusted_hosts is not None:  # before the API key is asked; its 400s are counted
        app.add_middleware(HostCheckMiddleware, hosts=trusted_hosts)
    app.add_middleware(HTTPErrorCounter, metrics=metrics)  # sees 401s too
    if allowed_origins:  # browsers' preflight (OPTIONS) is answered before the API key is asked
        app.add_middleware(CORSMiddleware, allow_origins=allowed_origins, allow_methods=["*"],
                           allow_headers=["*"], expose_headers=["X-Request-Id"])
    app.add_middleware(RequestIdMiddleware)  # outermost: every response carries X-Request-Id
    app.state.metrics = metrics
    app.state.server = s
    return app
