"""A tiny random Llama with the default model's tokenizer: fast engine tests with real text.

Embeddings are untied: a tied random model mostly repeats its last input token, which would let
greedy-equality tests pass even with broken attention."""
from __future__ import annotations

TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152,
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "max_position_embeddings": 2048, "rope_theta": 10000.0, "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
}


def tiny_llm(**options):
    """LLM over TINY_CONFIG (random weights, fp32) with the default model's tokenizer."""
    from engine.llm import LLM
    from gpu.config import default_model_path

    options = {"load_format": "dummy", "hf_config": TINY_CONFIG, "dtype": "float32",
               "kv_cache_memory_gib": 1 / 16, **options}
    return LLM(model=default_model_path(), **options)
