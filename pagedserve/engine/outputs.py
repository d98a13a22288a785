"""What the engine hands back, shaped like vLLM's outputs.

The core emits DELTAS: each ``RequestOutput`` of a request carries only what is new since the
previous one (``text``, ``token_ids`` and ``logprobs`` of each ``CompletionOutput`` that
changed), ``finished=True`` on the last one. ``merge_delta`` folds deltas into the cumulative
form (offline API) or folds a newer delta into a pending one (a lagging consumer).

Shapes:
- ``CompletionOutput.logprobs``: None unless the request asked for ``logprobs``; else one entry
  per generated token: ``dict[token_id, Logprob]`` holding the sampled token and the top-N
  alternatives (the sampled token may also be one of them, so the dict has N or N + 1 keys).
- ``RequestOutput.prompt_logprobs``: None unless asked; else one entry per prompt position, the
  first being None (nothing predicts the first token), the others shaped as above with the
  actual prompt token. Sent whole with the first delta that carries a token.
- ``Logprob.rank``: 1-based rank among the returned alternatives; None when the token is not
  among the top-N (its exact rank is not computed).
- ``cumulative_logprob``: sum of the sampled tokens' logprobs so far (not a delta); None when
  logprobs were not asked for.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


TokenLogprobs = dict[int, Logprob]


@dataclass(slots=True)
class RequestMetrics:
    """time.monotonic() stamps; None until the event happened."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None (running)
    stop_reason: int | str | None = None  # matched stop string or stop token id; None for EOS
    # time.monotonic() when each token of ``token_ids`` was produced (set by AsyncEngine as the
    # step's output is processed): latency metrics stay engine-side even when a slow consumer
    # reads several merged deltas at once. None when not stamped (offline API).
    token_times: list[float] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[TokenLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (first sequence)
    error: str | None = field(default=None)  # set when finish_reason is "error"
    error_from_request: bool = False  # the request's constraints caused it (a 400), not the engine
    # with error_from_request, the error code the client sees when it is not the default
    # "constraints_unsatisfiable" (a grammar compile past --grammar-compile-timeout: its flag's name)
    error_code: str | None = None


def merge_delta(acc: RequestOutput, delta: RequestOutput) -> RequestOutput:
    """Fold ``delta`` into ``acc`` in place and return ``acc``. ``acc`` must own its lists (the
    core makes fresh ones for each delta): they are extended, not copied, so folding N deltas
    costs O(N), not O(N^2)."""
    by_index = {c.index: c for c in acc.outputs}
    for c in delta.outputs:
        have = by_index.get(c.index)
        if have is None:
            have = CompletionOutput(c.index, "", [], None, [] if c.logprobs is not None else None)
            by_index[c.index] = have
            acc.outputs.append(have)
        have.text += c.text
        have.token_ids.extend(c.token_ids)
        if c.logprobs is not None:
            if have.logprobs is None:
                have.logprobs = []
            have.logprobs.extend(c.logprobs)
        if c.token_times is not None:
            if have.token_times is None:
                have.token_times = []
            have.token_times.extend(c.token_times)
        if c.cumulative_logprob is not None:
            have.cumulative_logprob = c.cumulative_logprob
        have.finish_reason = c.finish_reason
        have.stop_reason = c.stop_reason
    acc.outputs.sort(key=lambda c: c.index)
    if delta.prompt_logprobs is not None:
        acc.prompt_logprobs = delta.prompt_logprobs
    acc.finished = delta.finished
    acc.metrics = delta.metrics or acc.metrics
    acc.num_cached_tokens = max(acc.num_cached_tokens, delta.num_cached_tokens)
    acc.error = delta.error or acc.error
    acc.error_from_request = delta.error_from_request or acc.error_from_request
    acc.error_code = delta.error_code or acc.error_code
    return acc
