"""Pooling requests (embeddings) in the engine core: the same scheduler, blocks and steps as
generation, but prefill only.

A pooling request is one sequence whose prompt is scheduled like any other (chunked under the
token budget, mixed with decodes, preempted and recomputed when blocks run out). It carries
``PoolingOptions`` to the worker in its ``NewSeq``; when its prompt has been computed the
worker returns the pooled vector in ``StepOutput.pooled`` instead of a sampled token, and the
core finishes the request at once, which frees its blocks (full ones stay in the prefix cache
for later prompts with the same start). "last" pooling may start from a prefix-cache hit;
"mean" and "cls" need every position computed, so they do not.
"""
from __future__ import annotations

import time
from collections.abc import Callable

from pagedserve.engine.errors import RequestRejectedError
from pagedserve.engine.outputs import RequestMetrics
from pagedserve.engine.pooling_outputs import PoolingOutput, PoolingRequestOutput
from pagedserve.engine.pooling_params import PoolingParams
from pagedserve.engine.kv_blocks import BlockManager
from pagedserve.engine.request import Request, Sequence, SeqStatus
from pagedserve.engine.scheduler import Scheduler
from pagedserve.contracts.messages import PooledOutput, SamplingOptions

_NO_SAMPLING = SamplingOptions()


class _NoText:
    """The detokenizer slot of a sequence that generates no text."""

    stopped = True

    def take_delta(self) -> str:
        return ""

    def flush(self) -> None:
        pass


_NO_TEXT = _NoText()


class PoolingRequests:
    """EngineCore's pooling requests, given what they share with generation: the scheduler and block
    manager, the core's request and sequence maps (``requests``, ``seqs``: the same dicts, which
    this object adds to), its sequence ids (``new_seq_id``) and the way it finishes a sequence
    (``finish_seq``); ``hidden_size`` (None: unknown) bounds ``dimensions``."""

    def __init__(self, max_model_len: int, vocab_size: int | None, hidden_size: int | None,
                 block_manager: BlockManager, scheduler: Scheduler, requests: dict[str, Request],
                 seqs: dict[int, Sequence], new_seq_id: Callable[[], int],
                 finish_seq: Callable[[Sequence, str], None]) -> None:
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.block_manager = block_manager
        self.scheduler = scheduler
        self.requests = requests
        self.seqs = seqs
        self.new_seq_id = new_seq_id
        self.finish_seq = finish_seq

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
            params: PoolingParams, arrival_time: float | None = None,
            priority: int = 0, cache_salt: str | None = None) -> None:
        """Called by ``EngineCore.add_request`` when its params are PoolingParams (ids already tokenized)."""
        self.check_fits(prompt_token_ids, params)
        num_prompt = len(prompt_token_ids)
        req = Request(
            request_id=request_id, prompt=prompt, prompt_token_ids=prompt_token_ids, params=params,
            priority=int(priority),
            metrics=RequestMetrics(arrival_time=arrival_time if arrival_time is not None else time.monotonic()),
            cache_salt=cache_salt,
        )
        seq = Sequence(seq_id=self.new_seq_id(), request=req, index=0, token_ids=list(prompt_token_ids),
                       num_prompt_tokens=num_prompt, options=_NO_SAMPLING, detok=_NO_TEXT, max_tokens=0)
        seq.use_prefix_cache = params.uses_prefix_cache
        seq.pooling = params.to_pooling_options()
        req.seqs.append(seq)
        self.requests[request_id] = req
        self.seqs[seq.seq_id] = seq
        self.scheduler.add(seq)

    def check_fits(self, ids: list[int], params: PoolingParams) -> None:
        n = len(ids)
        if n == 0:
            raise RequestRejectedError("the input is empty: give at least one token")
        if any(not isinstance(t, int) or t < 0 or t >= 2**63 for t in ids):
            raise RequestRejectedError("input token ids must be integers >= 0 (and below 2**63)")
        if self.vocab_size is not None and max(ids) >= self.vocab_size:
            raise RequestRejectedError(
                f"input token id {max(ids)} is out of range: the vocabulary has {self.vocab_size} "
                f"tokens (ids 0..{self.vocab_size - 1})")
        if n > self.max_model_len:
            raise RequestRejectedError(
                f"the input has {n} tokens but the model's context (max_model_len) is "
                f"{self.max_model_len}; shorten the input")
        hidden = self.hidden_size
        if params.dimensions is not None and hidden is not None and params.dimensions > hidden:
            err = RequestRejectedError(f"dimensions is {params.dimensions} but the model's embeddings "
                                       f"have {hidden} values; ask for at most {hidden}")
            err.param = "dimensions"
            raise err
        bm = self.block_manager
        need = bm.blocks_for(n)
        if need > bm.num_usable_blocks:
            raise RequestRejectedError(
                f"the input ({n} tokens) needs {need} KV blocks of {bm.block_size} tokens but the "
                f"whole cache has {bm.num_usable_blocks}; shorten the input or give the KV cache "
                "more memory")

    def take_pooled(self, pooled: list[PooledOutput], touched: dict[str, Request]) -> None:
        """Finish each pooling sequence whose vector came back (freeing its blocks now)."""
        now = time.monotonic()
        for p in pooled:
            seq = self.seqs.get(p.seq_id)
            if seq is None or seq.status is not SeqStatus.RUNNING or seq.pooling is None:
                continue  # aborted while the step ran
            req = seq.request
            req.pooled = bytes(p.data_buf)
            req.metrics.first_token_time = req.metrics.last_token_time = now
            self.finish_seq(seq, "stop")
            touched[req.request_id] = req

    def make_output(self, req: Request) -> PoolingRequestOutput | None:
        """The one output of a pooling request, once it has finished (pooled, aborted, failed)."""
        seq = req.seqs[0]
        if not seq.is_finished or seq.finish_sent:
            return None
        seq.finish_sent = True
        return PoolingRequestOutput(
            request_id=req.request_id,
            outputs=PoolingOutput(req.pooled) if req.pooled is not None else None,
            prompt_token_ids=req.prompt_token_ids,
            finished=req.finished,
            prompt=req.prompt,
            finish_reason=seq.finish_reason,
            metrics=req.metrics,
            num_cached_tokens=req.num_cached_tokens,
            error=req.error,
        )


def hidden_size(hf_config: dict | None) -> int | None:
    """Length of an embedding before ``dimensions`` (the model's hidden size), None when unknown."""
    hf = hf_config or {}
    size = hf.get("hidden_size") or hf.get("n_embd")
    return int(size) if size else None
