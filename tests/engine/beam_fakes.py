"""A fake greedy model with real next-token alternatives, and a reference beam search over it
(the pure ``select`` rule looped over whole sequences: no scheduler, no blocks, no worker)."""
from __future__ import annotations

import math
import random

from pagedserve.engine.beam_search import LiveBeam, select
from pagedserve.engine.sampling_params import BeamSearchParams
from tests.engine.fakes import BYTE0, EOS

CANDIDATES = [BYTE0 + 65 + i for i in range(10)] + [EOS]


def fake_top(tokens, options=None, num_prompt=0, eos_weight: float = 0.3) -> list[tuple[int, float]]:
    """Logprobs over 11 tokens (EOS among them), a deterministic function of the sequence."""
    rng = random.Random(",".join(map(str, tokens)))
    weights = [rng.random() ** 3 + 1e-3 for _ in CANDIDATES]
    weights[-1] *= eos_weight
    total = sum(weights)
    pairs = [(t, math.log(w / total)) for t, w in zip(CANDIDATES, weights)]
    pairs.sort(key=lambda p: (-p[1], p[0]))
    return pairs


def reference_beam_search(prompt: list[int], params: BeamSearchParams, eos_ids=(EOS,), top=fake_top,
                          max_model_len: int | None = None):
    stop = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else frozenset(eos_ids))
    k = params.beam_width
    K = params.candidates_per_beam(len(stop))
    beams = [(0.0, [])]
    finished = []
    for gen_len in range(1, params.max_tokens + 1):
        live = [LiveBeam(i, cum, toks, top(prompt + toks)) for i, (cum, toks) in enumerate(beams)]
        at_limit = gen_len == params.max_tokens or (
            max_model_len is not None and len(prompt) + gen_len >= max_model_len)
        sel = select(live, k, finished, gen_len, stop, params.length_penalty, at_limit, K)
        finished = sel.finished
        if sel.done:
            break
        beams = [(cum, beams[i][1] + [tok]) for i, tok, cum in sel.next_beams]
    return finished[:params.num_returned]
