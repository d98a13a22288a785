"""The tiny random-weight Llama that starts in seconds (a step takes milliseconds), over the default
model's tokenizer so requests carry real text.

One definition, data only (it imports nothing): `bench soak --start-server` serves it through
loadtest/local_server.py (passed as ``--hf-config`` JSON), the micro-benchmarks load it in
process, and the tests read it through tests/tiny.py. It lives in the package, not in tests/,
because the package must not import tests/; it is no contract between the server's rooms, so not
in contracts/ either.

Embeddings are untied: a tied random model mostly repeats its last input token, which would let
greedy-equality tests pass even with broken attention.
"""
from __future__ import annotations

TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152,
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "max_position_embeddings": 2048, "rope_theta": 10000.0, "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
}
