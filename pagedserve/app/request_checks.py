"""The request checks every route family shares: the body reader with its size limit, the
model-name check, context-length arithmetic and token-id range checks."""
from __future__ import annotations

from typing import Any

import orjson
from starlette.requests import Request

from pagedserve.app.admission import AdmissionLimits, check_body
from pagedserve.app.errors import APIError
from pagedserve.app.lora_adapters import LoRAAdapters
from pagedserve.app.prompt_options import fit_text
from pagedserve.engine.client import EngineClient
from pagedserve.engine.lora_request import LoRARequest


def is_json_media_type(content_type: str | None) -> bool:
    """Whether a Content-Type header names JSON (``application/json``, any parameters, any case)."""
    return content_type is not None and content_type.split(";", 1)[0].strip().lower() == "application/json"


class RequestChecks:
    """What a request may be, against this engine, the served name and the admission bounds
    (``limits``, app/admission.py)."""

    def __init__(self, engine: EngineClient, served_model_name: str, max_body_bytes: int,
                 limits: AdmissionLimits, other_names: tuple[str, ...] = (),
                 adapters: LoRAAdapters | None = None) -> None:
        self.engine = engine
        self.model_name = served_model_name
        # --served-model-name's further names: requests may name the model by any (vLLM)
        self.model_names = (served_model_name, *other_names)
        self.max_body_bytes = max_body_bytes
        self.limits = limits
        self.adapters = adapters if adapters is not None else LoRAAdapters(engine, served_model_name, False)

    async def read_json(self, request: Request, limit: int | None = None,
                        flag: str = "--max-body-bytes") -> Any:
        """The decoded body; past ``limit`` bytes (default --max-body-bytes) a 413 naming ``flag``,
        before the rest is read. A body that is not ``application/json`` is a 415 before anything
        is read: a web page can send text/plain, form data or an untyped body to this server
        without a CORS preflight, never JSON (issue 37)."""
        if not is_json_media_type(request.headers.get("content-type")):
            raise APIError.unsupported_media_type()
        if limit is None or limit >= self.max_body_bytes:
            limit, flag = self.max_body_bytes, "--max-body-bytes"
        length = request.headers.get("content-length")
        if length is not None:
            try:
                if int(length) > limit:
                    raise APIError.too_large(limit, flag)
            except ValueError:
                raise APIError.bad_request("invalid Content-Length header") from None
        chunks: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise APIError.too_large(limit, flag)
            chunks.append(chunk)
        body = b"".join(chunks)
        if not body:
            raise APIError.bad_request("the request body is empty; send a JSON object")
        try:
            return orjson.loads(body)
        except orjson.JSONDecodeError as e:
            raise APIError.bad_request(f"the request body is not valid JSON: {e}") from None

    async def read_admitted(self, request: Request, kind: str) -> Any:
        """The body of a ``kind`` request (completions, chat, tokenize) within the admission
        bounds (app/admission.py), checked before validation builds anything of it."""
        if kind == "tokenize":
            data = await self.read_json(request, self.limits.max_tokenize_body_bytes,
                                        "--max-tokenize-body-bytes")
        else:
            data = await self.read_json(request)
        check_body(kind, data, self.limits, self.engine.tokenizer.vocab_size, self.engine.max_model_len)
        return data

    def fit_text(self, text: str, param: str, keep: int | None = None, which: str = "the prompt") -> str:
        """A text prompt bounded before it is tokenized (app/prompt_options.fit_text): a 400 when
        it cannot fit the context, its end only when ``keep`` (truncate_prompt_tokens) is set."""
        return fit_text(text, param, self.engine.tokenizer.max_token_chars,
                        self.engine.max_model_len, keep, which)

    def check_model(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter ``model`` names (None: the base model, by any of its served names); 404
        for an unknown name."""
        if model is None or model in self.model_names:
            return None
        return self.adapters.resolve(model)

    def check_base_model(self, model: str | None, what: str) -> None:
        """Routes the adapters do not serve (embeddings): the base model's name only."""
        if self.check_model(model) is not None:
            raise APIError.bad_request(f"{what} come from the base model {self.model_name!r}, not from a LoRA "
                                       f"adapter", param="model")

    def max_tokens_for(self, prompt_len: int, requested: int | None, default: int | None) -> int:
        ctx = self.engine.max_model_len
        if prompt_len >= ctx:
            raise APIError.bad_request(
                f"This model's maximum context length is {ctx} tokens. However, your prompt has "
                f"{prompt_len} tokens, which leaves no room for the completion. Please shorten the "
                "prompt.", param="prompt", code="context_length_exceeded")
        room = ctx - prompt_len
        if requested is not None:
            if requested > room:
                raise APIError.bad_request(
                    f"This model's maximum context length is {ctx} tokens. However, you requested "
                    f"{prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} for "
                    "the completion). Please reduce the prompt or the completion length.",
                    param="max_tokens", code="context_length_exceeded")
            return requested
        return room if default is None else min(default, room)

    def check_ids(self, ids: list[int], param: str) -> list[int]:
        vocab = self.engine.tokenizer.vocab_size
        for t in ids:
            if t < 0 or t >= vocab:
                raise APIError.bad_request(f"token id {t} is out of range: ids must be in [0, {vocab})",
                                           param=param)
        return ids
