"""Pipeline stages inside a model: which parts a stage builds, and what travels between stages.

A model built on stage s of a pipeline (gpu.parallel_state) holds only its layers
``stage_layer_range(num_layers)``; the embedding lives on the first stage, the final norm and
the LM head on the last (which also keeps the embedding table when the head is tied to it).
Everything else is a ``MissingLayer``: no parameters, so the weight loader skips its
checkpoint tensors and the stage's memory holds only its share of the model.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from pagedserve.gpu.parallel_state import is_first_stage, is_last_stage, stage_layer_range

_LAYER_INDEX = re.compile(r"\.(?:layers|h)\.(\d+)\.")


class MissingLayer(nn.Module):
    """A part another stage owns: no parameters, and running it is a bug."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("this part of the model lives on another pipeline stage")


@dataclass(slots=True)
class StageActivations:
    """What one stage hands the next: the hidden states and, for models that carry one
    (pre-norm Llama with the fused add+norm), the residual stream; both ``[num_tokens, hidden]``."""

    hidden: torch.Tensor
    residual: torch.Tensor | None = None


@dataclass(slots=True, frozen=True)
class StagePlan:
    start: int  # first layer this stage owns
    end: int  # one past its last layer
    first: bool  # holds the embedding
    last: bool  # holds the final norm and the LM head

    @classmethod
    def current(cls, num_layers: int) -> "StagePlan":
        start, end = stage_layer_range(num_layers)
        return cls(start, end, is_first_stage(), is_last_stage())

    @property
    def whole(self) -> bool:
        return self.first and self.last

    def owns_layer(self, index: int) -> bool:
        return self.start <= index < self.end

    def owns_weight(self, name: str) -> bool:
        """False for a checkpoint tensor of a decoder layer another stage owns."""
        m = _LAYER_INDEX.search(name)
        return m is None or self.owns_layer(int(m.group(1)))
