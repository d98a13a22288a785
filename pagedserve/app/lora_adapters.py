"""The LoRA adapters the server serves by name (vLLM's --lora-modules and its runtime routes).

A request picks an adapter by its ``model`` field; ``/v1/models`` lists each adapter with
``parent`` = the base model. ``POST /v1/load_lora_adapter`` / ``/v1/unload_lora_adapter``
(``{"lora_name", "lora_path"}``) exist only with --allow-runtime-lora-updating (app/server.py) (vLLM's
VLLM_ALLOW_RUNTIME_LORA_UPDATING) and sit under /v1, so --api-key guards them. An adapter is
checked by the engine when it is added (a bad --lora-modules entry is a start-up error naming
what is wrong).

A runtime load names a path the server then reads, so it is held to more (issue 37): its real path
(symbolic links resolved) must lie under a --lora-root, its files must not be symbolic links, and
every refused path gets one and the same 400 (the reason goes to the server log, escaped): the API
tells no one whether a path exists, is a directory, is readable, or what its files hold. At most
--max-runtime-loras adapters are loaded at run time; the operator's --lora-modules cannot be
unloaded through the API. An adapter is held from the moment a request resolves its name until
that request's handler has handed it to the engine (``request_scope``), and the engine counts it
from then on, so an unload that would pull it from under a request is refused (409).
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
from collections import Counter
from collections.abc import Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from pagedserve.app.errors import APIError
from pagedserve.contracts.config import ConfigError
from pagedserve.contracts.lora import CONFIG_FILE, WEIGHTS_FILE, LoRAAdapterError, open_regular
from pagedserve.engine.client import EngineClient
from pagedserve.engine.errors import RequestRejectedError
from pagedserve.engine.lora_request import LoRARequest

logger = logging.getLogger(__name__)

BODY_LIMIT = 64 << 10  # a runtime LoRA route's body: a name and a path
DEFAULT_MAX_RUNTIME_LORAS = 128
# The one answer to every lora_path a runtime load refuses (no oracle of the file system).
PATH_REFUSED = ("lora_path cannot be loaded: it must name a PEFT LoRA adapter directory under a --lora-root "
                "(adapter_config.json and adapter_model.safetensors, no symbolic links), readable by the "
                "server and fit for the base model; the server log says which rule it broke")

# The adapters the current request resolved (set per request by ``request_scope``): (registry, id).
_held: ContextVar[list[tuple["LoRAAdapters", int]] | None] = ContextVar("lora_held", default=None)


@contextlib.contextmanager
def request_scope() -> Iterator[None]:
    """Around one request's handler: the adapters it resolves stay held (not unloadable) until it
    returns; by then any engine request it made counts them itself."""
    token = _held.set([])
    try:
        yield
    finally:
        held = _held.get() or []
        _held.reset(token)
        for adapters, lora_int_id in held:
            adapters.release(lora_int_id)


def for_log(text: str, limit: int = 300) -> str:
    """``text`` as a log may hold it: repr (newlines and control characters escaped, so a caller's
    string cannot forge log lines) and at most ``limit`` characters of it."""
    return repr(text[:limit]) + (f"... ({len(text)} characters)" if len(text) > limit else "")


def check_roots(roots: Sequence[str]) -> tuple[str, ...]:
    """The real paths of the --lora-root directories; ConfigError for one that is not a directory."""
    out = []
    for root in roots:
        real = os.path.realpath(root)
        if not os.path.isdir(real):
            raise ConfigError(f"--lora-root {root!r} is not a directory")
        out.append(real)
    return tuple(dict.fromkeys(out))


def confine(path: str, roots: Sequence[str]) -> str:
    """The real path of the adapter directory ``path`` if it lies under one of ``roots`` (real paths)
    and its two files are regular files, not symbolic links; LoRAAdapterError saying why otherwise
    (for the log only: the caller gets PATH_REFUSED)."""
    try:
        real = os.path.realpath(path)
    except (OSError, ValueError) as e:
        raise LoRAAdapterError(f"cannot resolve it: {e}") from None
    if not any(os.path.commonpath([real, root]) == root for root in roots):
        raise LoRAAdapterError(f"its real path {real!r} is under no --lora-root")
    try:
        if not os.path.isdir(real):
            raise LoRAAdapterError(f"{real!r} is not a directory")
        for name in (CONFIG_FILE, WEIGHTS_FILE):
            f, _ = open_regular(os.path.join(real, name), follow_symlinks=False)
            f.close()
    except (OSError, ValueError) as e:
        raise LoRAAdapterError(str(e)) from None
    return real


@dataclass(frozen=True, slots=True)
class LoRAModule:
    """One --lora-modules entry."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(text: str) -> LoRAModule:
    """``name=path`` or vLLM's JSON form ``{"name": ..., "path": ..., "base_model_name": ...}``."""
    text = text.strip()
    if text.startswith("{"):
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--lora-modules {text!r}: not valid JSON ({e})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not isinstance(obj.get("path"), str):
            raise ConfigError(f"--lora-modules {text!r}: the JSON form needs string fields \"name\" and \"path\"")
        unknown = set(obj) - {"name", "path", "base_model_name"}
        if unknown:
            raise ConfigError(f"--lora-modules {text!r}: unknown field(s) {', '.join(sorted(unknown))}")
        return LoRAModule(obj["name"], obj["path"], obj.get("base_model_name"))
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ConfigError(f"--lora-modules {text!r}: give name=path or a JSON object")
    return LoRAModule(name, path)


class LoRAAdapters:
    def __init__(self, engine: EngineClient, base_name: str, enabled: bool, roots: Sequence[str] = (),
                 max_runtime_loras: int = DEFAULT_MAX_RUNTIME_LORAS):
        """``roots``: real paths of the --lora-root directories runtime loads read under
        (``check_roots``); ``max_runtime_loras``: adapters runtime loads may add."""
        self.engine = engine
        self.base_name = base_name
        self.enabled = enabled
        self.roots = tuple(roots)
        self.max_runtime_loras = max_runtime_loras
        self.by_name: dict[str, LoRARequest] = {}
        self.pinned: set[str] = set()  # --lora-modules: not unloadable through the API
        self.held: Counter[int] = Counter()  # adapter id -> requests that resolved it, not yet in the engine
        self._ids = itertools.count(1)

    def add(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        """Serve the adapter at ``path`` as ``name`` (start-up, --lora-modules: reads its files here,
        anywhere the operator says); APIError 400 when it cannot serve."""
        lora = self._new(name, path, base_model_name)
        self._check(lora)
        self._keep(lora)
        self.pinned.add(name)
        return lora

    def _new(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        self._check_name(name)
        return LoRARequest(name, next(self._ids), path, base_model_name)

    def _check_name(self, name: str) -> None:
        if not self.enabled:
            raise APIError.bad_request("LoRA adapters need a server started with --enable-lora", param="lora_name")
        if name == self.base_name:
            raise APIError.bad_request(f"the name {name!r} is the base model's", param="lora_name")
        if name in self.by_name:
            raise APIError.bad_request(f"The lora adapter '{name}' has already been loaded.", param="lora_name")

    def _check(self, lora: LoRARequest) -> None:
        try:
            self.engine.check_lora(lora)  # reads the adapter's config and safetensors header
        except RequestRejectedError as e:
            raise APIError.bad_request(str(e), param="lora_path") from None

    def _check_runtime_room(self, name: str) -> None:
        if len(self.by_name) - len(self.pinned) >= self.max_runtime_loras:
            raise APIError.bad_request(
                f"cannot load the lora adapter '{name}': {self.max_runtime_loras} adapters are already loaded at "
                f"run time (--max-runtime-loras); unload one first", param="lora_name", code="too_many_adapters")

    def _check_runtime(self, name: str, path: str) -> LoRARequest:
        """A runtime load's adapter, read under the roots (off the event loop); APIError 400 with
        PATH_REFUSED for every path it refuses, the reason logged (repr: a path's newlines stay
        escaped)."""
        try:
            real = confine(path, self.roots)
            lora = LoRARequest(name, next(self._ids), real)
            self.engine.check_lora(lora)
        except (LoRAAdapterError, RequestRejectedError, ValueError, OSError) as e:
            logger.warning("runtime load of LoRA adapter %s refused: lora_path %s: %s", for_log(name),
                           for_log(path), for_log(str(e), 1000))
            raise APIError.bad_request(PATH_REFUSED, param="lora_path", code="lora_path_refused") from None
        return lora

    def _keep(self, lora: LoRARequest) -> LoRARequest:
        if lora.lora_name in self.by_name:  # a concurrent load of the same name won
            raise APIError.bad_request(f"The lora adapter '{lora.lora_name}' has already been loaded.",
                                       param="lora_name")
        self.by_name[lora.lora_name] = lora
        return lora

    def resolve(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's ``model`` names; None for the base model (or no name). Inside a
        ``request_scope`` the adapter is held until the scope ends."""
        if model is None or model == self.base_name:
            return None
        lora = self.by_name.get(model)
        if lora is None:
            raise APIError.model_not_found(model)
        held = _held.get()
        if held is not None:
            self.held[lora.lora_int_id] += 1
            held.append((self, lora.lora_int_id))
        return lora

    def release(self, lora_int_id: int) -> None:
        self.held[lora_int_id] -= 1
        if self.held[lora_int_id] <= 0:
            del self.held[lora_int_id]

    def cards(self, show_paths: bool = False) -> list[tuple[str, str]]:
        """(name, root) of each adapter, in load order: root is the name, or the path with
        ``show_paths`` (--show-model-paths)."""
        return [(lora.lora_name, lora.lora_path if show_paths else lora.lora_name) for lora in self.by_name.values()]

    @staticmethod
    async def _body(request: Request, need_path: bool, checks) -> tuple[str, str | None]:
        """(lora_name, lora_path) of a runtime route's body, read up to BODY_LIMIT bytes (413 past it)."""
        data = await checks.read_json(request, BODY_LIMIT, f"{BODY_LIMIT} bytes for the LoRA routes")
        if not isinstance(data, dict):
            raise APIError.bad_request('send a JSON object {"lora_name": ..., "lora_path": ...}')
        name, path = data.get("lora_name"), data.get("lora_path")
        if not isinstance(name, str) or not name:
            raise APIError.bad_request("lora_name (a non-empty string) is required", param="lora_name")
        if need_path and (not isinstance(path, str) or not path):
            raise APIError.bad_request("lora_path (a PEFT adapter directory) is required", param="lora_path")
        return name, path

    async def load_route(self, request: Request, checks) -> Response:
        """Reads the adapter's files off the event loop: a slow disk holds this request only."""
        name, path = await self._body(request, True, checks)
        self._check_name(name)  # before any path is looked at
        self._check_runtime_room(name)
        lora = await asyncio.to_thread(self._check_runtime, name, path)
        self._check_runtime_room(name)  # concurrent loads
        self._keep(lora)
        logger.info("loaded LoRA adapter %s from %s", for_log(name), for_log(lora.lora_path))
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_route(self, request: Request, checks) -> Response:
        name, _ = await self._body(request, False, checks)
        lora = self.by_name.get(name)
        if lora is None:
            raise APIError(404, f"The lora adapter '{name}' cannot be found.", "invalid_request_error",
                           "lora_name", "model_not_found")
        if name in self.pinned:
            raise APIError.bad_request(f"The lora adapter '{name}' was loaded at start-up (--lora-modules) and "
                                       f"cannot be unloaded through the API.", param="lora_name",
                                       code="adapter_pinned")
        in_use = self.held[lora.lora_int_id] + self.engine.lora_requests_in_use(lora.lora_int_id)
        if in_use:
            raise APIError(409, f"The lora adapter '{name}' is in use by {in_use} request(s); unload it "
                                f"when they have finished.", "invalid_request_error", "lora_name", "adapter_in_use")
        del self.by_name[name]
        self.engine.forget_lora(lora.lora_int_id)
        logger.info("unloaded LoRA adapter %s", for_log(name))
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
