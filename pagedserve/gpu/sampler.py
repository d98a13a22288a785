"""Token sampling for one step: one batched pass over the logits of every sequence.

This module decides which rows go which way (greedy, plain draw, top-k / top-p); the work is in
gpu.sampling_logits (bias, min_tokens, penalties, non-finite repair), gpu.sampling_draws (the
inverse-CDF draws), gpu.sampling_logprobs (logprobs) and gpu.sampling_host (host <-> device).
Plain rows (``plain_row``: greedy or a full-vocabulary draw, nothing else asked) go to one C pass
(kernels.sample_cpu) that makes the same choice from the same uniform number; the rest take the
torch path below (``_sample_general``).

Order of operations (as vLLM v1 defines them):
  0. the token bitmask of constrained rows (structured outputs, allowed_token_ids, bad_words;
     gpu.sampling_mask): masked tokens become -inf, so every later step sees only allowed ones;
  1. logprobs, when asked, are taken from the raw model output (``log_softmax(logits)``);
  2. ``logit_bias`` is added;
  3. ``min_tokens``: the blocked ids get -inf while fewer than ``min_tokens`` tokens were generated;
  4. penalties: repetition (over prompt and generated tokens: positive logits divided, negative
     multiplied), then frequency (``- f * count``) and presence (``- p * [count > 0]``), both
     counted over the generated tokens only;
  5. temperature 0 (below 1e-5) is greedy: argmax of the processed logits;
  6. otherwise logits are divided by the temperature, min-p, top-k and top-p filter them, and one
     token is drawn.

Determinism: a row's draw uses one uniform number that is a pure function of (seed, number of
tokens generated so far), and inverse-CDF sampling over that row's own probabilities. So a
seeded sequence gets the same token whatever else is in the batch and after a preemption (which
keeps its generated tokens). One number per row instead of a Gumbel/exponential noise vector of
vocabulary size makes a seeded batch about ten times cheaper on CPU.

``Sampler.sample`` may modify the ``logits`` tensor it is given in place.

Non-finite logits: one ``amax`` per step finds rows with +inf or NaN (or nothing finite);
only those rows are rewritten (``repair_non_finite`` documents the policy), so one request's
values never fail the step for the others and finite rows draw exactly as before.

Devices: every tensor made here lives on the logits' device (on CUDA a tensor made without
``device=`` would be a CPU tensor and the op mixing it with the logits fails). Host values
become tensors only through ``on_device(like, data)`` (pinned, non-blocking on CUDA); factories
take ``device=<input>.device``.

One host read per step (issue 24): on CUDA every read of a device value waits for the GPU. A
step draws without looking (every index stays in range whatever the values), then reads back in
one copy (``fetch_to_host``) the tokens, each row's flag "finite and its top-p nucleus inside
the first candidates", and the logprobs. Rows whose flag is off (rare) are repaired and drawn
again by ``_redo`` with reads of their own; a row's draw depends on that row alone, so the
others keep their tokens. Penalties take a dense pass on CUDA for the same reason
(gpu.sampling_logits.dense_penalties). More than one read only for those rare rows; prompt
logprobs (``compute_prompt_logprobs``) make one copy of their own.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from pagedserve.contracts.messages import SampledLogprobs, SamplingOptions
from pagedserve.gpu.sampling_draws import (
    draw_from_candidates, draw_full_vocab, draw_top_p_by_histogram, seeded_uniform)
from pagedserve.gpu import sampling_host
from pagedserve.gpu.sampling_host import fetch_to_host, on_device, select_rows, spread_rows
from pagedserve.gpu.sampling_logits import (  # noqa: F401  (process_logits: re-exported)
    LogitsPrep, changes_logits, needs_prep, num_generated, process_logits, repair_non_finite)
from pagedserve.gpu.sampling_logprobs import (  # noqa: F401  (compute_prompt_logprobs: re-exported)
    LogprobReadback, compute_prompt_logprobs, logprob_entries)
from pagedserve.gpu.sampling_mask import TokenMask
from pagedserve.kernels import sample_cpu

logger = logging.getLogger(__name__)

# Temperatures below this are greedy (vLLM's _SAMPLING_EPS).
SAMPLING_EPS = 1e-5
# Top-p rows first look for their nucleus among this many highest-probability tokens; rows
# whose nucleus is larger fall back to a full sort.
TOP_P_CANDIDATES = 256


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    # One entry per row when any row asked for logprobs (None for rows that did not); else None.
    logprobs: list[SampledLogprobs | None] | None


def greedy(logits: Tensor) -> Tensor:
    """Index of each row's largest logit, the first of ties (as ``argmax``). ``max(dim)`` rather
    than ``argmax``: on CPU torch's argmax over a 49k vocabulary took 62 us a row against 22
    (16 rows: 575 against 160 us, 3 % of a 16-row decode step of the default model)."""
    return logits.max(dim=-1).indices


def plain_row(opt: SamplingOptions, vocab: int) -> bool:
    """No logprobs, nothing that changes the logits, no top-k / top-p / min-p: the token is the
    row's argmax (greedy) or an inverse-CDF draw over its whole softmax, which kernels.sample_cpu
    takes in one C pass over the logits in their own dtype (bf16 -> fp32 is exact and keeps order).
    The general path's fp32 copy, finiteness check, max, softmax and cumsums cost ~0.9 ms of an
    18 ms 16-row greedy step of the default model, and 9.4 ms for 64 temperature rows against
    0.64 ms in C (loadtest/PERF.md)."""
    if opt.logprobs is not None or changes_logits(opt):
        return False
    return opt.temperature < SAMPLING_EPS or (
        not 0 < opt.top_k < vocab and opt.top_p >= 1.0 and opt.min_p <= 0.0)


class Sampler:
    def __init__(self, top_p_candidates: int = TOP_P_CANDIDATES) -> None:
        self.top_p_candidates = top_p_candidates

    def sample(
        self,
        logits: Tensor,
        options: list[SamplingOptions],
        token_ids: list[list[int]],
        num_prompt_tokens: list[int],
        token_mask: TokenMask | None = None,
        preps: list[LogitsPrep | None] | None = None,
    ) -> SamplerOutput:
        """``preps``: each row's LogitsPrep (its logit_bias / min_tokens ids as tensors), kept by
        the caller per sequence (``logits_preps``); built per call when not given."""
        batch, vocab = logits.shape
        if not (len(options) == len(token_ids) == len(num_prompt_tokens) == batch):
            raise ValueError(
                f"sampler got {batch} logit rows but {len(options)} options, "
                f"{len(token_ids)} token lists and {len(num_prompt_tokens)} prompt lengths"
            )
        if token_mask is None:
            out = self._sample_plain(logits, options, token_ids, num_prompt_tokens, preps)
            if out is not None:
                return out
        return self._sample_general(logits, options, token_ids, num_prompt_tokens, token_mask, preps)

    @staticmethod
    def logits_preps(logits: Tensor, options: list[SamplingOptions],
                     held: list[LogitsPrep | None]) -> list[LogitsPrep | None]:
        """Each row's LogitsPrep: the one ``held`` (kept by the caller per sequence) when it fits
        these logits, else a new one (the caller keeps it), None for rows that need none."""
        out = list(held)
        for i, opt in enumerate(options):
            p = out[i]
            if p is None or not p.fits(logits):
                out[i] = LogitsPrep(opt, logits.shape[1], logits.device) if needs_prep(opt) else None
        return out

    def _sample_plain(
        self,
        logits: Tensor,
        options: list[SamplingOptions],
        token_ids: list[list[int]],
        num_prompt_tokens: list[int],
        preps: list[LogitsPrep | None] | None = None,
    ) -> SamplerOutput | None:
        """Plain rows (``plain_row``) in C; the rest, and rows it declines (a NaN or an infinite
        maximum, which the general path repairs), through ``_sample_general``. None when no row is
        plain or the C kernel cannot run."""
        batch, vocab = logits.shape
        plain = [i for i, o in enumerate(options) if plain_row(o, vocab)]
        if not plain:
            return None
        tokens = [-1] * batch
        greedy_rows = [i for i in plain if options[i].temperature < SAMPLING_EPS]
        draw_rows = [i for i in plain if options[i].temperature >= SAMPLING_EPS]
        if greedy_rows:
            got = sample_cpu.greedy(logits, greedy_rows)
            if got is None:
                return None
            for i, t in zip(greedy_rows, got):
                tokens[i] = t
        if draw_rows:
            uniforms = [seeded_uniform(options[i].seed, num_generated(token_ids, num_prompt_tokens, i))
                        for i in draw_rows]
            got = sample_cpu.draw(logits, draw_rows, [options[i].temperature for i in draw_rows], uniforms)
            if got is None:
                return None
            for i, t in zip(draw_rows, got):
                tokens[i] = t
        rest = [i for i in range(batch) if tokens[i] < 0]
        if not rest:
            return SamplerOutput(token_ids=tokens, logprobs=None)
        sub = self._sample_general(select_rows(logits, rest, batch), [options[i] for i in rest],
                                   [token_ids[i] for i in rest], [num_prompt_tokens[i] for i in rest], None,
                                   [preps[i] for i in rest] if preps is not None else None)
        for i, t in zip(rest, sub.token_ids):
            tokens[i] = t
        logprobs = None
        if sub.logprobs is not None:
            logprobs = [None] * batch
            for i, entry in zip(rest, sub.logprobs):
                logprobs[i] = entry
        return SamplerOutput(token_ids=tokens, logprobs=logprobs)

    def _sample_general(
        self,
        logits: Tensor,
        options: list[SamplingOptions],
        token_ids: list[list[int]],
        num_prompt_tokens: list[int],
        token_mask: TokenMask | None,
        preps: list[LogitsPrep | None] | None = None,
    ) -> SamplerOutput:
        """Every option, in torch: the order of operations in the module docstring."""
        batch, vocab = logits.shape
        if logits.dtype != torch.float32:
            logits = logits.float()
        if token_mask is not None:
            token_mask.apply(logits)

        lp_rows = [i for i, o in enumerate(options) if o.logprobs is not None]
        raw_logprobs = (
            torch.log_softmax(select_rows(logits, lp_rows, batch), dim=-1) if lp_rows else None
        )

        logits = process_logits(logits, options, token_ids, num_prompt_tokens, preps)
        # Temperature scaling here rather than per path, so the one finiteness check below sees
        # every value a row is drawn from (a finite logit over a tiny temperature may overflow).
        temps = [o.temperature if o.temperature >= SAMPLING_EPS else 1.0 for o in options]
        if any(t != 1.0 for t in temps):
            logits.div_(on_device(logits, temps, logits.dtype).unsqueeze(1))
        # The draw first, unchecked (every index it makes stays in range whatever the values);
        # whether each row was finite and fitted its candidates comes back in the step's one
        # host copy with the tokens, and only rows that did not are drawn again.
        finite = torch.isfinite(logits.amax(dim=-1))  # +inf or NaN when a row has either, -inf when all are
        tokens, fits = self._draw(logits, options, token_ids, num_prompt_tokens, careful=False)
        ints = [tokens, finite if fits is None else finite & fits]
        lp = None
        if raw_logprobs is not None:
            ks = [options[i].logprobs or 0 for i in lp_rows]
            lp = LogprobReadback(raw_logprobs, select_rows(tokens, lp_rows, batch), ks)
            ints += lp.ints
        host_ints, host_floats = fetch_to_host(ints, lp.floats if lp is not None else [])
        token_list = host_ints[0]
        entries = lp.entries(host_ints[2:], host_floats) if lp is not None else None
        redo = [i for i, ok in enumerate(host_ints[1]) if not ok]
        if redo:
            self._redo(logits, redo, options, token_ids, num_prompt_tokens, token_list, raw_logprobs, lp_rows, entries)
        if lp is None:
            return SamplerOutput(token_ids=token_list, logprobs=None)
        logprobs: list[SampledLogprobs | None] = [None] * batch
        masked = set(token_mask.rows) if token_mask is not None else ()
        for r, i in enumerate(lp_rows):
            if i in masked:  # fewer allowed tokens than asked for: no -inf alternatives
                entries[r].top = [(t, v) for t, v in entries[r].top if v != float("-inf")]
            logprobs[i] = entries[r]
        return SamplerOutput(token_ids=token_list, logprobs=logprobs)

    def _redo(self, logits: Tensor, redo: list[int], options: list[SamplingOptions], token_ids: list[list[int]],
              num_prompt_tokens: list[int], token_list: list[int], raw_logprobs: Tensor | None,
              lp_rows: list[int], entries: list[SampledLogprobs] | None) -> None:
        """The rare rows: non-finite values (repaired here) or a top-p nucleus beyond the first
        candidates (widened at once, ``careful``), drawn again with host reads of their own; a
        row's draw depends on that row alone, so the others keep their tokens. Fills
        ``token_list`` and their ``entries`` in place."""
        sub = select_rows(logits, redo, logits.shape[0])
        repair_non_finite(sub, sub.amax(dim=-1))
        drawn, _ = self._draw(sub, [options[i] for i in redo], [token_ids[i] for i in redo],
                              [num_prompt_tokens[i] for i in redo], careful=True)
        pos = {i: r for r, i in enumerate(lp_rows)}
        lp_redo = [n for n, i in enumerate(redo) if i in pos]
        if raw_logprobs is None or not lp_redo:
            again = sampling_host.to_host(drawn)
        else:
            rows = [pos[redo[n]] for n in lp_redo]
            again, fresh = logprob_entries(
                select_rows(raw_logprobs, rows, len(lp_rows)), select_rows(drawn, lp_redo, len(redo)),
                [options[redo[n]].logprobs or 0 for n in lp_redo], also=drawn)
            for r, entry in zip(rows, fresh):
                entries[r] = entry
        for i, t in zip(redo, again):
            token_list[i] = t

    def _draw(self, logits: Tensor, options: list[SamplingOptions], token_ids: list[list[int]],
              num_prompt_tokens: list[int], careful: bool) -> tuple[Tensor, Tensor | None]:
        """Each row's token from processed, temperature-scaled logits, and (when a top-p row may
        miss) whether each row's nucleus fitted its first candidates: a row that did not has no
        valid token yet unless ``careful``, which widens its search at once (host reads)."""
        batch = logits.shape[0]
        random_rows = [i for i, o in enumerate(options) if o.temperature >= SAMPLING_EPS]
        if not random_rows:
            return greedy(logits), None
        uniforms = [seeded_uniform(options[i].seed, num_generated(token_ids, num_prompt_tokens, i))
                    for i in random_rows]
        drawn, fits = self._sample_random(
            select_rows(logits, random_rows, batch), [options[i] for i in random_rows], uniforms, careful)
        if len(random_rows) == batch:
            return drawn, fits
        greedy_rows = [i for i, o in enumerate(options) if o.temperature < SAMPLING_EPS]
        tokens = torch.empty(batch, dtype=torch.long, device=logits.device)
        g = on_device(logits, greedy_rows)
        tokens[g] = greedy(logits[g])
        r = on_device(logits, random_rows)
        tokens[r] = drawn
        return tokens, spread_rows(fits, r, batch)

    def _sample_random(
        self, logits: Tensor, options: list[SamplingOptions], uniforms: list[float], careful: bool
    ) -> tuple[Tensor, Tensor | None]:
        """Draw one token per row (rows with temperature > 0, logits already divided by it);
        ``logits`` is left as it is (the rare rows are drawn from it again). Returns (tokens,
        fits) as ``_draw``."""
        rows, vocab = logits.shape
        min_ps = [o.min_p for o in options]
        if any(m > 0.0 for m in min_ps):
            # p_i < min_p * p_max  <=>  logit_i < logit_max + log(min_p)
            log_mp = on_device(
                logits, [math.log(m) if m > 0.0 else float("-inf") for m in min_ps], logits.dtype
            )
            threshold = logits.amax(dim=-1) + log_mp
            logits = logits.masked_fill(logits < threshold.unsqueeze(1), float("-inf"))

        top_ks = [o.top_k if 0 < o.top_k < vocab else 0 for o in options]
        top_ps = [o.top_p for o in options]
        filtered = [j for j in range(rows) if top_ks[j] > 0 or top_ps[j] < 1.0]
        plain = [j for j in range(rows) if not (top_ks[j] > 0 or top_ps[j] < 1.0)]
        u = on_device(logits, uniforms, torch.float64)
        out = torch.empty(rows, dtype=torch.long, device=logits.device)

        if plain:
            probs = torch.softmax(select_rows(logits, plain, rows), dim=-1)
            idx = draw_full_vocab(probs, select_rows(u, plain, rows))
            if len(plain) == rows:
                return idx, None
            out[on_device(logits, plain)] = idx

        fits = None
        if filtered:
            sub = select_rows(logits, filtered, rows)
            drawn, fits = self._sample_filtered(
                sub,
                [top_ks[j] for j in filtered],
                [top_ps[j] for j in filtered],
                select_rows(u, filtered, rows),
                careful,
            )
            if len(filtered) == rows:
                return drawn, fits
            f = on_device(logits, filtered)
            out[f] = drawn
            fits = spread_rows(fits, f, rows)
        return out, fits

    def _sample_filtered(
        self, logits: Tensor, top_ks: list[int], top_ps: list[float], u: Tensor, careful: bool
    ) -> tuple[Tensor, Tensor | None]:
        """Top-k / top-p rows: draw among the highest-logit candidates, sorted descending.
        Returns (tokens, fits): see ``_draw``."""
        rows, vocab = logits.shape
        # Top-p rows without top-k are normalised over the whole vocabulary.
        full_norm = [j for j in range(rows) if top_ks[j] == 0]
        k_cap = max(top_ks)
        if full_norm:
            k_cap = max(k_cap, self.top_p_candidates)
        k_cap = min(k_cap, vocab)
        full_probs = torch.softmax(select_rows(logits, full_norm, rows), dim=-1) if full_norm else None

        vals, idx = logits.topk(k_cap, dim=-1)
        tokens, fits = draw_from_candidates(
            vals, idx, top_ks, top_ps, u, full_norm, full_probs, check_len=self.top_p_candidates
        )
        if not full_norm:  # only full-normalised rows can miss
            return tokens, None
        if not careful:
            return tokens, fits
        # Rows whose nucleus lies beyond the first candidates (only top-p rows without top-k)
        # retry with 8x more, then find their crossings by histogram. Which path a row takes
        # depends only on that row (fixed prefix lengths), and every path draws in descending
        # logit order with prefix-stable weights, so a seeded row gets the same token.
        redo = [j for j, ok in enumerate(sampling_host.to_host(fits)) if not ok]
        if not redo:
            return tokens, None
        pos = {j: n for n, j in enumerate(full_norm)}
        redo_t = on_device(logits, redo)
        sub = logits[redo_t]
        sub_probs = full_probs[on_device(logits, [pos[j] for j in redo])]
        second = 8 * self.top_p_candidates
        if second >= vocab:
            vals_s, idx_s = sub.sort(dim=-1, descending=True)
        else:
            vals_s, idx_s = sub.topk(second, dim=-1)
        tokens_s, fits_s = draw_from_candidates(
            vals_s,
            idx_s,
            [0] * len(redo),
            [top_ps[j] for j in redo],
            u[redo_t],
            list(range(len(redo))),
            sub_probs,
            check_len=second,
        )
        miss = [m for m, ok in enumerate(sampling_host.to_host(fits_s)) if not ok] if second < vocab else []
        if miss:
            logger.debug("top-p nucleus beyond %d tokens for %d rows: histogram", second, len(miss))
            m = on_device(logits, miss)
            tokens_s[m] = draw_top_p_by_histogram(
                sub[m], sub_probs[m], [top_ps[redo[j]] for j in miss], u[redo_t][m]
            )
        tokens[redo_t] = tokens_s
        return tokens, None

