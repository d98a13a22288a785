"""The config keys of the GGUF architectures beyond Llama's (``gemma2``, ``gemma3``, ``phi3``), as
llama.cpp's converter writes them, mapped to the Hugging Face config the models read.

What the files do not store is what llama.cpp itself assumes: Gemma's query scale is head_dim's
except on the 27B models (hidden / heads), Gemma 3's local rope base is 10000 and every sixth
layer is global; Phi-3's LongRoPE factors are tensors (``rope_factors_long/short.weight``).
No torch import: the engine reads the config before any worker exists.
"""
from __future__ import annotations

from collections.abc import Callable

from pagedserve.contracts.errors import ModelLoadError

_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}  # llama.cpp's LLM_TYPE_27B, which scales by hidden / heads


def add_arch_config(arch: str, cfg: dict, get: Callable, reader, path: str) -> None:
    """Fill ``cfg`` (the Llama-shaped config from the GGUF) with ``arch``'s own keys; ``get(key)``
    reads ``<arch>.<key>``; ``reader`` is the parsed file (None: parsed here when tensors are needed)."""
    if arch in ("gemma2", "gemma3"):
        _gemma(arch, cfg, get)
    elif arch == "phi3":
        _phi3(cfg, get, reader, path)


def _gemma(arch: str, cfg: dict, get: Callable) -> None:
    layers, hidden, heads = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"]
    cfg["hidden_activation"] = "gelu_pytorch_tanh"
    cfg["query_pre_attn_scalar"] = hidden // heads if layers == _GEMMA_27B_LAYERS[arch] else cfg["head_dim"]
    cfg["sliding_window"] = int(get("attention.sliding_window", 4096))
    cfg["attn_logit_softcapping"] = get("attn_logit_softcapping")
    cfg["final_logit_softcapping"] = get("final_logit_softcapping")
    pattern = get("attention.sliding_window_pattern")
    if isinstance(pattern, (list, tuple)) and len(pattern) == layers:  # per layer: True = sliding
        cfg["layer_types"] = ["sliding_attention" if p else "full_attention" for p in pattern]
    else:
        period = int(pattern) if isinstance(pattern, int) and pattern > 0 else (2 if arch == "gemma2" else 6)
        cfg["layer_types"] = ["sliding_attention" if (i + 1) % period else "full_attention" for i in range(layers)]
    if arch == "gemma3":
        full = {"rope_type": "default", "rope_theta": cfg["rope_theta"]}
        if cfg.get("rope_scaling"):  # linear scaling (4B and up) applies to the global layers only
            full.update(cfg["rope_scaling"])
        cfg["rope_parameters"] = {
            "full_attention": full,
            "sliding_attention": {"rope_type": "default", "rope_theta": float(get("rope.freq_base_swa", 10000.0))},
        }
        cfg["rope_scaling"] = None


def _phi3(cfg: dict, get: Callable, reader, path: str) -> None:
    rot = get("rope.dimension_count")
    if rot is not None and int(rot) != cfg["head_dim"]:
        cfg["partial_rotary_factor"] = int(rot) / cfg["head_dim"]
    window = get("attention.sliding_window")
    if window:
        cfg["sliding_window"] = int(window)
    if reader is None:
        from pagedserve.contracts.gguf_file import read_gguf

        reader = read_gguf(path)
    tensors = {t.name: t for t in reader.tensors}
    long_t, short_t = tensors.get("rope_factors_long.weight"), tensors.get("rope_factors_short.weight")
    if long_t is None and short_t is None:
        return
    if long_t is None or short_t is None:
        raise ModelLoadError(f"{path}: a phi3 GGUF with only one of rope_factors_long / rope_factors_short")
    original = get("rope.scaling.original_context_length")
    if not original:
        raise ModelLoadError(f"{path}: phi3 LongRoPE factors without rope.scaling.original_context_length")
    cfg["original_max_position_embeddings"] = int(original)
    cfg["rope_scaling"] = {
        "rope_type": "longrope", "original_max_position_embeddings": int(original),
        "long_factor": [float(x) for x in long_t.data.reshape(-1)],
        "short_factor": [float(x) for x in short_t.data.reshape(-1)],
    }
    attn = get("rope.scaling.attn_factor")
    if attn is not None:
        cfg["rope_scaling"]["attention_factor"] = float(attn)
