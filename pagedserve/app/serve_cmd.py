"""`pagedserve serve`: the OpenAI-compatible server (uvicorn + uvloop + httptools).

The model runs in worker processes (`--executor mp`, the default here) so the event loop only
schedules and streams.

The listening socket is bound first, before the engine loads: a busy port fails in a
second with one clear line and exit code 1, not after a full model load.

Shutdown on SIGTERM/SIGINT: uvicorn stops accepting, in-flight requests get up to
--shutdown-timeout seconds to finish, the rest are cancelled (their engine requests aborted),
then the engine stops and the process exits 0.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket

from pagedserve.app.admission import AdmissionLimits
from pagedserve.app.engine_args import add_engine_args, engine_config_from_args, flag
from pagedserve.app.listen import ListenError, bind_socket
from pagedserve.app.server_config import ServerConfig, server_option_default
from pagedserve.app.vllm_flags import add_refused_vllm_flags
from pagedserve.app.reasoning.parser import REASONING_PARSERS
from pagedserve.app.tools.parsers import AUTO_PARSERS
from pagedserve.contracts import env
from pagedserve.contracts.config import ConfigError
from pagedserve.contracts.error_text import error_summary
from pagedserve.contracts.errors import ExecutorError
from pagedserve.contracts.errors import ModelLoadError
from pagedserve.contracts.log_format import LOG_FORMATS, configure_logging

logger = logging.getLogger("pagedserve.serve")

STARTUP_ERRORS = (ConfigError, ModelLoadError, ExecutorError)
DEFAULT_EXECUTOR = "mp"  # model compute in worker processes: the event loop stays free
# Online, the time to first token counts: a step takes new prompts up to this many prompt tokens
# (contracts/config.py SchedulerConfig.prompt_admit_tokens says what it buys and costs).
SERVE_PROMPT_ADMIT_TOKENS = 256


def _lora_module_arg(text: str):
    from pagedserve.app.lora_adapters import parse_lora_module

    try:
        return parse_lora_module(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_tag", nargs="?", metavar="MODEL",
                        help="the model, as --model (vLLM's `serve MODEL`): a GGUF file, an HF directory, or "
                             "a Hugging Face id (org/name, org/name:Q4_K_M, org/name/FILE.gguf), downloaded unless cached")
    add_engine_args(parser)
    parser.set_defaults(prompt_admit_tokens=SERVE_PROMPT_ADMIT_TOKENS)
    g = parser.add_argument_group("server")
    parser.set_defaults(other_served_names=())
    flag(g, "--served-model-name", nargs="+", action=_ServedNames,
         help="the names the API answers to; responses carry the first (default: the model id, file or "
              "directory name)")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=env.API_KEY.get(),
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $PAGEDSERVE_API_KEY)")
    flag(g, "--max-waiting-requests", type=int,
         help="past this many waiting requests, new ones get 503 + Retry-After")
    g.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="engine replicas (each its own workers and KV cache, the CPUs split between "
                        "them) behind this one server; a router sends each request to the least "
                        "loaded replica, or to one holding its prompt prefix in cache")
    flag(g, "--restart-workers", action="store_true",
         help="after a worker dies or hangs, fail the in-flight requests and start a fresh "
              "worker pool (503 + Retry-After meanwhile) instead of staying dead")
    g.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests may take to finish after SIGTERM/SIGINT")
    g.add_argument("--max-body-bytes", type=int, default=server_option_default("max_body_bytes"),
                   help="larger request bodies get 413")
    g.add_argument("--header-timeout", type=float, default=30.0,
                   help="seconds a connection may take to send a complete request line and headers; "
                        "later it gets 408 and is closed (slow-header / slowloris clients)")
    g.add_argument("--body-timeout", type=float, default=60.0,
                   help="seconds a request body may take to arrive after its headers; later it gets "
                        "408 and the connection is closed")
    g.add_argument("--lora-modules", nargs="+", default=[], type=_lora_module_arg, metavar="NAME=PATH",
                   help="LoRA adapters served by name (with --enable-lora): name=path, or vLLM's JSON "
                        '{"name": ..., "path": ..., "base_model_name": ...}')
    g.add_argument("--allow-runtime-lora-updating", action="store_true",
                   help="answer POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's "
                        "VLLM_ALLOW_RUNTIME_LORA_UPDATING; behind --api-key like every /v1 route); needs "
                        "--lora-root")
    g.add_argument("--lora-root", action=_PathList, default=[], metavar="DIR",
                   help="a directory under which /v1/load_lora_adapter may read adapters (repeat the flag or "
                        "give a comma-separated list): a lora_path whose real path lies under none, or whose "
                        "files are symbolic links, is refused, every refusal with the same message (the "
                        "reason goes to the log). --lora-modules may name any path")
    g.add_argument("--max-runtime-loras", type=int, default=server_option_default("max_runtime_loras"),
                   help="adapters /v1/load_lora_adapter may load (besides --lora-modules); past it a load gets "
                        "400 until one is unloaded (default: %(default)s)")
    g.add_argument("--show-model-paths", action="store_true",
                   help="GET /v1/models shows the model's and the adapters' paths as `root` (as vLLM does); "
                        "by default `root` is the served name")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='allow tool_choice "auto" (the default when a request has tools): tools go into '
                        "the prompt and the reply is parsed for calls; without it such requests get 400")
    g.add_argument("--tool-call-parser", default=None, choices=sorted(AUTO_PARSERS),
                   help="format of the model's tool calls for tool_choice auto (default: from the chat "
                        "template; hermes = <tool_call>{...}</tool_call>, also the default tool prompt's)")
    g.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                   help="split the reply's <think>...</think> into message.reasoning_content (and "
                        "reasoning), streamed as delta.reasoning_content; tool calls and content come "
                        "from the answer after it. deepseek_r1: the reply starts inside the thinking; "
                        "qwen3: only a reply that opens with <think> and closes it has reasoning")
    g.add_argument("--sse-ping-interval", type=float, default=server_option_default("sse_ping_interval"),
                   help="seconds between ': ping' comments on streams, for proxies that cut idle "
                        "connections; 0 (default) = none, as OpenAI and vLLM (`vllm bench serve` "
                        "loses events after a comment)")
    g.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="usage tells how many prompt tokens the prefix cache served (vLLM's: "
                        "prompt_tokens_details.cached_tokens on chat and completions, cached_tokens on "
                        "/v1/responses for every request); off, only a request with a cache_salt learns "
                        "it (/v1/responses), since a hit tells a caller someone sent that prefix before")
    g.add_argument("--trust-request-chat-template", action="store_true",
                   help="allow a request's own chat_template (a Jinja template the server renders); "
                        "without it such requests get 400, as in vLLM")
    g.add_argument("--allowed-origins", type=_origins, default=None,
                   help="CORS: the origins browsers may call the API from, as a JSON list or comma-separated "
                        '(["*"] = any); without it no CORS headers are sent')
    g.add_argument("--allowed-hosts", type=_origins, default=None,
                   help="the Host header names served, as a JSON list or comma-separated (exact, "
                        "'*.example.com', or '*' = any). Without --api-key only the --host address, "
                        "localhost and these are served (any IP literal too when bound to 0.0.0.0 / ::), "
                        "others get 400: a web page cannot reach this server by DNS rebinding. With "
                        "--api-key every host is served unless this flag is given")
    g.add_argument("--disable-chat-page", dest="chat_page", action="store_false",
                   default=server_option_default("chat_page"),
                   help="GET / does not serve the chat page (a page in the browser that streams from "
                        "/v1/chat/completions; with --api-key the key is typed into it); GET / is a 404")
    g.add_argument("--ssl-keyfile", default=None, help="serve HTTPS with this private key (PEM) ...")
    g.add_argument("--ssl-certfile", default=None, help="... and this certificate chain (PEM)")
    g.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])
    g.add_argument("--log-format", default="text", choices=LOG_FORMATS,
                   help="text, or json: one JSON object per line (time, level, logger, message, and "
                        "request_id where a line concerns a request), the worker processes' lines too")
    g.add_argument("--disable-access-log", "--disable-uvicorn-access-log", dest="access_log",
                   action="store_false", default=server_option_default("access_log"),
                   help="no access log (by default one INFO line per HTTP request: method, path, status, "
                        "duration, request id, client; never a body or a key)")
    AdmissionLimits.add_arguments(parser)
    add_refused_vllm_flags(parser)


class _PathList(argparse.Action):
    """A repeatable flag whose values may also be comma-separated lists: all of them, in order."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        items = list(getattr(namespace, self.dest) or [])
        items += [v.strip() for v in values.split(",") if v.strip()]
        setattr(namespace, self.dest, items)


def _origins(value: str) -> list[str]:
    import json

    if value.lstrip().startswith("["):
        try:
            origins = json.loads(value)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"not a JSON list: {e}") from None
        if not isinstance(origins, list) or not all(isinstance(o, str) for o in origins):
            raise argparse.ArgumentTypeError("a JSON list of origin strings")
        return origins
    return [o.strip() for o in value.split(",") if o.strip()]


class _ServedNames(argparse.Action):
    """--served-model-name A B ...: A is the engine's served name (responses carry it), the others
    are further names requests may use (``other_served_names``)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, values[0])
        namespace.other_served_names = tuple(n for n in dict.fromkeys(values) if n != values[0])


def take_model(args: argparse.Namespace) -> None:
    """The positional MODEL is --model."""
    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise ConfigError(f"the model is given twice: {args.model_tag!r} and --model {args.model!r}")
        args.model = args.model_tag


def check_ssl(args: argparse.Namespace) -> None:
    if (args.ssl_keyfile is None) != (args.ssl_certfile is None):
        raise ConfigError("HTTPS needs both --ssl-keyfile and --ssl-certfile")
    for name in ("ssl_keyfile", "ssl_certfile"):
        path = getattr(args, name)
        if path is not None and not os.path.isfile(path):
            raise ConfigError(f"--{name.replace('_', '-')} {path!r}: no such file")


def check_access(args: argparse.Namespace) -> None:
    """Who may reach the API: ``args.trusted_hosts`` from --host, --api-key and --allowed-hosts
    (app/trusted_host.py); what a runtime LoRA load may read (--lora-root)."""
    from pagedserve.app.lora_adapters import check_roots
    from pagedserve.app.trusted_host import TrustedHosts

    if args.allow_runtime_lora_updating and not args.lora_root:
        raise ConfigError("--allow-runtime-lora-updating needs --lora-root DIR: the directories under which "
                          "/v1/load_lora_adapter may read adapters")
    check_roots(args.lora_root)  # each a directory, before any model is loaded
    if args.max_runtime_loras < 0:
        raise ConfigError(f"--max-runtime-loras must be at least 0, got {args.max_runtime_loras}")
    try:
        args.trusted_hosts = TrustedHosts.for_server(args.host, args.api_key, args.allowed_hosts)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def run(args: argparse.Namespace) -> int:
    configure_logging(args.log_level, args.log_format)
    try:
        take_model(args)
        check_ssl(args)
        check_access(args)
    except ConfigError as e:
        logger.error("cannot start: %s", e)
        return 1
    try:
        sock = bind_socket(args.host, args.port)
    except ListenError as e:
        logger.error("%s", e)
        return 1
    with sock:
        try:
            config = engine_config_from_args(args, default_executor=DEFAULT_EXECUTOR)
        except ConfigError as e:
            logger.error("cannot start: %s", e)
            return 1
        if args.lora_modules and not config.lora.enable_lora:
            logger.error("cannot start: --lora-modules needs --enable-lora")
            return 1
        try:
            limits = AdmissionLimits.from_args(args)
        except ValueError as e:
            logger.error("cannot start: %s", e)
            return 1
        try:
            from pagedserve.engine.replicas import check_data_parallel

            check_data_parallel(config, args.data_parallel_size)
        except ConfigError as e:
            logger.error("cannot start: %s", e)
            return 1
        # uvicorn's loop="uvloop", without importing uvicorn before the workers are started.
        import uvloop

        runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
        try:
            with runner:
                return runner.run(_serve(args, config, sock, limits))
        except STARTUP_ERRORS as e:
            # What the user asked for cannot be served (no such model, a bad config, workers
            # that fail to load it): one line that says so, not a traceback.
            logger.error("cannot start: %s", error_summary(str(e)))
            return 1


async def _serve(args: argparse.Namespace, config, sock: socket.socket,
                 limits: AdmissionLimits | None = None) -> int:
    from pagedserve.engine.async_engine import AsyncEngine

    # The engine starts first: its worker spends seconds importing torch and loading weights,
    # and the HTTP side is imported meanwhile (sleep(0) lets start() hand its work to a thread).
    if args.data_parallel_size > 1:
        from pagedserve.engine.replicas import ReplicatedEngine

        engine = ReplicatedEngine(config, args.data_parallel_size)
    else:
        engine = AsyncEngine(config)
    starting = asyncio.ensure_future(engine.start())
    await asyncio.sleep(0)
    try:
        import uvicorn
        from sse_starlette.sse import AppStatus

        from pagedserve.app.http_protocol import with_read_timeouts
        from pagedserve.app.server import build_app

        # In-flight streams must run to completion on shutdown (up to --shutdown-timeout), not be
        # cut the moment the signal arrives.
        AppStatus.disable_automatic_graceful_drain()
        uv_config = uvicorn.Config(
            "pagedserve.app.server:build_app",  # replaced below; uvicorn only needs a placeholder until load()
            host=args.host, port=sock.getsockname()[1], loop="uvloop",
            http=with_read_timeouts(args.header_timeout, args.body_timeout),
            lifespan="off", timeout_graceful_shutdown=args.shutdown_timeout,
            # uvicorn's lines through this process's formatter (configure_logging); its access log
            # off: app/access_log.py writes one with the duration and request id.
            log_config=None, log_level=args.log_level, access_log=False,
            ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile,
        )
    except BaseException:
        await asyncio.gather(starting, return_exceptions=True)
        await engine.shutdown()
        raise
    await starting
    try:
        app = build_app(engine, ServerConfig.from_args(args, served_model_name=engine.model_name, limits=limits,
                                                     trusted_hosts=args.trusted_hosts))
        uv_config.app = app
        app.state.metrics.loop_lag.start()  # pagedserve:event_loop_lag_seconds from the start
        num_blocks = engine.num_blocks
        block_size = config.cache.block_size
        port = sock.getsockname()[1]

        class Server(uvicorn.Server):
            async def startup(self, sockets=None) -> None:
                await super().startup(sockets)
                if self.started:
                    logger.info("serving %s on %s://%s:%d | KV cache %d blocks x %d = %d tokens | "
                                "max_model_len %d | ready", engine.model_name,
                                "https" if args.ssl_certfile else "http", args.host, port,
                                num_blocks, block_size, num_blocks * block_size, engine.max_model_len)

        server = Server(uv_config)
        # uvicorn re-raises the signal it caught once it has shut down; handlers that do nothing
        # make that harmless so the engine can stop cleanly and the process exit 0.
        previous = {sig: signal.signal(sig, _ignore) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            await server.serve(sockets=[sock])
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        if not server.started:
            logger.error("the HTTP server did not start on %s:%d (see the error above)",
                         args.host, port)
            return 1
        logger.info("HTTP server stopped; stopping the engine")
    finally:
        await engine.shutdown()
    logger.info("shutdown complete")
    return 0


def _ignore(signum, frame) -> None:
    pass
