"""Settings of a pooling request (embeddings, scores), as vLLM's ``PoolingParams``.

Any decoder model the engine loads serves pooling requests beside generation, per request: no
``--task`` switch. A pooling request is a prompt that is prefilled (chunked, prefix-cached,
batched with decodes like any other) and then finished at once, its blocks freed; instead of
tokens it yields one vector pooled from the hidden states after the model's final norm.

- ``pooling_type``: "last" (default, the last token's hidden state, as vLLM's embedding
  conversion of decoder models), "mean" (over the prompt) or "cls" (the first token's).
- ``normalize``: L2-normalise the vector (default true).
- ``dimensions``: keep the first ``dimensions`` values (Matryoshka truncation), then normalise.
"""
from __future__ import annotations

from dataclasses import dataclass

from pagedserve.engine.errors import SamplingParamsError
from pagedserve.contracts.messages import PoolingOptions

POOLING_TYPES = ("last", "mean", "cls")


@dataclass(slots=True)
class PoolingParams:
    pooling_type: str = "last"
    normalize: bool = True
    dimensions: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.pooling_type, str):
            self.pooling_type = self.pooling_type.lower()
        if self.pooling_type not in POOLING_TYPES:
            raise SamplingParamsError("pooling_type", f"pooling_type must be one of {', '.join(POOLING_TYPES)}, "
                                                      f"got {self.pooling_type!r}")
        if not isinstance(self.normalize, bool):
            raise SamplingParamsError("normalize", f"normalize must be true or false, got {self.normalize!r}")
        d = self.dimensions
        if d is not None and (not isinstance(d, int) or isinstance(d, bool) or d < 1):
            raise SamplingParamsError("dimensions", f"dimensions must be a positive integer, got {d!r}")

    @property
    def uses_prefix_cache(self) -> bool:
        """Only "last" pooling can skip cached positions (a hit never covers the last token)."""
        return self.pooling_type == "last"

    def to_pooling_options(self) -> PoolingOptions:
        return PoolingOptions(self.pooling_type, self.normalize, self.dimensions)
