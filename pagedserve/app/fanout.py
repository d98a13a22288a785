"""One engine request per choice, and the plumbing every generating route shares.

A request with several prompts or ``n > 1`` fans out to one engine request per choice (choice
index = prompt_idx * n + i); their delta streams are merged and each choice's text, tokens,
logprobs, finish reason and metrics are kept up to date. However a request ends (finished,
failed, client gone) every choice is counted once in the metrics: ``end_unfinished``.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request

from pagedserve.app.beam_requests import BEAM_KEY, BeamSplit, BeamView
from pagedserve.app.errors import APIError
from pagedserve.app.metrics import RequestTracker, ServerMetrics
from pagedserve.engine.client import EngineClient
from pagedserve.engine.outputs import Logprob
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.app.streaming import close_all, merge_async_iterators


class ClientDisconnected(Exception):
    """The client went away before a non-streaming response was ready."""


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
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


class ChoiceFanOut:
    """Build the choices of a request, submit them to the engine, drive their streams, count
    usage (shared by the completions and chat routes; the embeddings route borrows
    ``until_disconnect``)."""

    def __init__(self, engine: EngineClient, metrics: ServerMetrics, prompt_tokens_details: bool = False) -> None:
        """``prompt_tokens_details``: usage tells how many prompt tokens came from the prefix cache
        (--enable-prompt-tokens-details): off by default, since a hit tells a caller that someone
        sent the same prompt prefix before (issue 37)."""
        self.engine = engine
        self.metrics = metrics
        self.prompt_tokens_details = prompt_tokens_details

    def build_params(self, kwargs: dict[str, Any]) -> SamplingParams:
        return SamplingParams(**kwargs)

    def make_choices(self, request_id: str, prompts: list[tuple[str | None, list[int]]], n: int,
                     base_kwargs: dict[str, Any], max_tokens: list[int], seed: int | None,
                     share_prompt_logprobs: bool = False) -> list[Choice]:
        """One Choice per prompt x sample. ``share_prompt_logprobs``: only each prompt's first
        choice asks the engine for prompt logprobs (a full prefill without the prefix cache);
        the route copies them to its siblings (``share_prompt_logprobs``) once they are done."""
        if BEAM_KEY in base_kwargs:  # use_beam_search: one engine request per prompt (app/beam_requests.py)
            from pagedserve.engine.sampling_params import BeamSearchParams

            return [Choice(index=p * n + i, prompt_idx=p, sample_idx=i, request_id=f"{request_id}-{p}",
                           prompt_ids=ids, prompt_text=text,
                           params=BeamSearchParams(max_tokens=max_tokens[p], **base_kwargs[BEAM_KEY]),
                           tracker=self.metrics.tracker())
                    for p, (text, ids) in enumerate(prompts) for i in range(n)]
        choices = []
        first = None  # the request's params, validated once; the other choices are its siblings
        for p, (text, ids) in enumerate(prompts):
            for i in range(n):
                kw = dict(base_kwargs)
                kw["n"] = 1
                kw["max_tokens"] = max_tokens[p]
                if share_prompt_logprobs and i > 0:
                    kw.pop("prompt_logprobs", None)
                if seed is not None:
                    # Choice i is seeded seed + i, as the engine seeds sequence i of an n > 1
                    # request: distinct choices, reproducible run to run.
                    kw["seed"] = (seed + i) % 2**63 if seed >= 0 else seed
                if first is None:
                    params = first = self.build_params(kw)
                else:  # its lists (stop, allowed_token_ids...) are not validated again per choice
                    params = first.sibling(max_tokens=kw["max_tokens"], seed=kw.get("seed"),
                                           prompt_logprobs=kw.get("prompt_logprobs"))
                choices.append(Choice(index=p * n + i, prompt_idx=p, sample_idx=i,
                                      request_id=f"{request_id}-{p}-{i}", prompt_ids=ids,
                                      prompt_text=text, params=params, tracker=self.metrics.tracker()))
        return choices

    @staticmethod
    def share_prompt_logprobs(choices: list[Choice], n: int) -> None:
        """Give each choice its prompt's logprobs, computed by the prompt's first choice."""
        for c in choices:
            if c.prompt_logprobs is None:
                c.prompt_logprobs = choices[c.prompt_idx * n].prompt_logprobs

    async def start(self, choices: list[Choice], priority: int, cache_salt: str | None = None,
                    lora_request: Any = None) -> list[Any]:
        """Submit every choice to the engine (with the LoRA adapter the request's model names);
        if one is refused, abort those already started."""
        streams: list[Any] = []
        splits: dict[str, BeamSplit] = {}
        try:
            for c in choices:
                if c.request_id in splits or c.params.__class__.__name__ == "BeamSearchParams":
                    if c.request_id not in splits:
                        splits[c.request_id] = BeamSplit(self.engine.generate(
                            c.prompt_ids, c.params, c.request_id, prompt=c.prompt_text, priority=priority,
                            cache_salt=cache_salt, lora_request=lora_request))
                    streams.append(BeamView(splits[c.request_id], c.sample_idx))
                    continue
                streams.append(self.engine.generate(c.prompt_ids, c.params, c.request_id,
                                                    prompt=c.prompt_text, priority=priority,
                                                    cache_salt=cache_salt, lora_request=lora_request))
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
                    if out.error_from_request:
                        c.tracker.finish("error", "invalid_request")
                        # the request's constraints admit no token, unless the engine names the
                        # cause (a grammar compile past --grammar-compile-timeout: its own code)
                        raise APIError.bad_request(out.error or "the request's constraints admit no token",
                                                   code=out.error_code or "constraints_unsatisfiable")
                    c.tracker.finish("error", "engine_error")
                    raise APIError(500, f"the engine failed this request: {out.error or 'unknown error'}",
                                   "server_error", None, "engine_error")
                new_ids = list(comp.token_ids)
                if not c.started:
                    c.started = True
                    if c.sample_idx == 0:
                        self.metrics.prompt_tokens.inc(len(c.prompt_ids))
                    if out.prompt_logprobs is not None:
                        c.prompt_logprobs = out.prompt_logprobs
                c.tracker.on_output(out, len(new_ids), comp.token_times)
                c.cached_tokens = max(c.cached_tokens, out.num_cached_tokens)
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
        raw = comp.logprobs
        if not raw:
            return []
        return [normalize_logprob(entry, tid) for entry, tid in zip(raw, new_ids)]

    def usage(self, choices: list[Choice]) -> dict[str, Any]:
        prompt = sum(len(c.prompt_ids) for c in choices if c.sample_idx == 0)
        completion = sum(len(c.token_ids) for c in choices)
        usage: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion,
                                 "total_tokens": prompt + completion}
        if self.prompt_tokens_details:  # vLLM's, with --enable-prompt-tokens-details
            cached = sum(c.cached_tokens for c in choices if c.sample_idx == 0)
            usage["prompt_tokens_details"] = {"cached_tokens": cached}
        return usage

    def cached_tokens(self, choice: Choice, cache_salt: str | None) -> int:
        """The prompt tokens the prefix cache served ``choice``, where they may be told: with
        --enable-prompt-tokens-details, or to a salted request (its hits can only come from
        requests of its own salt); else 0."""
        return choice.cached_tokens if self.prompt_tokens_details or cache_salt is not None else 0

    async def until_disconnect(self, request: Request, coro: Any, streams: list[Any],
                               choices: list[Choice] = ()) -> Any:
        """Run a non-streaming generation; if the client goes away first, cancel it and close the
        engine streams (→ abort). If this handler is cancelled instead (the server shutting down
        past --shutdown-timeout), the choices end as the engine's shutdown ends them (engine_dead)
        and the cancellation goes on to ``app.server``, which answers 503."""
        task = asyncio.ensure_future(coro)

        async def watch() -> None:
            while True:
                message = await request.receive()
                if message["type"] == "http.disconnect":
                    return

        watcher = asyncio.ensure_future(watch())
        ended_by: BaseException = ClientDisconnected()
        try:
            await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            ended_by = shutdown_error()
            raise
        finally:
            watcher.cancel()
            if not task.done():
                end_unfinished(choices, ended_by)  # first: the task counts a cancel as an abort
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                await close_all(streams)  # the task may have been cancelled before it started
                if isinstance(ended_by, ClientDisconnected):
                    raise ended_by
        return task.result()


def shutdown_error() -> Exception:
    """The error of a request the server cut while shutting down (the engine's own, so a cut stream
    and a cut non-streaming request say the same: 503, engine_dead)."""
    from pagedserve.engine.errors import SHUTDOWN_ABORT_MESSAGE, EngineDeadError

    return EngineDeadError(SHUTDOWN_ABORT_MESSAGE)


def end_unfinished(choices: Sequence[Choice], exc: BaseException) -> None:
    """Count the choices that had not finished when their request ended: the client went away
    (abort) or the request failed (error, by cause)."""
    from pagedserve.engine.errors import EngineDeadError

    if isinstance(exc, (asyncio.CancelledError, GeneratorExit, ClientDisconnected)):
        reason, cause = "abort", ""
    elif isinstance(exc, EngineDeadError) or (isinstance(exc, APIError) and exc.code == "engine_dead"):
        reason, cause = "error", "engine_dead"
    elif isinstance(exc, APIError) and exc.code == "engine_error":
        reason, cause = "error", "engine_error"
    else:
        reason, cause = "error", "internal_error"
    for c in choices:
        if not c.tracker.done:
            c.tracker.finish(reason, cause)


def logprob_value(v: Logprob | float) -> float:
    """A logprob as the engine gives it (Logprob) or as vLLM's dict form may hold it (a float)."""
    return float(v.logprob if isinstance(v, Logprob) else v)


def normalize_logprob(entry: Any, token_id: int) -> tuple[int, float, list[tuple[int, float]]]:
    """One position's logprobs from the engine → (sampled id, its logprob, top [(id, logprob)] best
    first). Accepts vLLM's ``{token_id: Logprob | float}`` and the worker's SampledLogprobs form."""
    if isinstance(entry, dict):
        pairs = [(int(tid), logprob_value(v)) for tid, v in entry.items()]
        ranked = sorted(pairs, key=lambda p: -p[1])
        chosen = dict(pairs).get(token_id)
        return token_id, (chosen if chosen is not None else float("nan")), ranked
    return token_id, float(entry.logprob), [(int(t), float(v)) for t, v in entry.top]
