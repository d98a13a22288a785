"""A tiny random Llama with the default model's tokenizer: fast engine tests with real text.

The config lives in loadtest.local_server (the package cannot import tests/); see the comment
there on why its embeddings are untied."""
from __future__ import annotations

from loadtest.local_server import TINY_CONFIG  # noqa: F401  (one definition, in the package)


def tiny_llm(**options):
    """LLM over TINY_CONFIG (random weights, fp32) with the default model's tokenizer."""
    from engine.llm import LLM
    from contracts.config import default_model_path

    options = {"load_format": "dummy", "hf_config": TINY_CONFIG, "dtype": "float32",
               "kv_cache_memory": 1 / 16, **options}
    return LLM(model=default_model_path(), **options)
