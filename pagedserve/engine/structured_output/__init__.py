"""Structured outputs and token masks (allowed_token_ids, bad_words) on the engine side: grammar
validation and compilation (xgrammar), per-sequence matchers, and each step's token bitmask for
the constrained rows (applied by the worker's sampler, gpu/sampling_mask.py)."""
from pagedserve.engine.structured_output.manager import StructuredOutputManager  # noqa: F401
from pagedserve.engine.structured_output.xgrammar_backend import GrammarError  # noqa: F401
