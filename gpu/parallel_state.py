"""Tensor-parallel rank, size and collectives.

One process per rank; at world size 1 (the default) every collective is the identity, so model
code can call them unconditionally. The multi-process executor calls ``init_tensor_parallel``
once per worker after ``torch.distributed`` is set up.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _TPState:
    rank: int = 0
    size: int = 1
    group: object | None = None  # a torch.distributed ProcessGroup; None = the default group


_state = _TPState()


def init_tensor_parallel(rank: int, size: int, group: object | None = None) -> None:
    """Set this process's tensor-parallel rank and size (before the model is built)."""
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"invalid tensor-parallel rank {rank} for size {size}")
    _state.rank, _state.size, _state.group = rank, size, group
    logger.debug("tensor parallel rank %d of %d", rank, size)


def reset_tensor_parallel() -> None:
    """Back to a single rank (tests, worker shutdown)."""
    init_tensor_parallel(0, 1, None)


def get_tp_rank() -> int:
    return _state.rank


def get_tp_size() -> int:
    return _state.size


def get_tp_group() -> object | None:
    return _state.group


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum over the tensor-parallel ranks (in place when distributed)."""
    if _state.size == 1:
        return x
    import torch.distributed as dist

    dist.all_reduce(x, group=_state.group)
    return x


def tp_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim``, rank order."""
    if _state.size == 1:
        return x
    import torch.distributed as dist

    parts = [torch.empty_like(x) for _ in range(_state.size)]
    dist.all_gather(parts, x.contiguous(), group=_state.group)
    return torch.cat(parts, dim=dim)


def divide(numerator: int, denominator: int, what: str = "value") -> int:
    """Exact division for shard sizes, with an error that says which dimension does not split."""
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) is not divisible by the tensor-parallel size ({denominator})")
    return numerator // denominator
