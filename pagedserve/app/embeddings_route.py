"""POST /v1/embeddings (OpenAI's format) and POST /v1/score, /score (vLLM's pair scoring by
embedding cosine).

Each input becomes one pooling request of the engine (``engine.pool``): the same scheduler,
KV cache and steps as generation, prefill only. ``encoding_format: "base64"`` (what the
official openai client asks for by default) is the float32 little-endian bytes of the vector,
base64-encoded, as OpenAI sends them.
"""
from __future__ import annotations

import asyncio
import base64
import sys
import time
from array import array
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from pagedserve.app.embeddings_protocol import EmbeddingRequest, ScoreRequest
from pagedserve.app.errors import APIError
from pagedserve.app.fanout import ChoiceFanOut
from pagedserve.app.metrics import ServerMetrics
from pagedserve.app.protocol import parse
from pagedserve.app.request_checks import RequestChecks
from pagedserve.app.request_id import response_and_engine_ids
from pagedserve.app.responses import ORJSONResponse
from pagedserve.app.streaming import close_all, merge_async_iterators
from pagedserve.engine.client import EngineClient

Inputs = list[tuple[str | None, list[int]]]  # (text or None, token ids) per input


def float32_le_bytes(data: bytes) -> bytes:
    """The vector's float32 bytes in little-endian order (the wire format of base64)."""
    if sys.byteorder == "little":
        return data
    values = array("f", data)
    values.byteswap()
    return values.tobytes()


def encode_vector(data: bytes, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(float32_le_bytes(data)).decode("ascii")
    return memoryview(data).cast("f").tolist()


class EmbeddingsRoute:
    """POST /v1/embeddings and /v1/score over the request checks; a client that leaves aborts
    its pooling requests as it aborts generation (``fanout.until_disconnect``)."""

    def __init__(self, engine: EngineClient, served_model_name: str, checks: RequestChecks,
                 fanout: ChoiceFanOut, metrics: ServerMetrics) -> None:
        self.engine = engine
        self.model_name = served_model_name
        self.checks = checks
        self.fanout = fanout
        self.metrics = metrics

    async def embeddings(self, request: Request) -> Response:
        req = parse(EmbeddingRequest, await self.checks.read_admitted(request, "embeddings"))
        inputs = await self.pooling_inputs(req.input, req.add_special_tokens, "input")
        self.checks.check_base_model(req.model, "embeddings")  # after the body: the schema's 400s come first
        params = self.pooling_params(req.pooling_type, req.normalize, req.dimensions)
        request_id, engine_id = response_and_engine_ids(request, "embd", req.request_id)
        outs = await self.pool_all(request, inputs, params, engine_id, req.priority, req.cache_salt)
        data = [{"object": "embedding", "index": i, "embedding": encode_vector(o.outputs.data_bytes, req.encoding_format)}
                for i, o in enumerate(outs)]
        n = sum(len(ids) for _, ids in inputs)
        return ORJSONResponse({"id": request_id, "object": "list", "created": int(time.time()),
                               "model": self.model_name, "data": data,
                               "usage": {"prompt_tokens": n, "total_tokens": n}})

    async def score(self, request: Request) -> Response:
        from pagedserve.engine.pooling_outputs import cosine
        from pagedserve.engine.scoring import score_pairs

        req = parse(ScoreRequest, await self.checks.read_admitted(request, "score"))
        first = [req.text_1] if isinstance(req.text_1, str) else list(req.text_1)
        second = [req.text_2] if isinstance(req.text_2, str) else list(req.text_2)
        try:
            pairs = score_pairs(len(first), len(second))
        except ValueError as e:
            raise APIError.bad_request(str(e), param="text_2") from None
        inputs = (await self.pooling_inputs(first, req.add_special_tokens, "text_1")
                  + await self.pooling_inputs(second, req.add_special_tokens, "text_2"))
        self.checks.check_base_model(req.model, "scores")
        params = self.pooling_params(req.pooling_type, None, None)
        request_id, engine_id = response_and_engine_ids(request, "score", req.request_id)
        outs = await self.pool_all(request, inputs, params, engine_id, req.priority, req.cache_salt)
        a, b = outs[:len(first)], outs[len(first):]
        data = [{"index": k, "object": "score", "score": cosine(a[i].outputs.data_bytes, b[j].outputs.data_bytes)}
                for k, (i, j) in enumerate(pairs)]
        n = sum(len(ids) for _, ids in inputs)
        return ORJSONResponse({"id": request_id, "object": "list", "created": int(time.time()),
                               "model": self.model_name, "data": data,
                               "usage": {"prompt_tokens": n, "total_tokens": n}})

    # ---- shared ---------------------------------------------------------------------------

    def pooling_params(self, pooling_type: str | None, normalize: bool | None, dimensions: int | None) -> Any:
        from pagedserve.engine.pooling_params import PoolingParams

        return PoolingParams(pooling_type=pooling_type or "last",
                             normalize=True if normalize is None else normalize, dimensions=dimensions)

    async def pooling_inputs(self, value: Any, add_special_tokens: bool, param: str) -> Inputs:
        """The inputs as token ids (texts tokenized off the loop), each within the context."""
        if isinstance(value, str):
            value = [value]
        if isinstance(value[0], int):
            inputs: Inputs = [(None, self.checks.check_ids(list(value), param))]
        elif isinstance(value[0], list):
            inputs = [(None, self.checks.check_ids(list(ids), param)) for ids in value]
        else:
            for i, t in enumerate(value):  # each text bounded before any is tokenized
                self.checks.fit_text(t, param, None, "the input" if len(value) == 1 else f"input {i}")
            ids = await asyncio.gather(*(self.engine.encode(t, add_special_tokens=add_special_tokens)
                                         for t in value))
            inputs = [(t, list(i)) for t, i in zip(value, ids)]
        ctx = self.engine.max_model_len
        for i, (_, ids) in enumerate(inputs):
            if not ids:
                raise APIError.bad_request(f"input {i} has no tokens", param=param)
            if len(ids) > ctx:
                which = f"input {i}" if len(inputs) > 1 else "the input"
                raise APIError.bad_request(
                    f"This model's maximum context length is {ctx} tokens. However, {which} has "
                    f"{len(ids)} tokens. Please reduce the length of the input.",
                    param=param, code="context_length_exceeded")
        return inputs

    async def pool_all(self, request: Request, inputs: Inputs, params: Any, engine_id: str,
                       priority: int, cache_salt: str | None = None) -> list[Any]:
        """One pooling request per input; their outputs in input order. If one is refused,
        those already submitted are aborted; a client that leaves aborts them all.
        ``cache_salt``: the prefix-cache namespace of every input (None: the unsalted one)."""
        streams: list[Any] = []
        try:
            for i, (text, ids) in enumerate(inputs):
                streams.append(self.engine.pool(ids, params, f"{engine_id}-{i}", prompt=text,
                                                priority=priority, cache_salt=cache_salt))
        except BaseException as e:
            await close_all(streams)
            self.metrics.refused(e)
            raise
        self.metrics.prompt_tokens.inc(sum(len(ids) for _, ids in inputs))
        return await self.fanout.until_disconnect(request, self._pooled_outputs(streams), streams)

    async def _pooled_outputs(self, streams: list[Any]) -> list[Any]:
        results: list[Any] = [None] * len(streams)
        async for k, out in merge_async_iterators(streams):
            if not out.finished:
                continue
            if out.outputs is None:
                self.metrics.error("engine_error")
                raise APIError(500, f"the engine failed this request: {out.error or out.finish_reason}",
                               "server_error", None, "engine_error")
            self.metrics.success("stop")
            results[k] = out
        if any(r is None for r in results):  # a stream ended without its vector
            raise APIError.internal()
        return results
