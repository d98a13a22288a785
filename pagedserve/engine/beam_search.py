"""Beam search: its outputs and the choice of the next beams (pure, no engine); its parameters,
BeamSearchParams, are in engine/sampling_params.py.

The beams of a request are ordinary sequences of the scheduler that share blocks
(engine/beam_engine.py drives them); this module only decides, once every live beam has
reported the top tokens of its next position, which (beam, token) pairs go on and which
hypotheses are finished. The rule is transformers' ``generate(num_beams=k, do_sample=False)``
(``early_stopping=False``, its default):

- candidates are the K = max(2, 1 + number of stop ids) * k best (beam, token) pairs by
  ``cum_logprob + logprob`` (each beam reports its own top K, so the union holds the global top K);
- the best k candidates that do not end (EOS / a stop token, unless ``ignore_eos``; or the
  length limit) are the next beams;
- a candidate that ends is kept as a finished hypothesis only if it ranks among the first k, with
  the score ``cum_logprob / generated_len ** length_penalty`` (generated_len counts the new tokens,
  the EOS included); at most k finished hypotheses are kept, the best;
- the search stops at the length limit, or once k hypotheses are finished and the best live beam's
  ``cum_logprob / generated_len ** length_penalty`` does not beat the worst of them;
- the result is the finished hypotheses, best score first.

Logprobs are the model's raw log-softmax (as vLLM's beam search with its default
``logprobs_mode``): ``temperature`` is accepted for API compatibility and does not change the beams.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# The parameters live with SamplingParams (as vLLM keeps them in vllm.sampling_params).


@dataclass(slots=True)
class BeamSequence:
    """One returned beam, as vLLM's: ``tokens`` = prompt + generated, ``text`` = their decoded
    text (special tokens included); ``output_*`` hold the generated part alone."""

    tokens: list[int]
    text: str
    cum_logprob: float
    output_tokens: list[int]
    output_text: str
    score: float  # cum_logprob / len(output_tokens) ** length_penalty: the ranking key
    finish_reason: str | None  # "stop" (EOS / stop token) | "length" | "abort" | "error"


@dataclass(slots=True)
class BeamSearchOutput:
    sequences: list[BeamSequence]  # best first


@dataclass(slots=True)
class Hypothesis:
    token_ids: list[int]  # generated tokens (the EOS or stop token included)
    cum_logprob: float
    score: float
    finish_reason: str


@dataclass(slots=True)
class LiveBeam:
    """A beam that reported its next-token candidates this round."""

    key: object  # whatever identifies it for the caller (the engine: its Sequence)
    cum_logprob: float
    token_ids: list[int]  # generated so far
    top: Sequence[tuple[int, float]]  # (token, logprob), best first


@dataclass(slots=True)
class Selection:
    next_beams: list[tuple[object, int, float]]  # (parent key, token, new cum_logprob), best first
    finished: list[Hypothesis]  # all finished hypotheses kept so far, best first
    done: bool


def score(cum_logprob: float, generated_len: int, length_penalty: float) -> float:
    return cum_logprob / (generated_len ** length_penalty)


def select(beams: list[LiveBeam], width: int, finished: list[Hypothesis], generated_len: int,
           stop_ids: frozenset[int], length_penalty: float, at_limit: bool, num_candidates: int) -> Selection:
    """One round: ``generated_len`` is the length of every beam once its new token is added;
    ``at_limit`` means that token is the last one allowed (max_tokens, context)."""
    cands = []
    for b_idx, b in enumerate(beams):
        for rank, (tok, lp) in enumerate(b.top[:num_candidates]):
            cands.append((b.cum_logprob + lp, b_idx, rank, tok))
    cands.sort(key=lambda c: (-c[0], c[1], c[2]))
    cands = cands[:num_candidates]
    finished = list(finished)
    next_beams: list[tuple[object, int, float]] = []
    for rank, (cum, b_idx, _, tok) in enumerate(cands):
        ends = at_limit or tok in stop_ids
        if not ends:
            if len(next_beams) < width:
                next_beams.append((beams[b_idx].key, tok, cum))
        elif rank < width:
            finished.append(Hypothesis(beams[b_idx].token_ids + [tok], cum,
                                       score(cum, generated_len, length_penalty),
                                       "stop" if tok in stop_ids else "length"))
    finished.sort(key=lambda h: -h.score)
    del finished[width:]
    done = at_limit or not next_beams
    if not done and len(finished) >= width:
        best_live = score(next_beams[0][2], generated_len, length_penalty)
        done = best_live <= finished[-1].score
    return Selection(next_beams, finished, done)
