"""Logits processing before the draw (steps 2-4 of gpu.sampler's order): logit_bias, min_tokens
blocking, the repetition / frequency / presence penalties, and the repair of rows with
non-finite values. Kept apart from the draw so each can be read and tested on its own."""
from __future__ import annotations

import logging

import torch
from torch import Tensor

from pagedserve.contracts.messages import SamplingOptions
from pagedserve.gpu.sampling_host import on_device

logger = logging.getLogger(__name__)


def num_generated(token_ids: list[list[int]], num_prompt_tokens: list[int], i: int) -> int:
    return len(token_ids[i]) - num_prompt_tokens[i]


def changes_logits(opt: SamplingOptions) -> bool:
    """Whether ``process_logits`` may change this row (a bias, a min_tokens block, a penalty)."""
    return bool(opt.logit_bias or (opt.min_tokens > 0 and opt.min_tokens_blocked_ids)
                or opt.repetition_penalty != 1.0 or opt.frequency_penalty != 0.0 or opt.presence_penalty != 0.0)


class LogitsPrep:
    """One sequence's logit_bias and min_tokens ids as device tensors, built once (the worker keeps
    it in the sequence's state, gpu/model_runner.py ``SeqState.logits_prep``) so that a step
    applies every row's bias and block in one batched op instead of a Python loop over each row's
    keys (issue 22). Ids outside the vocabulary are dropped here, once."""

    __slots__ = ("vocab", "device", "bias_ids", "bias_vals", "blocked_ids")

    def __init__(self, opt: SamplingOptions, vocab: int, device: torch.device):
        self.vocab = vocab
        self.device = device
        self.bias_ids: Tensor | None = None
        self.bias_vals: Tensor | None = None
        self.blocked_ids: Tensor | None = None
        if opt.logit_bias:
            kept = [(t, v) for t, v in opt.logit_bias.items() if 0 <= t < vocab]  # on the host: no read back
            if kept:
                self.bias_ids = on_device(device, [t for t, _ in kept], torch.long)
                # float64 keeps each bias as given; it becomes the logits' dtype when applied.
                self.bias_vals = on_device(device, [v for _, v in kept], torch.float64)
        if opt.min_tokens > 0 and opt.min_tokens_blocked_ids:
            ids = [t for t in opt.min_tokens_blocked_ids if 0 <= t < vocab]
            if ids:
                self.blocked_ids = on_device(device, ids, torch.long)

    def fits(self, logits: Tensor) -> bool:
        return self.vocab == logits.shape[1] and self.device == logits.device


def needs_prep(opt: SamplingOptions) -> bool:
    """Whether the row has a logit_bias or min_tokens ids (what ``LogitsPrep`` holds)."""
    return bool(opt.logit_bias or (opt.min_tokens > 0 and opt.min_tokens_blocked_ids))


def process_logits(
    logits: Tensor,
    options: list[SamplingOptions],
    token_ids: list[list[int]],
    num_prompt_tokens: list[int],
    preps: list[LogitsPrep | None] | None = None,
) -> Tensor:
    """Apply logit_bias, min_tokens blocking and the three penalties, in place; returns logits.

    ``preps``: each row's LogitsPrep (None where the row has neither a bias nor min_tokens ids),
    built once per sequence by the caller; built here for this call when not given.

    Token ids outside the vocabulary in ``logit_bias`` are ignored here (the engine validates
    them against the tokenizer); failing the worker step would fail every request in it.
    """
    batch, vocab = logits.shape
    bias_rows: list[int] = []
    bias_parts: list[LogitsPrep] = []
    block_rows: list[int] = []
    block_parts: list[LogitsPrep] = []
    penalty_rows: list[int] = []
    for i, opt in enumerate(options):
        if not changes_logits(opt):
            continue
        if needs_prep(opt):
            prep = preps[i] if preps is not None else None
            if prep is None or not prep.fits(logits):
                prep = LogitsPrep(opt, vocab, logits.device)
            if prep.bias_ids is not None:
                bias_rows.append(i)
                bias_parts.append(prep)
            if (
                prep.blocked_ids is not None
                and num_generated(token_ids, num_prompt_tokens, i) < opt.min_tokens
            ):
                block_rows.append(i)
                block_parts.append(prep)
        if (
            opt.repetition_penalty != 1.0
            or opt.frequency_penalty != 0.0
            or opt.presence_penalty != 0.0
        ):
            penalty_rows.append(i)
    if bias_rows:
        rows, cols = _rows_and_cols(logits, bias_rows, [p.bias_ids for p in bias_parts])
        vals = bias_parts[0].bias_vals if len(bias_parts) == 1 else torch.cat([p.bias_vals for p in bias_parts])
        # One index_add_ over the flat logits (a row's ids are distinct; cheaper than an
        # accumulating index_put_, which sorts).
        if logits.is_contiguous():
            logits.view(-1).index_add_(0, rows * vocab + cols, vals.to(logits.dtype))
        else:
            logits.index_put_((rows, cols), vals.to(logits.dtype), accumulate=True)
    if block_rows:
        rows, cols = _rows_and_cols(logits, block_rows, [p.blocked_ids for p in block_parts])
        # A device scalar: ``logits[rows, cols] = -inf`` copies a host one, blocking, on CUDA.
        logits.index_put_((rows, cols), logits.new_full((), float("-inf")))
    if penalty_rows:
        apply = _apply_penalties_dense if dense_penalties(logits) else _apply_penalties
        apply(logits, penalty_rows, options, token_ids, num_prompt_tokens)
    return logits


def _rows_and_cols(logits: Tensor, rows: list[int], ids: list[Tensor]) -> tuple[Tensor, Tensor]:
    """(row index, column) pairs of every listed row's ids, as two flat tensors."""
    cols = ids[0] if len(ids) == 1 else torch.cat(ids)
    sizes = [t.shape[0] for t in ids]
    return torch.repeat_interleave(on_device(logits, rows), on_device(logits, sizes), output_size=sum(sizes)), cols


class _SeenTokens:
    """Every penalised row's tokens as one flat tensor, shaped on the host (``output_size``: no
    read back): each token's row (0..len(rows)-1, in ``rows`` order), whether it is a real id, and
    whether the row generated it (past its prompt). Both penalty passes start from it."""

    def __init__(self, logits: Tensor, rows: list[int], token_ids: list[list[int]], num_prompt_tokens: list[int]):
        vocab = logits.shape[1]
        sizes = [len(token_ids[i]) for i in rows]
        self.total = total = sum(sizes)
        lens = on_device(logits, sizes)
        self.flat = on_device(logits, [t for i in rows for t in token_ids[i]], torch.long)
        self.row_of = torch.repeat_interleave(torch.arange(len(rows), device=logits.device), lens, output_size=total)
        starts = torch.cumsum(lens, 0) - lens
        pos = torch.arange(total, device=logits.device) - torch.repeat_interleave(starts, lens, output_size=total)
        n_prompt = torch.repeat_interleave(on_device(logits, [num_prompt_tokens[i] for i in rows]), lens,
                                           output_size=total)
        self.valid = (self.flat >= 0) & (self.flat < vocab)
        self.is_gen = pos >= n_prompt


def _penalties(logits: Tensor, rows: list[int], options: list[SamplingOptions]) -> tuple[Tensor, Tensor, Tensor]:
    """The penalised rows' repetition, frequency and presence penalties, in ``rows`` order."""
    return tuple(on_device(logits, [getattr(options[i], name) for i in rows])
                 for name in ("repetition_penalty", "frequency_penalty", "presence_penalty"))


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
    rep, freq, pres = _penalties(logits, rows, options)
    seen = _SeenTokens(logits, rows, token_ids, num_prompt_tokens)
    keys_all = seen.row_of * vocab + seen.flat
    uniq_gen, gen_counts = torch.unique(keys_all[seen.valid & seen.is_gen], return_counts=True)
    in_prompt = seen.valid & ~seen.is_gen & (rep[seen.row_of] != 1.0)
    if bool(in_prompt.any()):
        keys = torch.unique(torch.cat([uniq_gen, keys_all[in_prompt]]))
    else:
        keys = uniq_gen
    if keys.numel() == 0:
        return
    counts = torch.zeros(keys.shape[0], dtype=logits.dtype, device=logits.device)
    counts[torch.searchsorted(keys, uniq_gen)] = gen_counts.to(logits.dtype)

    key_rows = keys // vocab  # in rows order
    key_cols = keys % vocab
    logit_rows = on_device(logits, rows)[key_rows]
    vals = logits[logit_rows, key_cols]
    # Every key was seen in the prompt or the output of its row: the repetition penalty applies.
    r = rep[key_rows].to(logits.dtype)
    vals = torch.where(vals > 0, vals / r, vals * r)
    vals = vals - freq[key_rows].to(logits.dtype) * counts
    vals = vals - pres[key_rows].to(logits.dtype) * (counts > 0).to(logits.dtype)
    logits[logit_rows, key_cols] = vals


def dense_penalties(logits: Tensor) -> bool:
    """The dense penalty pass on CUDA: no host read (the sparse one's ``unique`` and boolean
    selections each wait for the GPU), and rows x vocabulary is little work there. The CPU keeps
    the sparse pass, O(number of tokens) instead of O(rows * vocab)."""
    return logits.device.type == "cuda"


def _apply_penalties_dense(
    logits: Tensor,
    rows: list[int],
    options: list[SamplingOptions],
    token_ids: list[list[int]],
    num_prompt_tokens: list[int],
) -> None:
    """``_apply_penalties``'s values with shapes known on the host, so nothing is read back:
    each row's generated-token counts and prompt hits over the whole vocabulary (``index_add_``
    of whole numbers: exact in any order), the same formulas over every entry, and the old value
    kept where the row never saw the token."""
    vocab = logits.shape[1]
    n_rows = len(rows)
    seen_tokens = _SeenTokens(logits, rows, token_ids, num_prompt_tokens)
    if seen_tokens.total == 0:
        return
    rep, freq, pres = _penalties(logits, rows, options)
    valid, is_gen, row_of = seen_tokens.valid, seen_tokens.is_gen, seen_tokens.row_of
    keys = row_of * vocab + seen_tokens.flat.clamp(0, vocab - 1)
    counts = torch.zeros(n_rows * vocab, dtype=logits.dtype, device=logits.device)
    counts.index_add_(0, keys, (valid & is_gen).to(logits.dtype))
    hits = torch.zeros(n_rows * vocab, dtype=logits.dtype, device=logits.device)
    hits.index_add_(0, keys, (valid & ~is_gen & (rep[row_of] != 1.0)).to(logits.dtype))
    counts, seen = counts.view(n_rows, vocab), ((counts > 0) | (hits > 0)).view(n_rows, vocab)
    all_rows = n_rows == logits.shape[0]
    row_t = None if all_rows else on_device(logits, rows)
    vals = logits if all_rows else logits[row_t]
    r = rep.to(logits.dtype).unsqueeze(1)
    new = torch.where(vals > 0, vals / r, vals * r)
    new = new - freq.to(logits.dtype).unsqueeze(1) * counts
    new = new - pres.to(logits.dtype).unsqueeze(1) * (counts > 0).to(logits.dtype)
    new = torch.where(seen, new, vals)
    if all_rows:
        logits.copy_(new)
    else:
        logits[row_t] = new


def repair_non_finite(logits: Tensor, row_max: Tensor) -> None:
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
