"""``use_beam_search`` on /v1/completions and /v1/chat/completions (vLLM's extra field).

One engine request per prompt with BeamSearchParams (beam_width = ``best_of`` or ``n``; ``n``
beams returned, best first, as choices p * n + i); its single final output is split into one
stream per choice (``BeamView``), so the routes' fan-out, usage and metrics work unchanged.
Beam search gives one answer at the end: ``stream: true`` is a 400, as are the fields it cannot
honour (logprobs, stop strings, output constraints, penalties and the sampling filters).
"""
from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from pagedserve.app.errors import APIError
from pagedserve.app.protocol import ChatCompletionRequest, CompletionRequest
from pagedserve.app.streaming import close_quietly

BEAM_KEY = "_beam"  # in the routes' sampling kwargs: the BeamSearchParams fields


def beam_kwargs(req: CompletionRequest | ChatCompletionRequest) -> dict[str, Any]:
    """{} without beam search; else {BEAM_KEY: fields} after refusing what it cannot serve."""
    chat = isinstance(req, ChatCompletionRequest)
    if not req.use_beam_search:
        return {}
    if req.stream:
        raise APIError.bad_request("use_beam_search is not available with stream: true (beam search "
                                   "answers once, at the end); set stream to false", param="stream")
    refused = {
        "logprobs": bool(req.logprobs) or (chat and req.top_logprobs is not None),
        "prompt_logprobs": req.prompt_logprobs is not None,
        "stop": bool(req.stop),
        "min_tokens": bool(req.min_tokens),
        "logit_bias": bool(req.logit_bias),
        "echo": req.echo,
        "tools": chat and bool(req.tools) and req.tool_choice not in (None, "none"),
        "top_p": req.top_p is not None,
        "top_k": req.top_k is not None,
        "min_p": req.min_p is not None,
        "presence_penalty": req.presence_penalty is not None,
        "frequency_penalty": req.frequency_penalty is not None,
        "repetition_penalty": req.repetition_penalty is not None,
    }
    if req.constraint_kwargs():
        refused[req.constraint_param() or "structured_outputs"] = True
    for name, bad in refused.items():
        if bad:
            raise APIError.bad_request(f"{name} cannot be combined with use_beam_search", param=name)
    width = req.best_of if req.best_of is not None else req.n
    if width < req.n:
        raise APIError.bad_request(f"best_of ({width}) must be >= n ({req.n}) with use_beam_search", param="best_of")
    return {BEAM_KEY: {"beam_width": width, "n": req.n, "ignore_eos": req.ignore_eos,
                       "temperature": float(req.temperature or 0.0),
                       "length_penalty": float(req.length_penalty if req.length_penalty is not None else 1.0),
                       "stop_token_ids": list(req.stop_token_ids or [])}}


class BeamSplit:
    """One engine stream of a beam-search request, read once, shared by its choices."""

    def __init__(self, stream: Any):
        self.stream = stream
        self._task: asyncio.Future | None = None

    async def final(self) -> Any:
        if self._task is None:
            self._task = asyncio.ensure_future(self._collect())
        return await asyncio.shield(self._task)

    async def _collect(self) -> Any:
        last = None
        async for out in self.stream:
            last = out
        return last

    async def aclose(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
        await close_quietly(self.stream)


class BeamView:
    """Choice ``rank`` of a beam-search request: one RequestOutput holding beam ``rank`` alone."""

    def __init__(self, split: BeamSplit, rank: int):
        self.split = split
        self.rank = rank
        self._done = False

    def __aiter__(self) -> "BeamView":
        return self

    async def __anext__(self) -> Any:
        if self._done:
            raise StopAsyncIteration
        self._done = True
        out = await self.split.final()
        if out is None:
            raise StopAsyncIteration
        comps = out.outputs
        if self.rank < len(comps):
            comp = comps[self.rank]
        else:  # fewer beams than asked (aborted early): an empty choice with the same ending
            comp = dataclasses.replace(comps[0], text="", token_ids=[], cumulative_logprob=None)
        return dataclasses.replace(out, outputs=[comp])

    async def aclose(self) -> None:
        await self.split.aclose()
