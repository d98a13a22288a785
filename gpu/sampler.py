"""Token sampling for one step: one batched pass over the logits of every sequence.

Order of operations (as vLLM v1 defines them):
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
only those rows are rewritten (``_repair_non_finite`` documents the policy), so one request's
values never fail the step for the others and finite rows draw exactly as before.

Devices: every tensor made here lives on the logits' device (on CUDA a tensor made without
``device=`` would be a CPU tensor and the op mixing it with the logits fails). Host values
become tensors only through ``_on(like, data)``; factories take ``device=<input>.device``.
Results come back to the host once, at the end, in one copy (``_fetch``: token ids and
logprobs). The only other host reads are data-dependent branches (``bool(x.all())``) on rare
paths (a top-p nucleus beyond the candidates, a draw rounding onto a zero-width token).
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from gpu.messages import SampledLogprobs, SamplingOptions

logger = logging.getLogger(__name__)

# Temperatures below this are greedy (vLLM's _SAMPLING_EPS).
SAMPLING_EPS = 1e-5
# Top-p rows first look for their nucleus among this many highest-probability tokens; rows
# whose nucleus is larger fall back to a full sort.
TOP_P_CANDIDATES = 256
# Chunk width of the two-level full-vocabulary draw.
_CHUNK = 256

_MASK64 = (1 << 64) - 1


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    # One entry per row when any row asked for logprobs (None for rows that did not); else None.
    logprobs: list[SampledLogprobs | None] | None


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def seeded_uniform(seed: int, step: int) -> float:
    """A uniform number in [0, 1) that depends only on (seed, step)."""
    z = _splitmix64(_splitmix64(seed & _MASK64) ^ (step & _MASK64))
    return (z >> 11) * (1.0 / (1 << 53))


def _on(like: Tensor, data, dtype: torch.dtype | None = None) -> Tensor:
    """Host values as a tensor on ``like``'s device: the one place host data enters the sampler."""
    return torch.tensor(data, dtype=dtype, device=like.device)


def _fetch(ints: list[Tensor], floats: list[Tensor]) -> tuple[list[list[int]], list[list[float]]]:
    """Everything a step returns, flattened, in ONE device-to-host copy.

    float64 holds every float32 logprob and every token id (< 2**53) exactly."""
    parts = [t.reshape(-1) for t in ints + floats]
    if not parts:
        return [], []
    flat: list[float] = torch.cat([t.to(torch.float64) for t in parts]).tolist()
    out, at = [], 0
    for t in parts:
        out.append(flat[at:at + t.numel()])
        at += t.numel()
    return [[int(x) for x in v] for v in out[:len(ints)]], out[len(ints):]


def _num_generated(token_ids: list[list[int]], num_prompt_tokens: list[int], i: int) -> int:
    return len(token_ids[i]) - num_prompt_tokens[i]


def process_logits(
    logits: Tensor,
    options: list[SamplingOptions],
    token_ids: list[list[int]],
    num_prompt_tokens: list[int],
) -> Tensor:
    """Apply logit_bias, min_tokens blocking and the three penalties, in place; returns logits.

    Token ids outside the vocabulary in ``logit_bias`` are ignored here (the engine validates
    them against the tokenizer); failing the worker step would fail every request in it.
    """
    batch, vocab = logits.shape
    bias_rows: list[int] = []
    bias_cols: list[int] = []
    bias_vals: list[float] = []
    block_rows: list[int] = []
    block_cols: list[int] = []
    penalty_rows: list[int] = []
    for i, opt in enumerate(options):
        if opt.logit_bias:
            for tok, bias in opt.logit_bias.items():
                tok = int(tok)
                if 0 <= tok < vocab:
                    bias_rows.append(i)
                    bias_cols.append(tok)
                    bias_vals.append(float(bias))
        if (
            opt.min_tokens > 0
            and opt.min_tokens_blocked_ids
            and _num_generated(token_ids, num_prompt_tokens, i) < opt.min_tokens
        ):
            for tok in opt.min_tokens_blocked_ids:
                if 0 <= tok < vocab:
                    block_rows.append(i)
                    block_cols.append(tok)
        if (
            opt.repetition_penalty != 1.0
            or opt.frequency_penalty != 0.0
            or opt.presence_penalty != 0.0
        ):
            penalty_rows.append(i)
    if bias_rows:
        logits.index_put_(
            (_on(logits, bias_rows), _on(logits, bias_cols)),
            _on(logits, bias_vals, logits.dtype),
            accumulate=True,
        )
    if block_rows:
        logits[_on(logits, block_rows), _on(logits, block_cols)] = float("-inf")
    if penalty_rows:
        _apply_penalties(logits, penalty_rows, options, token_ids, num_prompt_tokens)
    return logits


def _apply_penalties(
    logits: Tensor,
    rows: list[int],
    options: list[SamplingOptions],
    token_ids: list[list[int]],
    num_prompt_tokens: list[int],
) -> None:
    """Penalties touch only tokens a row has seen, so work on those (row, token) pairs alone.

    Same values as the dense vLLM formulas, O(number of tokens) instead of O(rows * vocab).
    """
    vocab = logits.shape[1]
    rep = _on(logits, [options[i].repetition_penalty for i in range(len(options))])
    freq = _on(logits, [options[i].frequency_penalty for i in range(len(options))])
    pres = _on(logits, [options[i].presence_penalty for i in range(len(options))])

    # One flat tensor of every penalised row's tokens; each token knows its row and position.
    lens = _on(logits, [len(token_ids[i]) for i in rows])
    flat = _on(logits, [t for i in rows for t in token_ids[i]], torch.long)
    row_t = _on(logits, rows)
    row_of = torch.repeat_interleave(row_t, lens)
    starts = torch.cumsum(lens, 0) - lens
    pos = torch.arange(flat.shape[0], device=logits.device) - torch.repeat_interleave(starts, lens)
    n_prompt = torch.repeat_interleave(_on(logits, [num_prompt_tokens[i] for i in rows]), lens)
    valid = (flat >= 0) & (flat < vocab)
    is_gen = pos >= n_prompt
    keys_all = row_of * vocab + flat
    uniq_gen, gen_counts = torch.unique(keys_all[valid & is_gen], return_counts=True)
    in_prompt = valid & ~is_gen & (rep[row_of] != 1.0)
    if bool(in_prompt.any()):
        keys = torch.unique(torch.cat([uniq_gen, keys_all[in_prompt]]))
    else:
        keys = uniq_gen
    if keys.numel() == 0:
        return
    counts = torch.zeros(keys.shape[0], dtype=logits.dtype, device=logits.device)
    counts[torch.searchsorted(keys, uniq_gen)] = gen_counts.to(logits.dtype)

    key_rows = keys // vocab
    key_cols = keys % vocab
    vals = logits[key_rows, key_cols]
    # Every key was seen in the prompt or the output of its row: the repetition penalty applies.
    r = rep[key_rows].to(logits.dtype)
    vals = torch.where(vals > 0, vals / r, vals * r)
    vals = vals - freq[key_rows].to(logits.dtype) * counts
    vals = vals - pres[key_rows].to(logits.dtype) * (counts > 0).to(logits.dtype)
    logits[key_rows, key_cols] = vals


def _repair_non_finite(logits: Tensor, row_max: Tensor) -> None:
    """Make rows with +inf or NaN logits, or no finite one, drawable; in place.

    A +inf or NaN logit (a +inf logit_bias from the offline API, a penalty overflow, a broken
    model) made the draws index out of range, and a failed step fails every request in the
    batch, so one row's values must never fail the others. Per bad row: if it has +inf
    entries, those are its only candidates (equally likely); NaN counts as -inf; a row left
    with no candidate at all (all -inf or NaN) is treated as all-equal logits: greedy picks
    token 0, a random row draws uniformly by its seed. Finite rows are not touched.
    """
    bad = (~torch.isfinite(row_max)).nonzero().squeeze(1)
    rows = logits[bad]
    pos_inf = rows == float("inf")
    has_pos = pos_inf.any(dim=-1, keepdim=True)
    rows = torch.where(
        has_pos,
        torch.where(pos_inf, 0.0, float("-inf")),
        rows.masked_fill(rows.isnan(), float("-inf")),
    )
    none_left = (rows == float("-inf")).all(dim=-1, keepdim=True)
    logits[bad] = rows.masked_fill(none_left, 0.0)
    logger.debug("%d sampler rows had non-finite logits", bad.numel())


def _select(t: Tensor, rows: list[int], total: int) -> Tensor:
    """Rows of t; the tensor itself when every row is selected (no copy)."""
    return t if len(rows) == total else t[_on(t, rows)]


class Sampler:
    def __init__(self, top_p_candidates: int = TOP_P_CANDIDATES) -> None:
        self.top_p_candidates = top_p_candidates

    def sample(
        self,
        logits: Tensor,
        options: list[SamplingOptions],
        token_ids: list[list[int]],
        num_prompt_tokens: list[int],
    ) -> SamplerOutput:
        batch, vocab = logits.shape
        if not (len(options) == len(token_ids) == len(num_prompt_tokens) == batch):
            raise ValueError(
                f"sampler got {batch} logit rows but {len(options)} options, "
                f"{len(token_ids)} token lists and {len(num_prompt_tokens)} prompt lengths"
            )
        if logits.dtype != torch.float32:
            logits = logits.float()

        lp_rows = [i for i, o in enumerate(options) if o.logprobs is not None]
        raw_logprobs = (
            torch.log_softmax(_select(logits, lp_rows, batch), dim=-1) if lp_rows else None
        )

        logits = process_logits(logits, options, token_ids, num_prompt_tokens)
        # Temperature scaling here rather than per path, so the one finiteness check below sees
        # every value a row is drawn from (a finite logit over a tiny temperature may overflow).
        temps = [o.temperature if o.temperature >= SAMPLING_EPS else 1.0 for o in options]
        if any(t != 1.0 for t in temps):
            logits.div_(_on(logits, temps, logits.dtype).unsqueeze(1))
        row_max = logits.amax(dim=-1)  # +inf or NaN when a row has either, -inf when all are
        if not bool(torch.isfinite(row_max).all()):
            _repair_non_finite(logits, row_max)

        random_rows = [i for i, o in enumerate(options) if o.temperature >= SAMPLING_EPS]
        if not random_rows:
            tokens = logits.argmax(dim=-1)
        else:
            greedy_rows = [i for i, o in enumerate(options) if o.temperature < SAMPLING_EPS]
            tokens = torch.empty(batch, dtype=torch.long, device=logits.device)
            if greedy_rows:
                g = _on(logits, greedy_rows)
                tokens[g] = logits[g].argmax(dim=-1)
            uniforms = [
                seeded_uniform(options[i].seed, _num_generated(token_ids, num_prompt_tokens, i))
                for i in random_rows
            ]
            drawn = self._sample_random(
                _select(logits, random_rows, batch), [options[i] for i in random_rows], uniforms
            )
            if len(random_rows) == batch:
                tokens = drawn
            else:
                tokens[_on(logits, random_rows)] = drawn

        if raw_logprobs is None:
            return SamplerOutput(token_ids=tokens.tolist(), logprobs=None)
        chosen = _select(tokens, lp_rows, batch)
        ks = [options[i].logprobs or 0 for i in lp_rows]
        token_list, entries = _logprob_entries(raw_logprobs, chosen, ks, also=tokens)
        logprobs: list[SampledLogprobs | None] = [None] * batch
        for r, i in enumerate(lp_rows):
            logprobs[i] = entries[r]
        return SamplerOutput(token_ids=token_list, logprobs=logprobs)

    def _sample_random(
        self, logits: Tensor, options: list[SamplingOptions], uniforms: list[float]
    ) -> Tensor:
        """Draw one token per row (rows with temperature > 0, logits already divided by it);
        logits is modified in place."""
        rows, vocab = logits.shape
        min_ps = [o.min_p for o in options]
        if any(m > 0.0 for m in min_ps):
            # p_i < min_p * p_max  <=>  logit_i < logit_max + log(min_p)
            log_mp = _on(
                logits, [math.log(m) if m > 0.0 else float("-inf") for m in min_ps], logits.dtype
            )
            threshold = logits.amax(dim=-1) + log_mp
            logits.masked_fill_(logits < threshold.unsqueeze(1), float("-inf"))

        top_ks = [o.top_k if 0 < o.top_k < vocab else 0 for o in options]
        top_ps = [o.top_p for o in options]
        filtered = [j for j in range(rows) if top_ks[j] > 0 or top_ps[j] < 1.0]
        plain = [j for j in range(rows) if not (top_ks[j] > 0 or top_ps[j] < 1.0)]
        u = _on(logits, uniforms, torch.float64)
        out = torch.empty(rows, dtype=torch.long, device=logits.device)

        if plain:
            probs = torch.softmax(_select(logits, plain, rows), dim=-1)
            idx = _draw_full_vocab(probs, _select(u, plain, rows))
            if len(plain) == rows:
                return idx
            out[_on(logits, plain)] = idx

        if filtered:
            sub = _select(logits, filtered, rows)
            drawn = self._sample_filtered(
                sub,
                [top_ks[j] for j in filtered],
                [top_ps[j] for j in filtered],
                _select(u, filtered, rows),
            )
            if len(filtered) == rows:
                return drawn
            out[_on(logits, filtered)] = drawn
        return out

    def _sample_filtered(
        self, logits: Tensor, top_ks: list[int], top_ps: list[float], u: Tensor
    ) -> Tensor:
        """Top-k / top-p rows: draw among the highest-logit candidates, sorted descending."""
        rows, vocab = logits.shape
        # Top-p rows without top-k are normalised over the whole vocabulary.
        full_norm = [j for j in range(rows) if top_ks[j] == 0]
        k_cap = max(top_ks)
        if full_norm:
            k_cap = max(k_cap, self.top_p_candidates)
        k_cap = min(k_cap, vocab)
        full_probs = torch.softmax(_select(logits, full_norm, rows), dim=-1) if full_norm else None

        vals, idx = logits.topk(k_cap, dim=-1)
        tokens, fits = _draw_from_candidates(
            vals, idx, top_ks, top_ps, u, full_norm, full_probs, check_len=self.top_p_candidates
        )
        # Rows whose nucleus lies beyond the first candidates (only top-p rows without top-k)
        # retry with 8x more, then find their crossings by histogram. Which path a row takes
        # depends only on that row (fixed prefix lengths), and every path draws in descending
        # logit order with prefix-stable weights, so a seeded row gets the same token.
        if bool(fits.all()):
            return tokens
        redo = (~fits).nonzero().squeeze(1).tolist()
        pos = {j: n for n, j in enumerate(full_norm)}
        assert full_probs is not None  # only full-normalised rows can miss
        redo_t = _on(logits, redo)
        sub = logits[redo_t]
        sub_probs = full_probs[_on(logits, [pos[j] for j in redo])]
        second = 8 * self.top_p_candidates
        if second >= vocab:
            vals_s, idx_s = sub.sort(dim=-1, descending=True)
        else:
            vals_s, idx_s = sub.topk(second, dim=-1)
        tokens_s, fits_s = _draw_from_candidates(
            vals_s,
            idx_s,
            [0] * len(redo),
            [top_ps[j] for j in redo],
            u[redo_t],
            list(range(len(redo))),
            sub_probs,
            check_len=second,
        )
        if second < vocab and not bool(fits_s.all()):
            miss = (~fits_s).nonzero().squeeze(1)
            logger.debug("top-p nucleus beyond %d tokens for %d rows: histogram", second, len(miss))
            tokens_s[miss] = _draw_top_p_by_histogram(
                sub[miss], sub_probs[miss], [top_ps[redo[m]] for m in miss.tolist()], u[redo_t][miss]
            )
        tokens[redo_t] = tokens_s
        return tokens


# Logit buckets of the histogram top-p path.
_HIST_BUCKETS = 2048


def _draw_top_p_by_histogram(
    logits: Tensor, probs: Tensor, top_ps: list[float], u: Tensor
) -> Tensor:
    """Top-p draw for rows with a very large nucleus, without sorting the vocabulary.

    The sorted-order draw needs two positions in the descending order: where the cumulative
    mass first reaches p (end of the nucleus), and where it first exceeds u * nucleus mass (the
    token). Bucketing tokens by logit (buckets are ordered like the logits) finds the bucket of
    each crossing with one scatter; only that bucket's tokens are then sorted.
    """
    rows, vocab = logits.shape
    n_b = _HIST_BUCKETS
    top = logits.amax(dim=-1, keepdim=True)
    finite = torch.where(torch.isfinite(logits), logits, top)
    span = (top - finite.amin(dim=-1, keepdim=True)).clamp_min_(1e-6)
    bucket = ((top - logits) * ((n_b - 1) / span)).clamp_(0, n_b - 1).long()
    mass = torch.zeros(rows, n_b, dtype=probs.dtype, device=probs.device).scatter_add_(1, bucket, probs)
    cum = torch.cumsum(mass, dim=-1, dtype=torch.float64)

    def crossing(target: Tensor, strict: bool) -> tuple[list[int], list[float]]:
        c = torch.searchsorted(cum, target.unsqueeze(1), right=strict).squeeze(1)
        c.clamp_(max=n_b - 1)
        before = torch.where(c > 0, cum.gather(1, (c - 1).clamp(min=0).unsqueeze(1)).squeeze(1), 0.0)
        toks, through = [], []
        for r in range(rows):
            members = (bucket[r] == c[r]).nonzero().squeeze(1)
            if members.numel() == 0:  # target rounded past the last non-empty bucket
                members = logits[r].argmax().reshape(1)
            order = logits[r, members].argsort(descending=True, stable=True)
            members = members[order]
            w = probs[r, members]
            inner = torch.cumsum(w, 0, dtype=torch.float64) + before[r]
            j = int(torch.searchsorted(inner, target[r : r + 1], right=strict).clamp(max=len(members) - 1))
            if w[j] <= 0:
                j = 0
            toks.append(int(members[j]))
            through.append(float(inner[j]))
        return toks, through

    p_t = _on(logits, top_ps, torch.float64)
    _, kept_mass = crossing(p_t, strict=False)  # last kept token: first with cum >= p
    kept = _on(logits, kept_mass, torch.float64)
    x = torch.minimum(u * kept, kept * (1 - 2.0**-52))
    chosen, _ = crossing(x, strict=True)  # first token with cum > x
    return _on(logits, chosen, torch.long)


def _draw_full_vocab(probs: Tensor, u: Tensor) -> Tensor:
    """Inverse-CDF draw over the whole vocabulary, in two levels.

    First a chunk by chunk masses, then a token inside the chunk. Only the chosen chunk needs a
    float64 cumulative sum, so no [rows, vocab] float64 copy is made, yet every token keeps its
    own float32 probability as its width (a float32 cumsum over 50k tokens would round tail
    probabilities below 6e-8 to 0).
    """
    rows, vocab = probs.shape
    chunk = _CHUNK
    n_full = vocab // chunk
    parts = []
    if n_full:
        parts.append(probs[:, : n_full * chunk].unflatten(1, (n_full, chunk)).sum(dim=-1))
    if vocab % chunk:
        parts.append(probs[:, n_full * chunk :].sum(dim=-1, keepdim=True))
    mass = (parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)).double()
    cum = torch.cumsum(mass, dim=-1)
    n_chunks = mass.shape[1]
    x = u * cum[:, -1]
    c = torch.searchsorted(cum, x.unsqueeze(1), right=True).squeeze(1).clamp_(max=n_chunks - 1)
    c_mass = mass.gather(1, c.unsqueeze(1)).squeeze(1)
    if not bool((c_mass > 0).all()):  # x rounded onto the total
        c = torch.where(c_mass > 0, c, mass.argmax(dim=-1))
        c_mass = mass.gather(1, c.unsqueeze(1)).squeeze(1)
    before = cum.gather(1, c.unsqueeze(1)).squeeze(1) - c_mass
    frac = ((x - before) / c_mass).clamp_(0.0, 1.0)

    cols = c.unsqueeze(1) * chunk + torch.arange(chunk, device=probs.device).unsqueeze(0)
    valid = cols < vocab
    cols.clamp_(max=vocab - 1)
    inner = probs.gather(1, cols).masked_fill_(~valid, 0.0)
    inner_cum = torch.cumsum(inner, dim=-1, dtype=torch.float64)
    y = frac * inner_cum[:, -1]
    j = torch.searchsorted(inner_cum, y.unsqueeze(1), right=True).squeeze(1).clamp_(max=chunk - 1)
    ok = inner.gather(1, j.unsqueeze(1)).squeeze(1) > 0
    if not bool(ok.all()):
        j = torch.where(ok, j, inner.argmax(dim=-1))
    return cols.gather(1, j.unsqueeze(1)).squeeze(1)


def _draw_from_candidates(
    vals: Tensor,
    idx: Tensor,
    top_ks: list[int],
    top_ps: list[float],
    u: Tensor,
    full_norm: list[int],
    full_probs: Tensor | None,
    check_len: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Inverse-CDF draw among candidates sorted by descending logit.

    Returns (token ids, fits): ``fits`` is False for a top-p row whose nucleus is not inside the
    candidates (only possible when there are fewer candidates than vocabulary entries).
    Weights are prefix-stable (a candidate's cumulative weight does not depend on how many
    candidates follow it), so the draw is the same whatever the candidate count.
    """
    rows, k_cap = vals.shape
    weights = torch.exp(vals - vals[:, :1])
    ks = _on(vals, [k if k > 0 else k_cap for k in top_ks])
    beyond_k = torch.arange(k_cap, device=vals.device).unsqueeze(0) >= ks.unsqueeze(1)
    weights.masked_fill_(beyond_k, 0.0)
    if full_norm:
        fn = _on(vals, full_norm)
        assert full_probs is not None
        weights[fn] = full_probs.gather(1, idx[fn])
    cum = torch.cumsum(weights, dim=-1, dtype=torch.float64)
    total = cum[:, -1].clone()
    fits = torch.ones(rows, dtype=torch.bool, device=vals.device)
    if full_norm:
        fn = _on(vals, full_norm)
        total[fn] = 1.0
        p_fn = _on(vals, [top_ps[j] for j in full_norm], torch.float64)
        last = k_cap - 1 if check_len is None else min(check_len, k_cap) - 1
        fits[fn] = cum[fn, last] >= p_fn

    if any(p < 1.0 for p in top_ps):
        p_t = _on(vals, top_ps, torch.float64)
        exclusive = torch.cat([torch.zeros(rows, 1, dtype=torch.float64, device=vals.device), cum[:, :-1]], dim=1)
        keep = exclusive < (p_t * total).unsqueeze(1)
        keep[:, 0] = True
        keep &= ~beyond_k
    else:
        keep = ~beyond_k
    last_kept = keep.sum(dim=1) - 1  # keep is a prefix
    kept_mass = cum.gather(1, last_kept.unsqueeze(1)).squeeze(1)
    x = u * kept_mass
    pos = torch.searchsorted(cum, x.unsqueeze(1), right=True).squeeze(1)
    pos = torch.minimum(pos, last_kept)
    ok = weights.gather(1, pos.unsqueeze(1)).squeeze(1) > 0
    pos = torch.where(ok, pos, torch.zeros_like(pos))
    return idx.gather(1, pos.unsqueeze(1)).squeeze(1), fits


def _logprob_entries(
    logprobs: Tensor, chosen: Tensor, ks: list[int], also: Tensor | None = None
) -> tuple[list[int], list[SampledLogprobs]]:
    """Logprob of each row's chosen token and its top-k, read back in one copy together with
    ``also`` (the step's token ids; returned as the first value, [] without it)."""
    rows, vocab = logprobs.shape
    picked = logprobs.gather(1, chosen.long().unsqueeze(1)).squeeze(1)
    k_max = min(max(ks, default=0), vocab)
    ints = [also] if also is not None else []
    floats = [picked]
    if k_max > 0:
        tv, ti = logprobs.topk(k_max, dim=-1)
        ints.append(ti)
        floats.append(tv)
    host_ints, host_floats = _fetch(ints, floats)
    token_list = host_ints[0] if also is not None else []
    top_ids = host_ints[-1] if k_max > 0 else []
    top_vals = host_floats[1] if k_max > 0 else []
    entries = []
    for r, k in enumerate(ks):
        at = r * k_max
        top = list(zip(top_ids[at:at + k], top_vals[at:at + k])) if k > 0 else []
        entries.append(SampledLogprobs(logprob=host_floats[0][r], top=top))
    return token_list, entries


def compute_prompt_logprobs(
    logits: Tensor, next_token_ids: Tensor | list[int], k: int
) -> list[SampledLogprobs]:
    """Logprob of each actual next prompt token under the raw logits, plus the top-k there.

    ``logits[i]`` is the model output at prompt position p; ``next_token_ids[i]`` is the token at
    position p + 1.
    """
    if logits.shape[0] == 0:
        return []
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = torch.as_tensor(next_token_ids, dtype=torch.long, device=logits.device)
    if chosen.shape[0] != logits.shape[0]:
        raise ValueError(
            f"compute_prompt_logprobs got {logits.shape[0]} logit rows but {chosen.shape[0]} token ids"
        )
    return _logprob_entries(logprobs, chosen, [max(k, 0)] * logits.shape[0])[1]
