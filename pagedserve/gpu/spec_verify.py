"""Verifying draft tokens on the worker (speculative decoding; contracts/messages.py step 4b).

A row with d drafts computes its last token and the d drafts in one varlen chunk, so the forward
yields the target model's logits at d + 1 positions. Position j is sampled exactly as a plain
decode would sample the token after ``token_ids + drafts[:j]``: the same logits processing
(penalties see the drafts before j as generated tokens), the same seeded uniform (its index is
the number of tokens generated so far). The row keeps the drafts up to the first j where the
sampled token differs from draft j, plus the token sampled there (or, all accepted, the bonus
token sampled after the last draft).

Why this is rejection sampling: the drafts (prompt lookup, or a draft model run greedily) are a
point mass q = 1 at draft token d. Speculative sampling accepts d with probability
min(1, p(d) / q(d)) = p(d) and otherwise draws from normalize(max(p - q, 0)), which is p without
d. Drawing t ~ p and accepting when t == d does exactly that: P(accept) = p(d), and a rejected
draw is a sample of p conditioned on t != d. So the output follows the target distribution, and
because every position's draw is the one a plain decode would make, a seeded request (or a
greedy one) gives the very tokens it gives without speculation.
"""
from __future__ import annotations

from pagedserve.contracts.messages import StepInput


def draft_slices(step: StepInput) -> list[list[int]] | None:
    """Each scheduled row's draft tokens, in batch order; None when the step has none."""
    if not step.num_draft_tokens_buf:
        return None
    flat = step.draft_token_ids.tolist()
    out: list[list[int]] = []
    at = 0
    for d in step.num_draft_tokens:
        out.append(flat[at:at + d])
        at += d
    return out


def num_accepted(sampled: list[int], drafts: list[int]) -> int:
    """Length of the longest prefix of ``drafts`` equal to the tokens sampled at those positions."""
    a = 0
    while a < len(drafts) and sampled[a] == drafts[a]:
        a += 1
    return a


def keep_accepted(spec_rows: list[tuple[int, list[int]]], states: list, result, block_size: int):
    """Each sampled sequence keeps its accepted drafts and the token sampled after them; the
    accepted drafts count as computed and the block table drops the blocks only rejected drafts
    used (the engine frees the same ones, engine/scheduler.py ``accept_drafts``).

    ``spec_rows``: per sampled sequence (its first sampler row, its drafts; [] for none);
    ``states``: the sampler rows' sequence states; ``result``: the sampler's output. Returns the
    tokens and logprobs flattened, and each sequence's token count."""
    token_ids: list[int] = []
    logprobs = [] if result.logprobs is not None else None
    num_tokens: list[int] = []
    for first, d in spec_rows:
        a = num_accepted(result.token_ids[first:first + len(d)], d) if d else 0
        kept = result.token_ids[first:first + a + 1]
        s = states[first]
        s.token_ids.extend(kept)
        token_ids.extend(kept)
        num_tokens.append(a + 1)
        if logprobs is not None:
            logprobs.extend(result.logprobs[first:first + a + 1])
        if d:
            s.num_computed += a
            del s.block_table[-(-len(s.token_ids) // block_size):]
    return token_ids, logprobs, num_tokens
