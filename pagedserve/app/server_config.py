"""The HTTP server's options, once: one dataclass whose fields are the options (their defaults
written here only), built from `serve`'s flags through one table (``SERVER_OPTION_FLAGS``), as the
engine's options are (contracts/config.py ``OPTION_FIELDS``). ``build_app(engine, config)`` takes
it; the CLI flags take their defaults from it (``server_option_default``)."""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field

from pagedserve.app.admission import AdmissionLimits
from pagedserve.app.lora_adapters import DEFAULT_MAX_RUNTIME_LORAS, LoRAModule
from pagedserve.app.streaming import DEFAULT_SSE_PING_INTERVAL
from pagedserve.app.tools.plan import ToolConfig
from pagedserve.app.trusted_host import TrustedHosts

__all__ = ["DEFAULT_MAX_BODY_BYTES", "DEFAULT_SSE_PING_INTERVAL", "SERVER_OPTION_FLAGS", "ServerConfig",
           "server_option_default"]

DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """What one app serves and how (every field but ``tool_config``, ``limits`` and ``trusted_hosts``
    is one `serve` flag; those three are built from several)."""

    served_model_name: str | None = None  # None: the engine's model name
    api_key: str | None = None  # require 'Authorization: Bearer KEY' on /v1/*
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # larger bodies get 413
    sse_ping_interval: float = DEFAULT_SSE_PING_INTERVAL  # seconds between ': ping' comments; 0 = none
    trust_request_chat_template: bool = False  # render a request's own chat_template (else 400)
    tool_config: ToolConfig = field(default_factory=ToolConfig)  # --enable-auto-tool-choice, --tool-call-parser
    limits: AdmissionLimits = field(default_factory=AdmissionLimits)  # what one request may ask for
    reasoning_parser: str | None = None  # app/reasoning; None = off
    other_names: tuple[str, ...] = ()  # --served-model-name's names after the first
    allowed_origins: list[str] | None = None  # CORS; None = no CORS headers
    lora_modules: list[LoRAModule] | None = None  # adapters served by name from the start
    allow_runtime_lora_updating: bool = False  # the load / unload routes answer (needs lora_roots)
    enable_prompt_tokens_details: bool = False  # usage tells every caller its cached prompt tokens
    lora_roots: list[str] | None = None  # where /v1/load_lora_adapter may read adapters
    max_runtime_loras: int = DEFAULT_MAX_RUNTIME_LORAS  # adapters the load route may load
    show_model_paths: bool = False  # /v1/models shows paths as `root`
    trusted_hosts: TrustedHosts | None = None  # the Host headers answered; None = any
    chat_page: bool = True  # GET / serves the chat page (app/chat_page.py); --disable-chat-page: a 404
    access_log: bool = True  # one INFO line per HTTP request (app/access_log.py); --disable-access-log

    def __post_init__(self) -> None:  # None means "the default" for the objects built from flags
        if self.tool_config is None:
            object.__setattr__(self, "tool_config", ToolConfig())
        if self.limits is None:
            object.__setattr__(self, "limits", AdmissionLimits())

    @classmethod
    def from_args(cls, args: argparse.Namespace, **built) -> "ServerConfig":
        """From `serve`'s parsed flags (``SERVER_OPTION_FLAGS``); ``built``: fields made elsewhere
        (``limits``, ``trusted_hosts``; ``served_model_name``, which `serve` takes from the engine)
        or overridden."""
        values = {name: getattr(args, dest) for name, dest in SERVER_OPTION_FLAGS.items() if hasattr(args, dest)}
        if hasattr(args, "enable_auto_tool_choice"):
            values["tool_config"] = ToolConfig(args.enable_auto_tool_choice, getattr(args, "tool_call_parser", None))
        values.update(built)
        return cls(**values)


# The flag (argparse dest) of each field set by one flag; the others are built (``from_args``).
SERVER_OPTION_FLAGS = {
    "api_key": "api_key",
    "max_body_bytes": "max_body_bytes",
    "sse_ping_interval": "sse_ping_interval",
    "trust_request_chat_template": "trust_request_chat_template",
    "reasoning_parser": "reasoning_parser",
    "other_names": "other_served_names",
    "allowed_origins": "allowed_origins",
    "lora_modules": "lora_modules",
    "allow_runtime_lora_updating": "allow_runtime_lora_updating",
    "enable_prompt_tokens_details": "enable_prompt_tokens_details",
    "lora_roots": "lora_root",
    "max_runtime_loras": "max_runtime_loras",
    "show_model_paths": "show_model_paths",
    "chat_page": "chat_page",  # --disable-chat-page
    "access_log": "access_log",  # --disable-access-log, --disable-uvicorn-access-log (vLLM's)
}


def server_option_default(name: str):
    """The default of a server option (its ServerConfig field's)."""
    f = next(f for f in dataclasses.fields(ServerConfig) if f.name == name)
    return f.default_factory() if f.default is dataclasses.MISSING else f.default
