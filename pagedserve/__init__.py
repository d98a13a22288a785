"""pagedserve: an OpenAI-compatible LLM inference server, CPU first.

The rooms (app, engine, gpu, kernels, contracts, loadtest) live under this one namespace so an
installed wheel adds a single top-level name."""
from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("pagedserve")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0.1.0"
