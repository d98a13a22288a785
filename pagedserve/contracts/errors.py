"""Typed errors that cross rooms: model building and weight loading, and failed workers.

No torch import: the engine and the HTTP layer catch them without loading a model.
"""
from __future__ import annotations


class ModelLoadError(ValueError):
    """The model cannot be built or its weights cannot be loaded; the message names file and tensor."""


class UnsupportedArchitectureError(ModelLoadError):
    """The checkpoint's architecture has no implementation here."""

    def __init__(self, architectures: list[str] | str | None, supported: list[str]):
        self.architectures = architectures
        self.supported = sorted(supported)
        super().__init__(
            f"unsupported model architecture {architectures!r}; supported architectures: "
            f"{', '.join(self.supported)}"
        )


class ExecutorError(RuntimeError):
    """The workers failed (died, or a step raised); in-flight requests cannot finish."""
