"""Requests and their sequences, as the engine tracks them.

A request with ``n`` > 1 owns n sequences; each is scheduled on its own (its own seq id, block
table and worker state) and they share the prompt's full blocks through the prefix cache.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from pagedserve.engine.detokenizer import IncrementalDetokenizer
from pagedserve.engine.outputs import RequestMetrics, TokenLogprobs
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.contracts.messages import SamplingOptions


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    seq_id: int
    request: "Request"
    index: int  # position among the request's n sequences
    token_ids: list[int]  # prompt + generated, exactly as the worker holds them
    num_prompt_tokens: int
    options: SamplingOptions
    detok: IncrementalDetokenizer
    max_tokens: int  # effective limit of generated tokens (context and cache included)
    status: SeqStatus = SeqStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V is (or, once this step runs, will be) cached
    block_hashes: list[bytes] = field(default_factory=list)  # prefix-cache digests of full blocks
    on_worker: bool = False  # the worker holds state for this seq id
    use_prefix_cache: bool = True
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] | None = None
    cumulative_logprob: float | None = None
    num_sent_tokens: int = 0  # generated tokens already reported in a delta
    finish_sent: bool = False
    num_preemptions: int = 0
    # Token constraint (engine/structured_output SeqConstraint): grammar matcher, allowed ids,
    # bad words; None for a free sequence.
    constraint: Any = None
    # contracts.messages.PoolingOptions of a pooling (embedding) sequence: prefill only, no tokens.
    pooling: Any = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    @property
    def cache_salt(self) -> str | None:
        return self.request.cache_salt

    @property
    def lora_key(self) -> bytes:
        lora = self.request.lora_request
        return b"" if lora is None else lora.cache_key()

    @property
    def lora_request(self):
        return self.request.lora_request

    @property
    def arrival_time(self) -> float:
        return self.request.metrics.arrival_time

    @property
    def priority(self) -> int:
        return self.request.priority

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, req={self.request.request_id!r}, {self.status.value}, "
                f"tokens={self.num_tokens}, computed={self.num_computed_tokens})")


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    metrics: RequestMetrics
    seqs: list[Sequence] = field(default_factory=list)
    # None unless asked; index 0 stays None, index p holds position p's entry once computed.
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    prompt_logprobs_sent: bool = False
    prefill_done: bool = False  # some sequence computed the whole prompt (siblings may now hit it)
    num_cached_tokens: int = 0
    finished: bool = False
    error: str | None = None
    # The error is the request's own doing (its constraints admit no token), not the engine's:
    # the server answers 400, not 500.
    error_from_request: bool = False
    error_code: str | None = None  # with error_from_request: the client's error code (None: the default)
    # Prefix-cache tenant key: only requests with an equal salt (or both None) share KV blocks.
    cache_salt: str | None = None
    # The LoRA adapter (engine.lora_request.LoRARequest) the request runs with; None = base model.
    # Part of its identity: it keys the prefix cache and survives preemption with the request.
    lora_request: Any = None
    # Set while the request's grammar compiles: its sequences are not in the scheduler yet.
    grammar_future: Any = None
    compiling: bool = False
    # A pooling request (params is PoolingParams): its vector, float32 bytes, once computed.
    pooled: bytes | None = None
    # Beam search state (engine/beam_engine.py BeamGroup); None for sampling requests.
    beam: Any = None
    # params.stop_token_ids as a set, built once: every generated token is looked up in it.
    stop_token_set: frozenset[int] = frozenset()

    @property
    def all_finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)
