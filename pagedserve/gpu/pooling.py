"""Worker-side pooling: one vector per pooling sequence out of its prompt's hidden states.

A pooling sequence (embeddings) is prefilled like any prompt, in chunks over several steps if
the scheduler splits it, so the pooler keeps what it needs between chunks (a running float32
sum for "mean", the first row for "cls", nothing for "last") and produces the vector when the
last chunk has been computed. Hidden states are the model's output, i.e. after its final norm,
as vLLM's pooler (and transformers' ``last_hidden_state``) take them.

"mean" and "cls" need every prompt position computed here, so the engine never gives them a
prefix-cache hit; "last" only needs the last position, which a cache hit never covers.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedserve.contracts.messages import NewSeq, PoolingOptions

POOLING_TYPES = ("last", "mean", "cls")


class Pooler:
    """The pooling state of one sequence between its prefill chunks."""

    __slots__ = ("options", "total", "count", "first")

    def __init__(self, options: PoolingOptions, num_computed_tokens: int) -> None:
        if options.pooling_type not in POOLING_TYPES:
            raise ValueError(f"unknown pooling type {options.pooling_type!r}: choose one of {POOLING_TYPES}")
        if options.pooling_type != "last" and num_computed_tokens:
            raise ValueError(f"{options.pooling_type} pooling needs every prompt token computed, "
                             f"but {num_computed_tokens} came from the prefix cache")
        self.options = options
        self.total: torch.Tensor | None = None  # mean: float32 sum of the rows seen so far
        self.count = 0
        self.first: torch.Tensor | None = None  # cls: the first token's row

    def add(self, hidden: torch.Tensor, done: bool) -> bytes | None:
        """Feed one chunk's rows ``[n, hidden]``; returns the pooled vector (float32 bytes) once
        the chunk that completes the prompt has been fed, else None."""
        kind = self.options.pooling_type
        if kind == "mean":
            part = hidden.float().sum(0)
            self.total = part if self.total is None else self.total + part
            self.count += hidden.shape[0]
        elif kind == "cls" and self.first is None:
            self.first = hidden[0].float()
        if not done:
            return None
        if kind == "mean":
            vec = self.total / self.count
        elif kind == "cls":
            vec = self.first
        else:
            vec = hidden[-1].float()
        return finish_vector(vec, self.options)


def finish_vector(vec: torch.Tensor, options: PoolingOptions) -> bytes:
    """Truncate (Matryoshka ``dimensions``), then L2-normalise, as float32 bytes in native order."""
    if options.dimensions is not None:
        vec = vec[: options.dimensions]
    if options.normalize:
        vec = F.normalize(vec, p=2, dim=0)
    return vec.detach().to("cpu", torch.float32).contiguous().numpy().tobytes()


def new_pooler(new: NewSeq) -> Pooler | None:
    return None if new.pooling is None else Pooler(new.pooling, new.num_computed_tokens)

