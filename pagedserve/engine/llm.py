"""The offline API, as vLLM users know it: ``LLM(model).generate(prompts, params)``."""
from __future__ import annotations

import itertools
from collections.abc import Sequence

from typing import TYPE_CHECKING

from pagedserve.engine.lora_request import LoRARequest
from pagedserve.engine.outputs import RequestOutput, merge_delta
from pagedserve.engine.pooling_outputs import (
    EmbeddingRequestOutput, PoolingRequestOutput, ScoringOutput, ScoringRequestOutput, cosine)
from pagedserve.engine.pooling_params import PoolingParams
from pagedserve.engine.sampling_params import BeamSearchParams, SamplingParams
from pagedserve.engine.scoring import score_pairs
from pagedserve.contracts.config import EngineConfig

# Show a progress bar only when a run is long enough to want one.
TQDM_MIN_REQUESTS = 16

if TYPE_CHECKING:
    from pagedserve.engine.beam_search import BeamSearchOutput

Prompt = str | list[int] | dict


class LLM:
    """Offline engine. ``model=None`` is the bundled default model (SmolLM2-135M-Instruct).
    ``engine_options`` are named as the CLI flags are (``num_gpu_blocks_override``, ``swap_space``,
    ...; contracts/config.py OPTION_FIELDS) and default to the config fields'; an old name is
    refused with the new one. ``encode`` / ``embed`` / ``score`` serve embeddings from the same
    model, as vLLM's: the requests go through the same engine core, scheduler and KV cache
    (engine/pooling_requests.py)."""

    def __init__(self, model: str | None = None, **engine_options):
        from pagedserve.engine.bootstrap import build_engine

        self.config = EngineConfig.from_options(model=model, **engine_options)
        self.parts = build_engine(self.config)
        self.tokenizer = self.parts.tokenizer
        self._ids = itertools.count()

    @property
    def core(self):
        return self.parts.core

    def get_tokenizer(self):
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What a call without sampling params samples with: the model's recommended settings
        (--generation-config; engine/bootstrap.sampling_defaults), else SamplingParams()'s (vLLM's)."""
        return SamplingParams(**self.parts.sampling_defaults)

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool | None = None, priority: Sequence[int] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Generate for each prompt (text, token ids, or {"prompt_token_ids": [...]} / {"prompt": ...}),
        in input order. A dict prompt may carry "cache_salt" (as vLLM's): only prompts with an
        equal salt share prefix-cache blocks. ``lora_request``: one adapter for every prompt, or
        one (or None) per prompt (``LLM(enable_lora=True)``)."""
        prompt_list = self._as_prompt_list(prompts)
        params = self._as_params_list(sampling_params, len(prompt_list))
        loras = self._as_lora_list(lora_request, len(prompt_list))
        request_ids = []
        for i, (prompt, sp) in enumerate(zip(prompt_list, params)):
            text, ids = self._tokenize(prompt)
            rid = str(next(self._ids))
            salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
            self.core.add_request(rid, text, ids, sp, priority=priority[i] if priority else 0,
                                  cache_salt=salt, lora_request=loras[i])
            request_ids.append(rid)
        return self._run(request_ids, use_tqdm)

    @staticmethod
    def _as_lora_list(lora_request, n: int) -> list[LoRARequest | None]:
        if lora_request is None or isinstance(lora_request, LoRARequest):
            return [lora_request] * n
        loras = list(lora_request)
        if len(loras) != n:
            raise ValueError(f"lora_request has {len(loras)} entries for {n} prompts: give one per prompt")
        return loras

    def beam_search(self, prompts: Prompt | Sequence[Prompt], params: BeamSearchParams,
                    use_tqdm: bool | None = None) -> list["BeamSearchOutput"]:
        """Beam search per prompt (engine/beam_search.py for the rule); each result holds the
        returned beams best first. As vLLM's: a beam's ``tokens`` are prompt + generated, its
        ``text`` their decoded text."""
        from pagedserve.engine.beam_search import BeamSearchOutput, BeamSequence, score

        prompt_list = self._as_prompt_list(prompts)
        request_ids = []
        for prompt in prompt_list:
            text, ids = self._tokenize(prompt)
            rid = str(next(self._ids))
            salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
            self.core.add_request(rid, text, ids, params, cache_salt=salt)
            request_ids.append(rid)
        results = []
        for out in self._run(request_ids, use_tqdm):
            seqs = []
            for c in out.outputs:
                tokens = list(out.prompt_token_ids) + list(c.token_ids)
                n = len(c.token_ids)
                seqs.append(BeamSequence(
                    tokens=tokens, text=self.tokenizer.decode(tokens, skip_special_tokens=False),
                    cum_logprob=c.cumulative_logprob, output_tokens=list(c.token_ids), output_text=c.text,
                    score=score(c.cumulative_logprob, n, params.length_penalty) if n else c.cumulative_logprob,
                    finish_reason=c.finish_reason))
            results.append(BeamSearchOutput(seqs))
        return results

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False) -> list[RequestOutput]:
        """One conversation (a list of messages) or a list of conversations, via the chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            {"prompt": self.tokenizer.apply_chat_template(
                conv, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message),
             "add_special_tokens": False}
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None):
        """Yield one request's RequestOutput deltas as they are generated (for terminals)."""
        text, ids = self._tokenize(prompt)
        rid = str(next(self._ids))
        self.core.add_request(rid, text, ids, sampling_params or self.get_default_sampling_params())
        try:
            while self.core.has_unfinished():
                for delta in self.core.step():
                    if delta.request_id == rid:
                        yield delta
        finally:
            self.core.abort_request(rid)

    # ---- pooling (embeddings) ---------------------------------------------------------------

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


    def shutdown(self) -> None:
        if self.parts is not None:
            self.parts.executor.shutdown()
            self.parts = None

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ---- helpers --------------------------------------------------------------------------

    @staticmethod
    def _as_prompt_list(prompts) -> list[Prompt]:
        if isinstance(prompts, (str, dict)):
            return [prompts]
        if prompts and isinstance(prompts[0], int):
            return [list(prompts)]
        return list(prompts)

    def _as_params_list(self, sampling_params, n: int) -> list[SamplingParams]:
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        if len(sampling_params) != n:
            raise ValueError(f"got {len(sampling_params)} sampling params for {n} prompts")
        return list(sampling_params)

    def _tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            text = prompt["prompt"]
            return text, self.tokenizer.encode(text, add_special_tokens=prompt.get("add_special_tokens", True))
        return None, list(prompt)

    def _run(self, request_ids: list[str], use_tqdm: bool | None) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        if use_tqdm is None:
            use_tqdm = len(request_ids) >= TQDM_MIN_REQUESTS
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(request_ids), desc="Generating", unit="req", dynamic_ncols=True)
        try:
            while self.core.has_unfinished():
                for delta in self.core.step():
                    acc = results.get(delta.request_id)
                    results[delta.request_id] = delta if acc is None else merge_delta(acc, delta)
                    if delta.finished and bar is not None:
                        bar.update(1)
        except BaseException:
            for rid in request_ids:
                self.core.abort_request(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [results[rid] for rid in request_ids]


def _params_list(pooling_params, n: int) -> list[PoolingParams]:
    if pooling_params is None:
        pooling_params = PoolingParams()
    if isinstance(pooling_params, PoolingParams):
        return [pooling_params] * n
    if len(pooling_params) != n:
        raise ValueError(f"got {len(pooling_params)} pooling params for {n} prompts")
    return list(pooling_params)
