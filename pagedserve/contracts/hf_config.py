"""A model's Hugging Face-style config dict, from config.json or from GGUF metadata.

No torch import: the engine reads the config (context length, EOS ids) before any worker exists.
"""
from __future__ import annotations

import json
import os

from pagedserve.contracts.errors import ModelLoadError

# GGUF general.architecture -> HF architectures name. These use llama.cpp's "<arch>.*" keys.
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
}


def load_hf_config(path: str) -> dict:
    """config.json of a model directory, or the GGUF file's metadata mapped to the same keys."""
    if path is None:
        from pagedserve.contracts.config import default_model_path

        path = default_model_path()
    if os.path.isdir(path):
        cfg_path = os.path.join(path, "config.json")
        if not os.path.isfile(cfg_path):
            raise ModelLoadError(f"{path}: model directory has no config.json")
        try:
            with open(cfg_path, encoding="utf-8") as f:
                cfg = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ModelLoadError(f"{cfg_path}: cannot read the model config: {e}") from None
        return normalize_config(cfg)
    if os.path.isfile(path) and is_gguf(path):
        return gguf_to_hf_config(path)
    if not os.path.exists(path):
        raise ModelLoadError(f"{path}: no such model file or directory (pass a .gguf file or a "
                             "Hugging Face model directory)")
    raise ModelLoadError(f"{path}: not a GGUF file nor a model directory with config.json")


def is_gguf(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


# Multimodal architectures served text-only: their language model's config (``text_config``) is
# the model's config; the vision tower's weights are skipped at load. Published checkpoints write
# only what differs from transformers' text-config defaults (gemma-3-4b-it: five keys), so the
# defaults (Gemma3TextConfig's) fill the rest.
TEXT_ONLY_ARCHITECTURES = {
    "Gemma3ForConditionalGeneration": {
        "model_type": "gemma3_text", "vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216,
        "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131072, "rms_norm_eps": 1e-6,
        "query_pre_attn_scalar": 256, "sliding_window": 4096, "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10000.0, "sliding_window_pattern": 6, "tie_word_embeddings": True,
        "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0,
    },
}


def _lift_text_config(cfg: dict) -> dict:
    archs = cfg.get("architectures") or []
    text = cfg.get("text_config")
    served = [a for a in archs if a in TEXT_ONLY_ARCHITECTURES]
    if not isinstance(text, dict) or not served:
        return cfg
    defaults = dict(TEXT_ONLY_ARCHITECTURES[served[0]])
    if "rope_parameters" in text:  # transformers 5: the bases live there
        defaults.pop("rope_theta"), defaults.pop("rope_local_base_freq")
    lifted = dict(defaults, **text, architectures=list(archs))
    for key in ("tie_word_embeddings", "eos_token_id", "bos_token_id", "pad_token_id"):
        if cfg.get(key) is not None:
            lifted[key] = cfg[key]
    return lifted


def normalize_config(cfg: dict) -> dict:
    """Fill the common keys the rest of the code reads, whatever the family calls them."""
    cfg = _lift_text_config(dict(cfg))
    if "n_embd" in cfg:  # GPT-2 names
        cfg.setdefault("hidden_size", cfg["n_embd"])
        cfg.setdefault("num_hidden_layers", cfg.get("n_layer"))
        cfg.setdefault("num_attention_heads", cfg.get("n_head"))
        cfg.setdefault("num_key_value_heads", cfg.get("n_head"))
        cfg.setdefault("max_position_embeddings", cfg.get("n_positions"))
        cfg.setdefault("intermediate_size", cfg.get("n_inner") or 4 * cfg["n_embd"])
        cfg.setdefault("tie_word_embeddings", True)
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and cfg.get("rope_theta") is None and "rope_theta" in params:
        cfg["rope_theta"] = params["rope_theta"]
        if cfg.get("rope_scaling") is None and params.get("rope_type", "default") != "default":
            cfg["rope_scaling"] = {k: v for k, v in params.items() if k != "rope_theta"}
    cfg.setdefault("rope_scaling", None)
    if cfg.get("num_key_value_heads") is None and cfg.get("num_attention_heads"):
        cfg["num_key_value_heads"] = cfg["num_attention_heads"]
    if cfg.get("head_dim") is None and cfg.get("hidden_size") and cfg.get("num_attention_heads"):
        cfg["head_dim"] = cfg["hidden_size"] // cfg["num_attention_heads"]
    return cfg


def open_gguf(path: str):
    """The parsed GGUF file (contracts.gguf_file: metadata and a memory map of the tensors)."""
    from pagedserve.contracts.gguf_file import read_gguf

    return read_gguf(path)


def read_gguf_metadata(path: str, reader=None) -> tuple[dict, list[str]]:
    """(scalar and string metadata, tensor names). Large arrays (vocab, merges) are skipped."""
    from pagedserve.contracts.gguf_file import array_length, tensor_names

    if reader is None:
        reader = open_gguf(path)
    meta = {}
    for key, field in reader.fields.items():
        n = array_length(field)
        if n is not None and n > 64:
            continue
        meta[key] = field.contents()
    return meta, tensor_names(reader)


def gguf_to_hf_config(path: str, reader=None) -> dict:
    meta, tensor_names = read_gguf_metadata(path, reader)
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        from pagedserve.contracts.errors import UnsupportedArchitectureError

        raise UnsupportedArchitectureError(f"gguf:{arch}", [f"gguf:{a}" for a in GGUF_ARCHITECTURES])

    def get(key, default=None):
        return meta.get(f"{arch}.{key}", default)

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    kv_heads = int(get("attention.head_count_kv", heads))
    vocab = get("vocab_size")
    if vocab is None:  # not always written: count the vocabulary tokens instead
        from pagedserve.contracts.gguf_file import array_length

        vocab = array_length((reader or open_gguf(path)).fields["tokenizer.ggml.tokens"])
    cfg = {
        "architectures": [GGUF_ARCHITECTURES[arch]],
        "model_type": {"qwen3moe": "qwen3_moe"}.get(arch, arch),
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": int(get("attention.key_length", hidden // heads)),
        "intermediate_size": int(get("feed_forward_length")),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(get("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "torch_dtype": "float32",
    }
    if arch == "qwen2":
        cfg["attention_bias"] = True
    experts = int(get("expert_count", 0) or 0)
    if experts:  # a mixture of experts: qwen3moe, or Mixtral written as "llama" with experts
        if arch == "llama":
            cfg["architectures"], cfg["model_type"] = ["MixtralForCausalLM"], "mixtral"
        cfg.update(num_local_experts=experts, num_experts_per_tok=int(get("expert_used_count")),
                   moe_intermediate_size=int(get("expert_feed_forward_length", cfg["intermediate_size"])),
                   norm_topk_prob=bool(get("expert_weights_norm", True)), decoder_sparse_step=1,
                   mlp_only_layers=[])
    scaling_type = get("rope.scaling.type")
    if scaling_type == "linear" and get("rope.scaling.factor"):
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
    elif scaling_type not in (None, "none"):
        raise ModelLoadError(f"{path}: unsupported GGUF rope scaling {scaling_type!r} (supported: linear)")
    if "rope_freqs.weight" in tensor_names:
        raise ModelLoadError(f"{path}: GGUF files with a rope_freqs tensor (Llama 3.1 rope scaling) "
                             "are not supported; load the Hugging Face directory instead")
    from pagedserve.contracts.gguf_arch import add_arch_config

    add_arch_config(arch, cfg, get, reader, path)
    return cfg
