"""PEFT LoRA adapter directories, read and checked against the base model without torch.

Why here: the engine checks an adapter when a request (or `load_lora_adapter`) names it, so a bad
adapter is a clear error at load time and never a crash inside a step; the workers load the
same tensors later by the names this check found. Only the safetensors header (a JSON document
after an 8-byte length) is read here, never the weights.

PEFT's layout (peft.utils.save_and_load): ``adapter_config.json`` (``peft_type`` "LORA", ``r``,
``lora_alpha``, ``use_rslora``, ...) and ``adapter_model.safetensors`` with, per adapted linear,
``base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight`` ([r, in]) and ``...lora_B.weight``
([out, r]); the delta is ``scaling * x A^T B^T`` with scaling ``lora_alpha / r`` or, with rsLoRA,
``lora_alpha / sqrt(r)``.
"""
from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# The projections an adapter may adapt, and the block of the decoder layer each lives in.
TARGET_MODULES = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
                  "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
_FLOAT_DTYPES = ("F32", "F16", "BF16")


class LoRAAdapterError(ValueError):
    """An adapter that cannot be served over this model; the message says what is wrong."""


@dataclass(frozen=True, slots=True)
class LoRAModuleWeights:
    layer: int
    module: str  # one of TARGET_MODULES
    a_key: str  # tensor name of A ([rank, in])
    b_key: str  # tensor name of B ([out, rank])


@dataclass(frozen=True, slots=True)
class AdapterSpec:
    """A checked adapter: where its tensors are and how to scale them."""

    path: str
    weights_file: str
    rank: int
    scaling: float
    modules: tuple[LoRAModuleWeights, ...]


def module_shapes(hf_config: dict) -> dict[str, tuple[int, int]]:
    """(in, out) features of each target module of the base model (full, unsharded)."""
    hidden = int(hf_config["hidden_size"])
    heads = int(hf_config["num_attention_heads"])
    kv_heads = int(hf_config.get("num_key_value_heads") or heads)
    head_dim = int(hf_config.get("head_dim") or hidden // heads)
    inter = int(hf_config["intermediate_size"])
    return {"q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv_heads * head_dim),
            "v_proj": (hidden, kv_heads * head_dim), "o_proj": (heads * head_dim, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}


def read_safetensors_header(path: Path) -> dict:
    """The tensor table of a safetensors file: name -> {"dtype", "shape", "data_offsets"}."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) != 8:
                raise LoRAAdapterError(f"{path} is not a safetensors file (too short)")
            (size,) = struct.unpack("<Q", head)
            if size > 100 << 20:
                raise LoRAAdapterError(f"{path} is not a safetensors file (header of {size} bytes)")
            table = json.loads(f.read(size))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LoRAAdapterError(f"cannot read {path}: {e}") from None
    if not isinstance(table, dict):
        raise LoRAAdapterError(f"{path} is not a safetensors file (bad header)")
    table.pop("__metadata__", None)
    return table


def _read_config(directory: Path) -> dict:
    cfg_path = directory / CONFIG_FILE
    if not cfg_path.is_file():
        raise LoRAAdapterError(f"{directory} holds no {CONFIG_FILE}: not a PEFT adapter directory")
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LoRAAdapterError(f"cannot read {cfg_path}: {e}") from None
    if not isinstance(cfg, dict):
        raise LoRAAdapterError(f"{cfg_path} must hold a JSON object")
    return cfg


def _check_config(cfg: dict, max_rank: int) -> tuple[int, float]:
    """The adapter's rank and scaling; anything this server does not implement is refused."""
    if cfg.get("peft_type", "LORA") != "LORA":
        raise LoRAAdapterError(f"peft_type {cfg.get('peft_type')!r} is not supported: only LORA adapters")
    unsupported = {
        "use_dora": "DoRA (use_dora)", "lora_bias": "LoRA biases (lora_bias)",
        "modules_to_save": "modules_to_save (fully trained extra modules)",
        "rank_pattern": "per-module ranks (rank_pattern)", "alpha_pattern": "per-module alphas (alpha_pattern)",
        "layer_replication": "layer_replication", "fan_in_fan_out": "fan_in_fan_out",
        "trainable_token_indices": "trainable_token_indices",
    }
    for key, what in unsupported.items():
        if cfg.get(key):
            raise LoRAAdapterError(f"{what} is not supported")
    if cfg.get("bias", "none") != "none":
        raise LoRAAdapterError(f"bias={cfg['bias']!r} is not supported: only bias='none'")
    targets = cfg.get("target_modules")
    if isinstance(targets, list):
        _check_module_names(targets)
    rank = cfg.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise LoRAAdapterError(f"adapter rank r={rank!r} must be a positive integer")
    if rank > max_rank:
        raise LoRAAdapterError(f"adapter rank {rank} is over --max-lora-rank {max_rank}")
    alpha = cfg.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise LoRAAdapterError(f"lora_alpha={alpha!r} must be a number")
    scaling = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    return rank, float(scaling)


def _check_module_names(names) -> None:
    for name in names:
        if name in ("lm_head", "embed_tokens"):
            raise LoRAAdapterError(f"LoRA on {name} is not supported: adapt q/k/v/o/gate/up/down_proj only")
        if name not in TARGET_MODULES:
            raise LoRAAdapterError(f"unknown target module {name!r}: supported are {', '.join(TARGET_MODULES)}")


def read_adapter(path: str, hf_config: dict, max_rank: int) -> AdapterSpec:
    """Check a PEFT adapter directory against the base model's config; LoRAAdapterError if unusable."""
    directory = Path(path)
    if not directory.is_dir():
        raise LoRAAdapterError(f"adapter path {path!r} is not a directory")
    rank, scaling = _check_config(_read_config(directory), max_rank)
    weights = directory / WEIGHTS_FILE
    if not weights.is_file():
        if (directory / "adapter_model.bin").is_file():
            raise LoRAAdapterError(f"{directory} has adapter_model.bin (a pickle, which this server never loads): "
                                   f"save the adapter with safetensors (save_pretrained(..., "
                                   f"safe_serialization=True))")
        raise LoRAAdapterError(f"{directory} holds no {WEIGHTS_FILE}")
    table = read_safetensors_header(weights)
    shapes = module_shapes(hf_config)
    num_layers = int(hf_config["num_hidden_layers"])
    found: dict[tuple[int, str], dict[str, str]] = {}
    for name, info in table.items():
        found_key = _parse_key(name, num_layers)
        layer, module, ab = found_key
        if not isinstance(info, dict) or info.get("dtype") not in _FLOAT_DTYPES:
            raise LoRAAdapterError(f"tensor {name}: dtype {info.get('dtype') if isinstance(info, dict) else None!r} "
                                   f"is not supported (F32, F16 or BF16)")
        fan_in, fan_out = shapes[module]
        want = [rank, fan_in] if ab == "A" else [fan_out, rank]
        if list(info.get("shape", ())) != want:
            raise LoRAAdapterError(f"tensor {name} has shape {info.get('shape')}, the base model needs {want} "
                                   f"(rank {rank}, {module} is {fan_in} -> {fan_out}): was the adapter "
                                   f"trained on another model?")
        found.setdefault((layer, module), {})[ab] = name
    if not found:
        raise LoRAAdapterError(f"{weights} holds no LoRA tensors")
    modules = []
    for (layer, module), pair in sorted(found.items()):
        if set(pair) != {"A", "B"}:
            missing = "lora_B" if "A" in pair else "lora_A"
            raise LoRAAdapterError(f"layer {layer} {module} has no {missing} tensor")
        modules.append(LoRAModuleWeights(layer, module, pair["A"], pair["B"]))
    return AdapterSpec(str(directory), str(weights), rank, scaling, tuple(modules))


def _parse_key(name: str, num_layers: int) -> tuple[int, str, str]:
    m = _KEY.match(name)
    if m is None:
        if "lora_magnitude_vector" in name:
            raise LoRAAdapterError(f"tensor {name}: DoRA adapters are not supported")
        for refused in ("lm_head", "embed_tokens"):
            if refused in name:
                raise LoRAAdapterError(f"tensor {name}: LoRA on {refused} is not supported")
        raise LoRAAdapterError(f"unknown tensor {name!r} in the adapter (expected PEFT LoRA A/B weights "
                               f"of a Llama layer's q/k/v/o/gate/up/down_proj)")
    layer, block, module, ab = int(m.group(1)), m.group(2), m.group(3), m.group(4)
    if TARGET_MODULES.get(module) != block:
        raise LoRAAdapterError(f"tensor {name}: unknown target module {block}.{module}")
    if layer >= num_layers:
        raise LoRAAdapterError(f"tensor {name}: layer {layer} does not exist (the model has {num_layers})")
    return layer, module, ab
