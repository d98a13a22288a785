"""A tiny random Llama with the default model's tokenizer: fast engine tests with real text.

The config is loadtest/tiny_model.py's (data only, in the package because `bench soak
--start-server` serves it and the package cannot import tests/); see there why its embeddings
are untied."""
from __future__ import annotations

from pagedserve.loadtest.tiny_model import TINY_CONFIG  # noqa: F401  (one definition, in the package)


def tiny_llm(**options):
    """LLM over TINY_CONFIG (random weights, fp32) with the default model's tokenizer."""
    from pagedserve.engine.llm import LLM
    from pagedserve.contracts.config import default_model_path

    options = {"load_format": "dummy", "hf_config": TINY_CONFIG, "dtype": "float32",
               "kv_cache_memory": 1 / 16, **options}
    return LLM(model=default_model_path(), **options)
