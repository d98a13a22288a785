"""POST /v1/completions: prompts (text, texts, ids, lists of ids) to choices, echo, and the
legacy ``logprobs`` shape (tokens, token_logprobs, top_logprobs, text_offset), full or streamed."""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from pagedserve.app.admission import check_choices, check_commitment
from pagedserve.app.beam_requests import beam_kwargs
from pagedserve.app.errors import APIError
from pagedserve.app.fanout import Choice, ChoiceFanOut, ClientDisconnected, end_unfinished, normalize_logprob
from pagedserve.app.logprob_format import LogprobFormat
from pagedserve.app.prompt_options import check_truncate, truncate_prompt
from pagedserve.app.protocol import CompletionRequest, parse
from pagedserve.app.request_checks import RequestChecks
from pagedserve.app.request_id import response_and_engine_ids
from pagedserve.app.responses import ORJSONResponse
from pagedserve.app.streaming import DEFAULT_SSE_PING_INTERVAL, sse_response
from pagedserve.app.structured_args import check_constraint
from pagedserve.engine.client import EngineClient

COMPLETIONS_DEFAULT_MAX_TOKENS = 16


def num_prompts(prompt: Any) -> int:
    """A string or a list of ids is one prompt; a list of strings or of id lists is several."""
    return len(prompt) if isinstance(prompt, list) and isinstance(prompt[0], (str, list)) else 1


class CompletionsRoute:
    """POST /v1/completions over its collaborators: the request checks, the fan-out of choices
    and the logprob format."""

    def __init__(self, engine: EngineClient, served_model_name: str, checks: RequestChecks,
                 fanout: ChoiceFanOut, logprob_format: LogprobFormat, sse_ping_interval: float = DEFAULT_SSE_PING_INTERVAL) -> None:
        self.engine = engine
        self.model_name = served_model_name
        self.checks = checks
        self.fanout = fanout
        self.logprob_format = logprob_format
        self.sse_ping_interval = sse_ping_interval  # seconds between SSE comment pings; 0 = none

    async def completion_prompts(self, req: CompletionRequest) -> list[tuple[str | None, list[int]]]:
        prompt = req.prompt
        if isinstance(prompt, str):
            texts = [prompt]
        elif isinstance(prompt[0], str):
            texts = list(prompt)
        elif isinstance(prompt[0], int):
            return [(None, self.checks.check_ids(list(prompt), "prompt"))]
        else:
            return [(None, self.checks.check_ids(list(p), "prompt")) for p in prompt]
        # Every text bounded before any is tokenized (a text cut to its end shows no echo text).
        fitted = [self.checks.fit_text(t, "prompt", req.truncate_prompt_tokens,
                                "the prompt" if len(texts) == 1 else f"prompt {i}") for i, t in enumerate(texts)]
        ids = await asyncio.gather(*(self.engine.encode(t, add_special_tokens=req.add_special_tokens)
                                     for t in fitted))
        for i, t in enumerate(ids):
            if not t:
                raise APIError.bad_request("the prompt is empty", param="prompt")
        return [(text if cut is text else None, list(t)) for text, cut, t in zip(texts, fitted, ids)]

    async def completions(self, request: Request) -> Response:
        req = parse(CompletionRequest, await self.checks.read_admitted(request, "completions"))
        req.check_supported()
        check_truncate(req.truncate_prompt_tokens, self.engine.max_model_len)
        check_choices(req, num_prompts(req.prompt), self.checks.limits)  # before a prompt is tokenized
        prompts = await self.completion_prompts(req)
        if req.truncate_prompt_tokens is not None:  # echo then shows what the model read
            prompts = [(text if len(ids) <= req.truncate_prompt_tokens else None,
                        truncate_prompt(ids, req.truncate_prompt_tokens)) for text, ids in prompts]
        lora = self.checks.check_model(req.model)  # after the body: what the schema refuses is a 400 first
        max_tokens = [self.checks.max_tokens_for(len(ids), req.max_tokens, COMPLETIONS_DEFAULT_MAX_TOKENS)
                      for _, ids in prompts]
        check_commitment(req, [len(ids) for _, ids in prompts], max_tokens, self.checks.limits)
        kw = {**self.engine.sampling_defaults, **req.sampling_kwargs()}  # the request's own fields win
        kw.update(beam_kwargs(req))  # use_beam_search (app/beam_requests.py)
        if req.logprobs is not None:
            kw["logprobs"] = req.logprobs
            if req.echo:
                kw["prompt_logprobs"] = req.logprobs
        if req.prompt_logprobs is not None:
            kw["prompt_logprobs"] = max(req.prompt_logprobs, kw.get("prompt_logprobs") or 0)
        request_id, engine_id = response_and_engine_ids(request, "cmpl", req.request_id)
        # A stream echoes each choice's prompt logprobs with its first chunk: each asks for them.
        choices = self.fanout.make_choices(engine_id, prompts, req.n, kw, max_tokens, req.seed,
                                    share_prompt_logprobs=not req.stream)
        if req.echo:
            await self.fill_prompt_texts(choices)
        created = int(time.time())
        # Submitted before the response starts, so a refusal (overloaded, dead) is a real status.
        await check_constraint(self.engine, choices[0].params, req.constraint_param())
        streams = await self.fanout.start(choices, req.priority, req.cache_salt, lora)
        if req.stream:
            return sse_response(self.completion_stream(req, choices, streams, request_id, created), streams,
                                on_close=lambda: end_unfinished(choices, ClientDisconnected()),
                                ping_interval=self.sse_ping_interval)
        body = await self.fanout.until_disconnect(
            request, self.completion_full(req, choices, streams, request_id, created), streams, choices)
        return ORJSONResponse(body)

    async def fill_prompt_texts(self, choices: list[Choice]) -> None:
        for c in choices:
            if c.prompt_text is None:
                c.prompt_text = await self.engine.decode(c.prompt_ids, skip_special_tokens=False)

    def completion_logprobs(self, c: Choice, entries: list, with_prompt: bool,
                            k: int, as_ids: bool | None = False) -> dict[str, list]:
        tokens: list[str] = []
        token_logprobs: list[float | None] = []
        top_logprobs: list[dict[str, float] | None] = []
        offsets: list[int] = []
        offset = c.text_offset
        if with_prompt:
            prompt_lps = list(c.prompt_logprobs or [])
            for pos, tid in enumerate(c.prompt_ids):
                entry = prompt_lps[pos] if pos < len(prompt_lps) else None
                s = self.logprob_format.token_text(tid)
                tokens.append(self.logprob_format.logprob_token(tid, as_ids))
                offsets.append(offset)
                offset += len(s)
                if entry is None:
                    token_logprobs.append(None)
                    top_logprobs.append(None)
                else:
                    _, lp, top = normalize_logprob(entry, tid)
                    token_logprobs.append(lp)
                    top_logprobs.append(self.top_dict(tid, lp, top, k, as_ids))
        for tid, lp, top in entries:
            s = self.logprob_format.token_text(tid)
            tokens.append(self.logprob_format.logprob_token(tid, as_ids))
            offsets.append(offset)
            offset += len(s)
            token_logprobs.append(lp)
            top_logprobs.append(self.top_dict(tid, lp, top, k, as_ids))
        c.text_offset = offset
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
                "text_offset": offsets}

    def top_dict(self, tid: int, lp: float, top: list[tuple[int, float]], k: int,
                 as_ids: bool | None = False) -> dict[str, float]:
        # As OpenAI/vLLM: the k most likely tokens, plus the sampled one.
        out = {self.logprob_format.logprob_token(t, as_ids): v for t, v in top[:k]}
        out.setdefault(self.logprob_format.logprob_token(tid, as_ids), lp)
        return out

    async def completion_full(self, req: CompletionRequest, choices: list[Choice], streams: list[Any],
                              request_id: str, created: int) -> dict[str, Any]:
        async for c, comp, new_ids in self.fanout.run(choices, streams):
            if req.logprobs is not None:
                c.logprobs.extend(self.fanout.new_logprobs(comp, new_ids))
        self.fanout.share_prompt_logprobs(choices, req.n)
        out = []
        for c in choices:
            text = "".join(c.text)
            logprobs = None
            if req.echo:
                text = (c.prompt_text or "") + text
            if req.logprobs is not None:
                logprobs = self.completion_logprobs(c, c.logprobs, req.echo, req.logprobs,
                                                    req.return_tokens_as_token_ids)
            choice = {"index": c.index, "text": text, "logprobs": logprobs,
                      "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
            if req.prompt_logprobs is not None:
                choice["prompt_logprobs"] = self.logprob_format.prompt_logprobs_body(
                    c.prompt_logprobs, c.prompt_ids, req.prompt_logprobs, req.return_tokens_as_token_ids)
            out.append(choice)
        return {"id": request_id, "object": "text_completion", "created": created,
                "model": self.model_name, "choices": out, "usage": self.fanout.usage(choices),
                "system_fingerprint": None}

    async def completion_stream(self, req: CompletionRequest, choices: list[Choice],
                                streams: list[Any], request_id: str, created: int) -> AsyncIterator[dict[str, Any]]:
        def usage_field() -> dict[str, Any]:  # continuous_usage_stats: the usage so far on every chunk
            if req.continuous_usage:
                return {"usage": self.fanout.usage(choices)}
            return {"usage": None} if req.include_usage else {}

        echoed: set[int] = set()
        async for c, comp, new_ids in self.fanout.run(choices, streams):
            text = comp.text
            with_prompt = False
            if req.echo and c.index not in echoed:
                echoed.add(c.index)
                text = (c.prompt_text or "") + text
                with_prompt = True
            logprobs = None
            if req.logprobs is not None:
                logprobs = self.completion_logprobs(c, self.fanout.new_logprobs(comp, new_ids), with_prompt,
                                                    req.logprobs, req.return_tokens_as_token_ids)
            if not text and not new_ids and c.finish_reason is None:
                continue
            yield {"id": request_id, "object": "text_completion", "created": created,
                   "model": self.model_name,
                   "choices": [{"index": c.index, "text": text, "logprobs": logprobs,
                                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}],
                   **usage_field()}
        if req.include_usage:
            yield {"id": request_id, "object": "text_completion", "created": created,
                   "model": self.model_name, "choices": [], "usage": self.fanout.usage(choices)}
