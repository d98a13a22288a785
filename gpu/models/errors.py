"""Typed errors of model building and weight loading (no torch import: the engine catches them)."""
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
