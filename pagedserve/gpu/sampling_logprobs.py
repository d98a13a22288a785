"""Logprobs for the API: the sampled token's logprob and the row's top-k, for generated tokens
and for prompt tokens (``compute_prompt_logprobs``), read back in the step's one host copy."""
from __future__ import annotations

import torch
from torch import Tensor

from pagedserve.contracts.messages import SampledLogprobs
from pagedserve.gpu.sampling_host import fetch_to_host


class LogprobReadback:
    """A step's logprob tensors (each row's chosen token's logprob and its top-k), made on the
    device and read back with the step's tokens in its one host copy (``ints`` / ``floats``
    join that copy; ``entries`` builds the API values from what came back).

    A k above the vocabulary gets the whole vocabulary: each row's slice of the flattened top-k
    is capped at ``k_max``, so it never reaches into the next row (issue 22: another request's
    tokens and logprobs)."""

    __slots__ = ("ks", "k_max", "ints", "floats")

    def __init__(self, logprobs: Tensor, chosen: Tensor, ks: list[int]):
        self.ks = ks
        self.k_max = min(max(ks, default=0), logprobs.shape[1])
        self.ints: list[Tensor] = []
        self.floats = [logprobs.gather(1, chosen.long().unsqueeze(1)).squeeze(1)]
        if self.k_max > 0:
            tv, ti = logprobs.topk(self.k_max, dim=-1)
            self.ints.append(ti)
            self.floats.append(tv)

    def entries(self, host_ints: list[list[int]], host_floats: list[list[float]]) -> list[SampledLogprobs]:
        """The rows' SampledLogprobs from the host copies of ``ints`` and ``floats``, in order."""
        top_ids = host_ints[0] if self.k_max > 0 else []
        top_vals = host_floats[1] if self.k_max > 0 else []
        out = []
        for r, k in enumerate(self.ks):
            at = r * self.k_max
            k = min(k, self.k_max)
            top = list(zip(top_ids[at:at + k], top_vals[at:at + k])) if k > 0 else []
            out.append(SampledLogprobs(logprob=host_floats[0][r], top=top))
        return out


def logprob_entries(
    logprobs: Tensor, chosen: Tensor, ks: list[int], also: Tensor | None = None
) -> tuple[list[int], list[SampledLogprobs]]:
    """Logprob of each row's chosen token and its top-k, read back in one copy together with
    ``also`` (token ids; returned as the first value, [] without it)."""
    lp = LogprobReadback(logprobs, chosen, ks)
    ints = ([also] if also is not None else []) + lp.ints
    host_ints, host_floats = fetch_to_host(ints, lp.floats)
    token_list = host_ints[0] if also is not None else []
    return token_list, lp.entries(host_ints[1:] if also is not None else host_ints, host_floats)


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
    return logprob_entries(logprobs, chosen, [max(k, 0)] * logits.shape[0])[1]
