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


# ---- pipeline parallelism -------------------------------------------------------------------
#
# Global rank = pp_rank * tp_size + tp_rank: a stage is tp_size consecutive ranks, and tensor rank t
# of stage s hands its activations to tensor rank t of stage s + 1 (gpu/pipeline.py).


@dataclass(slots=True)
class _PPState:
    rank: int = 0  # this process's stage
    size: int = 1  # number of stages
    prev_rank: int | None = None  # global rank that sends this stage its activations
    next_rank: int | None = None  # global rank this stage sends its activations to


_pp = _PPState()


def init_pipeline_parallel(rank: int, size: int, prev_rank: int | None = None,
                           next_rank: int | None = None) -> None:
    """Set this process's stage (before the model is built: models keep only their stage's layers)."""
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"invalid pipeline stage {rank} for {size} stage(s)")
    _pp.rank, _pp.size, _pp.prev_rank, _pp.next_rank = rank, size, prev_rank, next_rank
    logger.debug("pipeline stage %d of %d", rank, size)


def reset_pipeline_parallel() -> None:
    init_pipeline_parallel(0, 1)


def get_pp_rank() -> int:
    return _pp.rank


def get_pp_size() -> int:
    return _pp.size


def get_pp_peers() -> tuple[int | None, int | None]:
    """(previous stage's global rank, next stage's global rank); None at the ends."""
    return _pp.prev_rank, _pp.next_rank


def is_first_stage() -> bool:
    return _pp.rank == 0


def is_last_stage() -> bool:
    return _pp.rank == _pp.size - 1


def stage_layer_range(num_layers: int, stage: int | None = None, num_stages: int | None = None) -> tuple[int, int]:
    """[start, end) of the contiguous layers a stage owns: an even split, the first stages taking
    one more layer each when it does not divide (vLLM puts the remainder on the last stages; the
    first stage here also holds the embedding, the last the norm and logits, so either is fair)."""
    stage = _pp.rank if stage is None else stage
    num_stages = _pp.size if num_stages is None else num_stages
    if num_layers < num_stages:
        raise ValueError(f"the model has {num_layers} layers, fewer than the {num_stages} pipeline "
                         "stages: lower --pipeline-parallel-size")
    base, extra = divmod(num_layers, num_stages)
    start = stage * base + min(stage, extra)
    return start, start + base + (1 if stage < extra else 0)
