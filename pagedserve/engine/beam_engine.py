"""Beam search inside EngineCore: beams are scheduler sequences that share KV blocks.

A beam-search request starts as one sequence (the prompt, computed once). Its worker-side
sampling options ask for the top K logprobs of each step; the sampled (greedy) token is what the
worker appends. When every live beam of the request has reported a round, ``advance`` picks the
next beams (engine/beam_search.py ``select``) and reshapes the sequences:

- a beam whose parent's reported token is the chosen one keeps the parent's sequence (nothing
  travels: the worker already appended that token);
- any other chosen (parent, token) becomes a fork: a new sequence with the parent's tokens plus
  the token, on the parent's blocks (``Scheduler.fork`` → ``BlockManager.fork``: reference counts,
  no copy); at the next step it reaches the worker as a NewSeq with a private copy of the partial
  tail block it is about to write (``copy_on_write`` → StepInput ``blocks_to_copy``);
- parents nothing continues are finished (their blocks drop a reference).

A round is complete when every live beam is running with all its tokens computed and has
reported; a beam preempted after it reported loses its report and reports again once recomputed.

So k beams cost the prompt's blocks once, plus one partial block each and the blocks of what they
generate apart. Everything goes through the scheduler (budget, preemption: a preempted beam is
recomputed like any sequence and reports again) and the worker protocol; nothing blocks.

The request's output is one final RequestOutput whose CompletionOutputs are the best
``num_returned`` hypotheses, best first (index 0 = best); no deltas before.
"""
from __future__ import annotations

from collections.abc import Collection
from typing import Any, Protocol

from pagedserve.engine.beam_search import Hypothesis, LiveBeam, score, select
from pagedserve.engine.sampling_params import BeamSearchParams
from pagedserve.engine.errors import RequestRejectedError
from pagedserve.engine.outputs import CompletionOutput, RequestOutput
from pagedserve.engine.request import Request, Sequence, SeqStatus
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.contracts.messages import SampledLogprobs, SamplingOptions



class BeamHost(Protocol):
    """What beam search needs of the engine core (engine.core.EngineCore implements it): its
    scheduler and block manager, its requests, and the sequences it tracks."""

    scheduler: Any
    block_manager: Any
    requests: dict[str, Request]
    tokenizer: Any
    eos_token_ids: Collection[int]
    vocab_size: int | None
    max_model_len: int

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int] | None,
                    params: Any = None, arrival_time: float | None = None, priority: int = 0,
                    cache_salt: str | None = None) -> None: ...

    def abort_request(self, request_id: str) -> Any: ...

    def new_seq_id(self) -> int: ...

    def add_seq(self, seq: Sequence) -> None: ...

    def drop_seq(self, seq: Sequence) -> None: ...

    def finish_seq(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None: ...


class BeamGroup:
    """The beam-search state of one request (``Request.beam``)."""

    __slots__ = ("params", "stop_ids", "num_candidates", "cum", "reports", "finished", "output_sent")

    def __init__(self, params: BeamSearchParams, stop_ids: frozenset[int], vocab_size: int | None = None):
        """``stop_ids``: those that can occur (in the vocabulary); ids that cannot must change
        nothing, so they neither widen K nor are kept."""
        self.params = params
        self.stop_ids = stop_ids
        self.num_candidates = params.candidates_per_beam(len(stop_ids), vocab_size)
        self.cum: dict[int, float] = {}  # live seq id -> cum logprob
        self.reports: dict[int, tuple[int, SampledLogprobs]] = {}  # seq id -> (worker's token, logprobs)
        self.finished: list[Hypothesis] = []
        self.output_sent = False

    def report(self, seq: Sequence, token_id: int, lp: SampledLogprobs | None) -> None:
        if lp is None:
            raise RuntimeError(f"beam sequence {seq.seq_id} came back without logprobs")
        self.reports[seq.seq_id] = (token_id, lp)


def add_beam_request(core: BeamHost, request_id: str, prompt: str | None, prompt_token_ids: list[int] | None,
                     params: BeamSearchParams, arrival_time: float | None, priority: int,
                     cache_salt: str | None) -> None:
    width = params.beam_width
    max_seqs = core.scheduler.max_num_seqs
    if width > max_seqs:
        raise RequestRejectedError(f"beam_width {width} is more than the engine runs at once "
                                   f"(max_num_seqs {max_seqs}); lower it")
    vocab = core.vocab_size or core.tokenizer.vocab_size or None
    stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else frozenset(core.eos_token_ids))
    if vocab:  # an id that cannot occur must not change anything (issue 22)
        stop_ids = frozenset(t for t in stop_ids if t < vocab)
    sp = SamplingParams(n=1, temperature=0.0, max_tokens=params.max_tokens, ignore_eos=True)
    if prompt_token_ids is not None:
        _check_beam_fits(core, len(prompt_token_ids), params)
    core.add_request(request_id, prompt, prompt_token_ids, sp, arrival_time=arrival_time, priority=priority,
                     cache_salt=cache_salt)
    req = core.requests[request_id]
    try:
        _check_beam_fits(core, len(req.prompt_token_ids), params)
    except RequestRejectedError:
        core.abort_request(request_id)
        raise
    group = BeamGroup(params, stop_ids, vocab)
    req.beam = group
    seq = req.seqs[0]
    seq.options = SamplingOptions(temperature=0.0, seed=seq.options.seed, logprobs=group.num_candidates)
    group.cum[seq.seq_id] = 0.0


def _check_beam_fits(core: BeamHost, num_prompt: int, params: BeamSearchParams) -> None:
    """Every beam on private blocks: prompt, its generated tokens and a partial block. Beams
    share the prompt's blocks while they run, but a preempted beam comes back on private blocks
    and its siblings wait for it holding theirs: with room only for the shared layout it could
    never be re-admitted and the request would wait for ever (found by
    tests/engine/test_scheduler_property.py: a 3-beam request cycling through self-preemption)."""
    bm = core.block_manager
    need = params.beam_width * (bm.blocks_for(num_prompt + params.max_tokens) + 1)
    if need > bm.num_usable_blocks:
        raise RequestRejectedError(
            f"beam search over {num_prompt} prompt tokens with beam_width {params.beam_width} and max_tokens "
            f"{params.max_tokens} may need {need} KV blocks but the cache has {bm.num_usable_blocks}; "
            "lower beam_width or max_tokens, or give the KV cache more memory")


def advance(core: BeamHost, req: Request) -> None:
    """Once every live beam reported this round: choose the next beams, or finish the request."""
    g: BeamGroup = req.beam
    live = [s for s in req.seqs if not s.is_finished]
    for s in live:
        if s.seq_id in g.reports and not (s.status is SeqStatus.RUNNING and s.num_computed_tokens == s.num_tokens):
            del g.reports[s.seq_id]  # preempted since it reported: it reports again once recomputed
    if not live or any(s.seq_id not in g.reports for s in live):
        return
    first = live[0]
    generated_len = first.num_output_tokens + 1
    at_limit = generated_len >= first.max_tokens or first.num_tokens + 1 >= core.max_model_len
    beams = [LiveBeam(s, g.cum[s.seq_id], s.output_token_ids, g.reports[s.seq_id][1].top) for s in live]
    sel = select(beams, g.params.beam_width, g.finished, generated_len, g.stop_ids, g.params.length_penalty,
                 at_limit, g.num_candidates)
    g.finished = sel.finished
    reported = {sid: tok for sid, (tok, _) in g.reports.items()}
    g.reports.clear()
    if sel.done:
        for s in live:
            core.finish_seq(s, "length")
        return

    kept: set[int] = set()
    plan: list[tuple[Sequence, int, float, bool]] = []  # (parent, token, cum, continues the parent)
    for parent, tok, cum in sel.next_beams:
        # The worker already appended its own token to the parent: only that token continues it.
        reuse = parent.seq_id not in kept and reported[parent.seq_id] == tok
        if reuse:
            kept.add(parent.seq_id)
        plan.append((parent, tok, cum, reuse))

    new_seqs: list[Sequence] = []
    g.cum = {}
    for parent, tok, cum, reuse in plan:  # forks first: they need the parents' blocks
        if reuse:
            new_seqs.append(parent)
            continue
        child = _fork(core, parent, tok)
        new_seqs.append(child)
        g.cum[child.seq_id] = cum
    for s in live:
        if s.seq_id not in kept:
            core.scheduler.finish(s)
            core.drop_seq(s)
    for parent, tok, cum, reuse in plan:
        if reuse:
            parent.token_ids.append(tok)
            g.cum[parent.seq_id] = cum
    for i, s in enumerate(new_seqs):
        s.index = i
    req.seqs = new_seqs


def _fork(core: BeamHost, parent: Sequence, token_id: int) -> Sequence:
    child = Sequence(
        seq_id=core.new_seq_id(), request=parent.request, index=parent.index,
        token_ids=parent.token_ids + [token_id], num_prompt_tokens=parent.num_prompt_tokens,
        options=parent.options, detok=parent.detok,  # beams never stream text: the detokenizer stays idle
        max_tokens=parent.max_tokens,
    )
    child.block_hashes = list(parent.block_hashes)  # digests of full blocks: a common prefix
    child.use_prefix_cache = parent.use_prefix_cache
    core.add_seq(child)
    core.scheduler.fork(parent, child)  # every live beam is running and computed (see advance)
    return child


def make_output(core: BeamHost, req: Request) -> RequestOutput | None:
    """The request's only output, once it is finished: the best hypotheses, best first."""
    g: BeamGroup = req.beam
    if not req.finished or g.output_sent:
        return None
    g.output_sent = True
    hyps = list(g.finished)
    reason = next((s.finish_reason for s in req.seqs if s.finish_reason not in (None, "length")), None)
    if reason is not None:  # aborted or failed: the finished hypotheses and the live beams so far
        lp = g.params.length_penalty
        for s in req.seqs:
            n = s.num_output_tokens
            cum = g.cum.get(s.seq_id, 0.0)
            hyps.append(Hypothesis(s.output_token_ids, cum, score(cum, n, lp) if n else cum, reason))
        hyps.sort(key=lambda h: -h.score)
    outs = []
    for i, h in enumerate(hyps[:g.params.num_returned]):
        outs.append(CompletionOutput(
            index=i, text=core.tokenizer.decode(h.token_ids, skip_special_tokens=True),
            token_ids=list(h.token_ids), cumulative_logprob=h.cum_logprob, finish_reason=h.finish_reason,
            stop_reason=h.token_ids[-1] if h.finish_reason == "stop" and h.token_ids
            and h.token_ids[-1] not in core.eos_token_ids else None))
    if not outs:  # aborted before any round: one empty beam
        outs.append(CompletionOutput(index=0, text="", token_ids=[], cumulative_logprob=0.0,
                                     finish_reason=reason or "abort"))
    return RequestOutput(request_id=req.request_id, prompt=req.prompt, prompt_token_ids=req.prompt_token_ids,
                         prompt_logprobs=None, outputs=outs, finished=True, metrics=req.metrics,
                         num_cached_tokens=req.num_cached_tokens, error=req.error)
