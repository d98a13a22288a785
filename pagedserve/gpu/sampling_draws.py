"""Drawing one token per row by inverse CDF: the seeded uniform number, the two-level
full-vocabulary draw, the draw among sorted top-k / top-p candidates, and the histogram path
for a very large top-p nucleus. Every draw goes in descending-logit order with prefix-stable
weights, so a seeded row gets the same token whichever path it takes (see gpu.sampler)."""
from __future__ import annotations

import torch
from torch import Tensor

from pagedserve.gpu.sampling_host import on_device

# Chunk width of the two-level full-vocabulary draw.
_CHUNK = 256

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def seeded_uniform(seed: int, step: int) -> float:
    """A uniform number in [0, 1) that depends only on (seed, step)."""
    z = _splitmix64(_splitmix64(seed & _MASK64) ^ (step & _MASK64))
    return (z >> 11) * (1.0 / (1 << 53))


# Logit buckets of the histogram top-p path.
_HIST_BUCKETS = 2048


def draw_top_p_by_histogram(
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

    p_t = on_device(logits, top_ps, torch.float64)
    _, kept_mass = crossing(p_t, strict=False)  # last kept token: first with cum >= p
    kept = on_device(logits, kept_mass, torch.float64)
    x = torch.minimum(u * kept, kept * (1 - 2.0**-52))
    chosen, _ = crossing(x, strict=True)  # first token with cum > x
    return on_device(logits, chosen, torch.long)


def draw_full_vocab(probs: Tensor, u: Tensor) -> Tensor:
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
    # x rounded onto the total lands on an empty chunk: take the heaviest instead. Always
    # computed (a no-op for other rows) rather than checked: a check is a host read per step.
    c_mass = mass.gather(1, c.unsqueeze(1)).squeeze(1)
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
    j = torch.where(ok, j, inner.argmax(dim=-1))  # a zero-width token: as above, no host read
    return cols.gather(1, j.unsqueeze(1)).squeeze(1)


def draw_from_candidates(
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
    ks = on_device(vals, [k if k > 0 else k_cap for k in top_ks])
    beyond_k = torch.arange(k_cap, device=vals.device).unsqueeze(0) >= ks.unsqueeze(1)
    weights.masked_fill_(beyond_k, 0.0)
    if full_norm:
        fn = on_device(vals, full_norm)
        assert full_probs is not None
        weights[fn] = full_probs.gather(1, idx[fn])
    cum = torch.cumsum(weights, dim=-1, dtype=torch.float64)
    total = cum[:, -1].clone()
    fits = torch.ones(rows, dtype=torch.bool, device=vals.device)
    if full_norm:
        fn = on_device(vals, full_norm)
        total.index_fill_(0, fn, 1.0)  # not total[fn] = 1.0: a blocking copy of the 1.0 on CUDA
        p_fn = on_device(vals, [top_ps[j] for j in full_norm], torch.float64)
        last = k_cap - 1 if check_len is None else min(check_len, k_cap) - 1
        fits[fn] = cum[fn, last] >= p_fn

    if any(p < 1.0 for p in top_ps):
        p_t = on_device(vals, top_ps, torch.float64)
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
