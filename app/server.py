"""Starlette app: the OpenAI-compatible routes in front of an AsyncEngine.

A request with several prompts or ``n > 1`` fans out to one engine request per choice
(choice index = prompt_idx * n + i) whose delta streams are merged. Every error leaves as an
OpenAI-format body; a stream that fails midway sends one error event, then ``[DONE]``.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from app.auth import APIKeyMiddleware
from app.errors import APIError, to_api_error
from app.metrics import HTTPErrorCounter, RequestTracker, ServerMetrics
from app.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    parse,
)
from app.streaming import close_all, merge_async_iterators, sse_response

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


class ORJSONResponse(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


def error_response(err: APIError) -> ORJSONResponse:
    return ORJSONResponse(err.body(), status_code=err.status, headers=err.headers)


class ClientDisconnected(Exception):
    """The client went away before a non-streaming response was ready."""


def _version() -> str:
    try:
        import importlib.metadata

        return importlib.metadata.version("pagedserve")
    except Exception:  # not installed (running from a checkout)
        return "0.1.0"


@dataclass(slots=True)
class Choice:
    """One engine request = one choice of the response."""

    index: int
    prompt_idx: int
    sample_idx: int
    request_id: str
    prompt_ids: list[int]
    prompt_text: str | None
    params: Any
    tracker: RequestTracker
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] = field(default_factory=list)
    prompt_logprobs: Any = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    text_offset: int = 0  # completions logprobs: characters emitted so far (streaming)
    started: bool = False


class OpenAIServer:
    def __init__(self, engine: Any, served_model_name: str, max_body_bytes: int,
                 metrics: ServerMetrics) -> None:
        self.engine = engine
        self.model_name = served_model_name
        self.max_body_bytes = max_body_bytes
        self.metrics = metrics
        self.created = int(time.time())
        self._token_text_cache: dict[int, str] = {}
        from engine.sampling_params import SamplingParams

        self._sampling_params_cls = SamplingParams

    # ---- plumbing -----------------------------------------------------------------------

    async def read_json(self, request: Request) -> Any:
        limit = self.max_body_bytes
        length = request.headers.get("content-length")
        if length is not None:
            try:
                if int(length) > limit:
                    raise APIError.too_large(limit)
            except ValueError:
                raise APIError.bad_request("invalid Content-Length header") from None
        chunks: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise APIError.too_large(limit)
            chunks.append(chunk)
        body = b"".join(chunks)
        if not body:
            raise APIError.bad_request("the request body is empty; send a JSON object")
        try:
            return orjson.loads(body)
        except orjson.JSONDecodeError as e:
            raise APIError.bad_request(f"the request body is not valid JSON: {e}") from None

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError.model_not_found(model)

    def token_text(self, token_id: int) -> str:
        text = self._token_text_cache.get(token_id)
        if text is None:
            text = self.engine.tokenizer.decode([token_id], skip_special_tokens=False)
            if len(self._token_text_cache) < 500_000:
                self._token_text_cache[token_id] = text
        return text

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

    def build_params(self, kwargs: dict[str, Any]) -> Any:
        return self._sampling_params_cls(**kwargs)

    def make_choices(self, request_id: str, prompts: list[tuple[str | None, list[int]]], n: int,
                     base_kwargs: dict[str, Any], max_tokens: list[int], seed: int | None) -> list[Choice]:
        choices = []
        for p, (text, ids) in enumerate(prompts):
            for i in range(n):
                kw = dict(base_kwargs)
                kw["n"] = 1
                kw["max_tokens"] = max_tokens[p]
                if seed is not None:
                    # Choice i is seeded seed + i, as the engine seeds sequence i of an n > 1
                    # request: distinct choices, reproducible run to run.
                    kw["seed"] = (seed + i) % 2**63 if seed >= 0 else seed
                choices.append(Choice(index=p * n + i, prompt_idx=p, sample_idx=i,
                                      request_id=f"{request_id}-{p}-{i}", prompt_ids=ids,
                                      prompt_text=text, params=self.build_params(kw),
                                      tracker=self.metrics.tracker()))
        return choices

    async def start(self, choices: list[Choice], priority: int, cache_salt: str | None = None) -> list[Any]:
        """Submit every choice to the engine; if one is refused, abort those already started."""
        streams: list[Any] = []
        try:
            for c in choices:
                streams.append(self.engine.generate(c.prompt_ids, c.params, c.request_id,
                                                    prompt=c.prompt_text, priority=priority,
                                                    cache_salt=cache_salt))
        except BaseException as e:
            await close_all(streams)
            self.metrics.refused(e)
            raise
        return streams

    async def run(self, choices: list[Choice], streams: list[Any]) -> AsyncIterator[tuple[Choice, Any, list[int]]]:
        """Drive the engine streams; yield (choice, completion delta, new token ids) and keep the
        accumulated state and metrics of each choice up to date. However it ends (finished,
        failed, client gone), every choice is counted once in the metrics."""
        try:
            async for k, out in merge_async_iterators(streams):
                c = choices[k]
                comp = out.outputs[0]
                if comp.finish_reason == "error":
                    c.tracker.finish("error", "engine_error")
                    raise APIError(500, f"the engine failed this request: {out.error or 'unknown error'}",
                                   "server_error", None, "engine_error")
                new_ids = list(comp.token_ids)
                if not c.started:
                    c.started = True
                    if c.sample_idx == 0:
                        self.metrics.prompt_tokens.inc(len(c.prompt_ids))
                    if getattr(out, "prompt_logprobs", None) is not None:
                        c.prompt_logprobs = out.prompt_logprobs
                c.tracker.on_output(out, len(new_ids), getattr(comp, "token_times", None))
                if new_ids:
                    self.metrics.generation_tokens.inc(len(new_ids))
                c.text.append(comp.text)
                c.token_ids.extend(new_ids)
                if comp.finish_reason is not None or out.finished:
                    c.finish_reason = comp.finish_reason or "stop"
                    c.stop_reason = comp.stop_reason
                    c.tracker.finish(c.finish_reason)
                yield c, comp, new_ids
        except BaseException as e:
            end_unfinished(choices, e)
            raise

    def new_logprobs(self, comp: Any, new_ids: list[int]) -> list[tuple[int, float, list[tuple[int, float]]]]:
        """Normalize the engine's per-token logprobs to (token id, logprob, top [(id, logprob)])."""
        raw = getattr(comp, "logprobs", None)
        if not raw:
            return []
        return [normalize_logprob(entry, tid) for entry, tid in zip(raw, new_ids)]

    @staticmethod
    def usage(choices: list[Choice]) -> dict[str, int]:
        prompt = sum(len(c.prompt_ids) for c in choices if c.sample_idx == 0)
        completion = sum(len(c.token_ids) for c in choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}

    async def until_disconnect(self, request: Request, coro: Any, streams: list[Any],
                               choices: list[Choice] = ()) -> Any:
        """Run a non-streaming generation; if the client goes away first, cancel it and close the
        engine streams (→ abort)."""
        task = asyncio.ensure_future(coro)

        async def watch() -> None:
            while True:
                message = await request.receive()
                if message["type"] == "http.disconnect":
                    return

        watcher = asyncio.ensure_future(watch())
        try:
            await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                watcher.cancel()
                await close_all(streams)  # the task may have been cancelled before it started
                end_unfinished(choices, ClientDisconnected())
                raise ClientDisconnected()
            watcher.cancel()
        return task.result()

    # ---- completions --------------------------------------------------------------------

    async def completion_prompts(self, req: CompletionRequest) -> list[tuple[str | None, list[int]]]:
        prompt = req.prompt
        if isinstance(prompt, str):
            texts = [prompt]
        elif isinstance(prompt[0], str):
            texts = list(prompt)
        elif isinstance(prompt[0], int):
            return [(None, self.check_ids(list(prompt), "prompt"))]
        else:
            return [(None, self.check_ids(list(p), "prompt")) for p in prompt]
        ids = await asyncio.gather(*(self.engine.encode(t) for t in texts))
        for i, t in enumerate(ids):
            if not t:
                raise APIError.bad_request("the prompt is empty", param="prompt")
        return list(zip(texts, [list(t) for t in ids]))

    def check_ids(self, ids: list[int], param: str) -> list[int]:
        vocab = getattr(self.engine.tokenizer, "vocab_size", None)
        for t in ids:
            if t < 0 or (vocab is not None and t >= vocab):
                raise APIError.bad_request(f"token id {t} is out of range: ids must be in [0, {vocab})"
                                           if vocab is not None else f"token id {t} is negative",
                                           param=param)
        return ids

    async def completions(self, request: Request) -> Response:
        req = parse(CompletionRequest, await self.read_json(request))
        req.check_supported()
        prompts = await self.completion_prompts(req)
        self.check_model(req.model)  # after the body: what the schema refuses is a 400 first
        max_tokens = [self.max_tokens_for(len(ids), req.max_tokens, COMPLETIONS_DEFAULT_MAX_TOKENS)
                      for _, ids in prompts]
        kw = req.sampling_kwargs()
        if req.logprobs is not None:
            kw["logprobs"] = req.logprobs
            if req.echo:
                kw["prompt_logprobs"] = req.logprobs
        request_id = f"cmpl-{uuid.uuid4().hex}"
        choices = self.make_choices(request_id, prompts, req.n, kw, max_tokens, req.seed)
        if req.echo:
            await self.fill_prompt_texts(choices)
        created = int(time.time())
        # Submitted before the response starts, so a refusal (overloaded, dead) is a real status.
        streams = await self.start(choices, req.priority, req.cache_salt)
        if req.stream:
            return sse_response(self.completion_stream(req, choices, streams, request_id, created), streams,
                                on_close=lambda: end_unfinished(choices, ClientDisconnected()))
        body = await self.until_disconnect(
            request, self.completion_full(req, choices, streams, request_id, created), streams, choices)
        return ORJSONResponse(body)

    async def decode(self, ids: list[int]) -> str:
        decode = getattr(self.engine, "decode", None)  # off the loop when the engine offers it
        if decode is not None:
            return await decode(ids, skip_special_tokens=False)
        return self.engine.tokenizer.decode(ids, skip_special_tokens=False)

    async def fill_prompt_texts(self, choices: list[Choice]) -> None:
        for c in choices:
            if c.prompt_text is None:
                c.prompt_text = await self.decode(c.prompt_ids)

    def completion_logprobs(self, c: Choice, entries: list, with_prompt: bool,
                            k: int) -> dict[str, list]:
        tokens: list[str] = []
        token_logprobs: list[float | None] = []
        top_logprobs: list[dict[str, float] | None] = []
        offsets: list[int] = []
        offset = c.text_offset
        if with_prompt:
            prompt_lps = list(c.prompt_logprobs or [])
            for pos, tid in enumerate(c.prompt_ids):
                entry = prompt_lps[pos] if pos < len(prompt_lps) else None
                s = self.token_text(tid)
                tokens.append(s)
                offsets.append(offset)
                offset += len(s)
                if entry is None:
                    token_logprobs.append(None)
                    top_logprobs.append(None)
                else:
                    _, lp, top = normalize_logprob(entry, tid)
                    token_logprobs.append(lp)
                    top_logprobs.append(self.top_dict(tid, lp, top, k))
        for tid, lp, top in entries:
            s = self.token_text(tid)
            tokens.append(s)
            offsets.append(offset)
            offset += len(s)
            token_logprobs.append(lp)
            top_logprobs.append(self.top_dict(tid, lp, top, k))
        c.text_offset = offset
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
                "text_offset": offsets}

    def top_dict(self, tid: int, lp: float, top: list[tuple[int, float]], k: int) -> dict[str, float]:
        # As OpenAI/vLLM: the k most likely tokens, plus the sampled one.
        out = {self.token_text(t): v for t, v in top[:k]}
        out.setdefault(self.token_text(tid), lp)
        return out

    async def completion_full(self, req: CompletionRequest, choices: list[Choice], streams: list[Any],
                              request_id: str, created: int) -> dict[str, Any]:
        async for c, comp, new_ids in self.run(choices, streams):
            if req.logprobs is not None:
                c.logprobs.extend(self.new_logprobs(comp, new_ids))
        out = []
        for c in choices:
            text = "".join(c.text)
            logprobs = None
            if req.echo:
                text = (c.prompt_text or "") + text
            if req.logprobs is not None:
                logprobs = self.completion_logprobs(c, c.logprobs, req.echo, req.logprobs)
            out.append({"index": c.index, "text": text, "logprobs": logprobs,
                        "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
        return {"id": request_id, "object": "text_completion", "created": created,
                "model": self.model_name, "choices": out, "usage": self.usage(choices),
                "system_fingerprint": None}

    async def completion_stream(self, req: CompletionRequest, choices: list[Choice],
                                streams: list[Any], request_id: str, created: int) -> AsyncIterator[dict[str, Any]]:
        usage_field = {"usage": None} if req.include_usage else {}
        echoed: set[int] = set()
        async for c, comp, new_ids in self.run(choices, streams):
            text = comp.text
            with_prompt = False
            if req.echo and c.index not in echoed:
                echoed.add(c.index)
                text = (c.prompt_text or "") + text
                with_prompt = True
            logprobs = None
            if req.logprobs is not None:
                logprobs = self.completion_logprobs(c, self.new_logprobs(comp, new_ids), with_prompt,
                                                    req.logprobs)
            if not text and not new_ids and c.finish_reason is None:
                continue
            yield {"id": request_id, "object": "text_completion", "created": created,
                   "model": self.model_name,
                   "choices": [{"index": c.index, "text": text, "logprobs": logprobs,
                                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}],
                   **usage_field}
        if req.include_usage:
            yield {"id": request_id, "object": "text_completion", "created": created,
                   "model": self.model_name, "choices": [], "usage": self.usage(choices)}

    # ---- chat ---------------------------------------------------------------------------

    async def chat_prompt(self, messages: list[dict[str, str]], add_generation_prompt: bool,
                          continue_final_message: bool) -> tuple[str, list[int]]:
        from jinja2 import TemplateError

        try:
            text = await self.engine.render_chat(messages, add_generation_prompt=add_generation_prompt,
                                                 continue_final_message=continue_final_message)
        except (TemplateError, ValueError) as e:
            raise APIError.bad_request(f"the chat template could not render these messages: {e}",
                                       param="messages") from None
        ids = await self.engine.encode(text, add_special_tokens=False)
        return text, list(ids)

    async def chat_completions(self, request: Request) -> Response:
        req = parse(ChatCompletionRequest, await self.read_json(request))
        req.check_supported()
        messages = req.template_messages()
        self.check_model(req.model)  # after the body: what the schema refuses is a 400 first
        text, ids = await self.chat_prompt(messages, req.add_generation_prompt,
                                           req.continue_final_message)
        requested = req.requested_max_tokens()
        try:
            max_tokens = self.max_tokens_for(len(ids), requested, None)
        except APIError as e:
            if req.max_completion_tokens is not None and e.param == "max_tokens":
                e.param = "max_completion_tokens"
            if e.param == "prompt":
                e.param = "messages"
            raise
        kw = req.sampling_kwargs()
        top = req.top_logprobs or 0
        if req.logprobs:
            kw["logprobs"] = top
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        choices = self.make_choices(request_id, [(text, ids)], req.n, kw, [max_tokens], req.seed)
        created = int(time.time())
        streams = await self.start(choices, req.priority, req.cache_salt)
        if req.stream:
            return sse_response(self.chat_stream(req, choices, streams, request_id, created, top), streams,
                                on_close=lambda: end_unfinished(choices, ClientDisconnected()))
        body = await self.until_disconnect(
            request, self.chat_full(req, choices, streams, request_id, created, top), streams, choices)
        return ORJSONResponse(body)

    def chat_logprobs(self, entries: list, k: int) -> dict[str, list]:
        content = []
        for tid, lp, top in entries:
            s = self.token_text(tid)
            content.append({
                "token": s, "logprob": lp, "bytes": list(s.encode("utf-8")),
                "top_logprobs": [{"token": (ts := self.token_text(t)), "logprob": v,
                                  "bytes": list(ts.encode("utf-8"))} for t, v in top[:k]],
            })
        return {"content": content}

    async def chat_full(self, req: ChatCompletionRequest, choices: list[Choice], streams: list[Any],
                        request_id: str, created: int, top: int) -> dict[str, Any]:
        async for c, comp, new_ids in self.run(choices, streams):
            if req.logprobs:
                c.logprobs.extend(self.new_logprobs(comp, new_ids))
        out = []
        for c in choices:
            out.append({"index": c.index,
                        "message": {"role": "assistant", "content": "".join(c.text)},
                        "logprobs": self.chat_logprobs(c.logprobs, top) if req.logprobs else None,
                        "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
        return {"id": request_id, "object": "chat.completion", "created": created,
                "model": self.model_name, "choices": out, "usage": self.usage(choices),
                "system_fingerprint": None}

    async def chat_stream(self, req: ChatCompletionRequest, choices: list[Choice], streams: list[Any],
                          request_id: str, created: int, top: int) -> AsyncIterator[dict[str, Any]]:
        usage_field = {"usage": None} if req.include_usage else {}
        head = {"id": request_id, "object": "chat.completion.chunk", "created": created,
                "model": self.model_name}
        for c in choices:
            yield {**head, "choices": [{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                        "logprobs": None, "finish_reason": None}], **usage_field}
        async for c, comp, new_ids in self.run(choices, streams):
            text = comp.text
            logprobs = None
            if req.logprobs:
                logprobs = self.chat_logprobs(self.new_logprobs(comp, new_ids), top)
            if not text and c.finish_reason is None and not (logprobs and logprobs["content"]):
                continue
            choice: dict[str, Any] = {"index": c.index, "delta": {"content": text} if text else {},
                                      "logprobs": logprobs, "finish_reason": c.finish_reason}
            if c.finish_reason is not None:
                choice["stop_reason"] = c.stop_reason
            yield {**head, "choices": [choice], **usage_field}
        if req.include_usage:
            yield {**head, "choices": [], "usage": self.usage(choices)}

    # ---- the small routes ---------------------------------------------------------------

    async def models(self, request: Request) -> Response:
        return ORJSONResponse({"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": self.created,
            "owned_by": "pagedserve", "root": self.model_name, "parent": None,
            "max_model_len": self.engine.max_model_len,
        }]})

    async def tokenize(self, request: Request) -> Response:
        req = parse(TokenizeRequest, await self.read_json(request))
        req.check()
        messages = None
        if req.messages is not None:
            messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                        for m in req.messages]
        self.check_model(req.model)  # after the body: what the schema refuses is a 400 first
        if messages is not None:
            if req.continue_final_message and req.add_generation_prompt:
                raise APIError.bad_request("continue_final_message and add_generation_prompt cannot "
                                           "both be true", param="continue_final_message")
            _, ids = await self.chat_prompt(messages, req.add_generation_prompt,
                                            req.continue_final_message)
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
        return ORJSONResponse({"version": _version()})

    async def metrics_route(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)


def end_unfinished(choices: Sequence[Choice], exc: BaseException) -> None:
    """Count the choices that had not finished when their request ended: the client went away
    (abort) or the request failed (error, by cause)."""
    from engine.errors import EngineDeadError

    if isinstance(exc, (asyncio.CancelledError, GeneratorExit, ClientDisconnected)):
        reason, cause = "abort", ""
    elif isinstance(exc, EngineDeadError) or getattr(exc, "code", None) == "engine_dead":
        reason, cause = "error", "engine_dead"
    elif getattr(exc, "code", None) == "engine_error":
        reason, cause = "error", "engine_error"
    else:
        reason, cause = "error", "internal_error"
    for c in choices:
        if not c.tracker.done:
            c.tracker.finish(reason, cause)


def normalize_logprob(entry: Any, token_id: int) -> tuple[int, float, list[tuple[int, float]]]:
    """One position's logprobs from the engine → (sampled id, its logprob, top [(id, logprob)] best
    first). Accepts vLLM's ``{token_id: Logprob | float}`` and the worker's SampledLogprobs form."""
    if isinstance(entry, dict):
        pairs = [(int(tid), float(getattr(v, "logprob", v))) for tid, v in entry.items()]
        ranked = sorted(pairs, key=lambda p: -p[1])
        chosen = dict(pairs).get(token_id)
        return token_id, (chosen if chosen is not None else float("nan")), ranked
    return token_id, float(entry.logprob), [(int(t), float(v)) for t, v in entry.top]


def _wrap(handler: Callable[[Request], Any]) -> Callable[[Request], Any]:
    async def endpoint(request: Request) -> Response:
        try:
            return await handler(request)
        except (ClientDisconnected, ClientDisconnect):  # also gone in the middle of its body
            return Response(status_code=499)
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


def _openapi_route(engine: Any, name: str, api_key: str | None,
                   max_body_bytes: int) -> Callable[[Request], Any]:
    """GET /openapi.json: the document is built once, from what this server enforces."""
    from app.openapi import build_openapi

    body = orjson.dumps(build_openapi(
        served_model_name=name, max_model_len=engine.max_model_len,
        vocab_size=getattr(engine.tokenizer, "vocab_size", None), api_key=bool(api_key),
        max_body_bytes=max_body_bytes, version=_version()))

    async def openapi(request: Request) -> Response:
        return Response(body, media_type="application/json")

    return openapi


def build_app(engine: Any, *, served_model_name: str | None = None, api_key: str | None = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, lifespan: Any = None) -> Starlette:
    """The ASGI app for one engine. Metrics live in a registry of their own (``app.state.metrics``)."""
    name = served_model_name or engine.model_name
    metrics = ServerMetrics(engine, name)
    s = OpenAIServer(engine, name, max_body_bytes, metrics)
    routes = [
        Route("/v1/completions", _wrap(s.completions), methods=["POST"]),
        Route("/v1/chat/completions", _wrap(s.chat_completions), methods=["POST"]),
        Route("/v1/models", _wrap(s.models), methods=["GET"]),
        Route("/tokenize", _wrap(s.tokenize), methods=["POST"]),
        Route("/detokenize", _wrap(s.detokenize), methods=["POST"]),
        Route("/health", _wrap(s.health), methods=["GET"]),
        Route("/version", _wrap(s.version), methods=["GET"]),
        Route("/metrics", _wrap(s.metrics_route), methods=["GET"]),
        Route("/openapi.json", _openapi_route(engine, name, api_key, max_body_bytes), methods=["GET"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={HTTPException: _http_exception, Exception: _unexpected})
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    app.add_middleware(HTTPErrorCounter, metrics=metrics)  # outermost: sees 401s too
    app.state.metrics = metrics
    app.state.server = s
    return app
