"""The LoRA adapters the server serves by name (vLLM's --lora-modules and its runtime routes).

A request picks an adapter by its ``model`` field; ``/v1/models`` lists each adapter with
``parent`` = the base model. ``POST /v1/load_lora_adapter`` / ``/v1/unload_lora_adapter``
(``{"lora_name", "lora_path"}``) exist only with --allow-runtime-lora-updating (app/server.py) (vLLM's
VLLM_ALLOW_RUNTIME_LORA_UPDATING) and sit under /v1, so --api-key guards them. An adapter is
checked by the engine when it is added (a bad one is a 400 naming what is wrong, or a start-up
error); unloading one that requests still use is refused (409), so running requests never lose
their weights.
"""
from __future__ import annotations

import asyncio
import itertools
import json
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from app.errors import APIError
from contracts.config import ConfigError
from engine.client import EngineClient
from engine.errors import RequestRejectedError
from engine.lora_request import LoRARequest

BODY_LIMIT = 64 << 10  # a runtime LoRA route's body: a name and a path


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
    def __init__(self, engine: EngineClient, base_name: str, enabled: bool):
        self.engine = engine
        self.base_name = base_name
        self.enabled = enabled
        self.by_name: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)

    def add(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        """Serve the adapter at ``path`` as ``name`` (start-up: reads its files here); APIError 400
        when it cannot serve."""
        lora = self._new(name, path, base_model_name)
        self._check(lora)
        return self._keep(lora)

    def _new(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        if not self.enabled:
            raise APIError.bad_request("LoRA adapters need a server started with --enable-lora", param="lora_name")
        if name == self.base_name:
            raise APIError.bad_request(f"the name {name!r} is the base model's", param="lora_name")
        if name in self.by_name:
            raise APIError.bad_request(f"The lora adapter '{name}' has already been loaded.", param="lora_name")
        return LoRARequest(name, next(self._ids), path, base_model_name)

    def _check(self, lora: LoRARequest) -> None:
        try:
            self.engine.check_lora(lora)  # reads the adapter's config and safetensors header
        except RequestRejectedError as e:
            raise APIError.bad_request(str(e), param="lora_path") from None

    def _keep(self, lora: LoRARequest) -> LoRARequest:
        if lora.lora_name in self.by_name:  # a concurrent load of the same name won
            raise APIError.bad_request(f"The lora adapter '{lora.lora_name}' has already been loaded.",
                                       param="lora_name")
        self.by_name[lora.lora_name] = lora
        return lora

    def resolve(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's ``model`` names; None for the base model (or no name)."""
        if model is None or model == self.base_name:
            return None
        lora = self.by_name.get(model)
        if lora is None:
            raise APIError.model_not_found(model)
        return lora

    def cards(self) -> list[tuple[str, str]]:
        """(name, path) of each adapter, in load order."""
        return [(lora.lora_name, lora.lora_path) for lora in self.by_name.values()]

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
        lora = self._new(name, path)
        await asyncio.to_thread(self._check, lora)
        self._keep(lora)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_route(self, request: Request, checks) -> Response:
        name, _ = await self._body(request, False, checks)
        lora = self.by_name.get(name)
        if lora is None:
            raise APIError(404, f"The lora adapter '{name}' cannot be found.", "invalid_request_error",
                           "lora_name", "model_not_found")
        in_use = self.engine.lora_requests_in_use(lora.lora_int_id)
        if in_use:
            raise APIError(409, f"The lora adapter '{name}' is in use by {in_use} request(s); unload it "
                                f"when they have finished.", "invalid_request_error", "lora_name", "adapter_in_use")
        del self.by_name[name]
        self.engine.forget_lora(lora.lora_int_id)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
