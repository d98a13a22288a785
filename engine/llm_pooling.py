"""The offline pooling API (``LLM.encode`` / ``LLM.embed`` / ``LLM.score``), as vLLM's.

Any model the LLM loaded serves these beside ``generate``: the requests go through the same
engine core, scheduler and KV cache (engine/pooling_requests.py).
"""
from __future__ import annotations

from collections.abc import Sequence

from engine.pooling_outputs import (
    EmbeddingRequestOutput, PoolingRequestOutput, ScoringOutput, ScoringRequestOutput, cosine)
from engine.pooling_params import PoolingParams
from engine.scoring import score_pairs


class PoolingLLM:
    """Mixin of engine.llm.LLM (uses its core, prompt helpers and run loop)."""

    def encode(self, prompts, pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
               use_tqdm: bool | None = None, priority: Sequence[int] | None = None) -> list[PoolingRequestOutput]:
        """One pooled vector per prompt (text, token ids, or a {"prompt"/"prompt_token_ids"} dict,
        which may carry "cache_salt"), in input order. ``outputs.data`` holds the floats;
        ``outputs`` is None (and ``error`` says why) for a request that failed."""
        prompt_list = self._as_prompt_list(prompts)
        params = _params_list(pooling_params, len(prompt_list))
        request_ids = []
        for i, (prompt, pp) in enumerate(zip(prompt_list, params)):
            text, ids = self._tokenize(prompt)
            rid = str(next(self._ids))
            salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
            self.core.add_request(rid, text, ids, pp, priority=priority[i] if priority else 0,
                                  cache_salt=salt)
            request_ids.append(rid)
        return self._run(request_ids, use_tqdm)

    def embed(self, prompts, pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
              use_tqdm: bool | None = None, priority: Sequence[int] | None = None) -> list[EmbeddingRequestOutput]:
        """``encode`` as embeddings: ``outputs.embedding`` is a list of floats (raises if a
        request failed)."""
        return [EmbeddingRequestOutput.from_base(o)
                for o in self.encode(prompts, pooling_params, use_tqdm=use_tqdm, priority=priority)]

    def score(self, text_1, text_2, pooling_params: PoolingParams | None = None,
              use_tqdm: bool | None = None) -> list[ScoringRequestOutput]:
        """Cosine similarity of the embeddings of each pair: one text against one or many, or
        two lists of equal length element by element (``engine.scoring.score_pairs``)."""
        first = self._as_prompt_list(text_1)
        second = self._as_prompt_list(text_2)
        pairs = score_pairs(len(first), len(second))
        outs = self.encode(first + second, pooling_params, use_tqdm=use_tqdm)
        for o in outs:
            if o.outputs is None:
                raise RuntimeError(f"request {o.request_id} failed: {o.error or o.finish_reason}")
        a, b = outs[:len(first)], outs[len(first):]
        return [ScoringRequestOutput(f"{a[i].request_id}-{b[j].request_id}",
                                     ScoringOutput(cosine(a[i].outputs.data_bytes, b[j].outputs.data_bytes)),
                                     a[i].prompt_token_ids + b[j].prompt_token_ids)
                for i, j in pairs]


def _params_list(pooling_params, n: int) -> list[PoolingParams]:
    if pooling_params is None:
        pooling_params = PoolingParams()
    if isinstance(pooling_params, PoolingParams):
        return [pooling_params] * n
    if len(pooling_params) != n:
        raise ValueError(f"got {len(pooling_params)} pooling params for {n} prompts")
    return list(pooling_params)
