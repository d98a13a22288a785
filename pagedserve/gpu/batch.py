"""The runner's view of one step's rows: a request's new tokens with its place in the cache, and
the flat tensors built from them (``ModelRunner.prepare``). Their own module so the draft model's
runner (gpu/spec_draft.py) and the pipeline stages build batches without importing the runner."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.kernels.metadata import AttentionMetadata


@dataclass(slots=True)
class BatchRequest:
    """One request of a hand-built batch (``ModelRunner.forward``): tokens to compute now."""

    token_ids: list[int]  # the new tokens
    start_position: int  # position of token_ids[0] (= tokens already in the cache)
    block_table: list[int]


@dataclass(slots=True)
class PreparedBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
