"""PEFT LoRA adapter directories, read and checked against the base model without torch.

Why here: the engine checks an adapter when a request (or `load_lora_adapter`) names it, so a bad
adapter is a clear error at load time and never a crash inside a step; the workers load the
same tensors later by the names this check found. Only the safetensors header (a JSON document
after an 8-byte length) is read here, never the weights.

Files are opened as regular files only (never a FIFO or a device: a load cannot hang), the config
read up to ``CONFIG_MAX_BYTES``, and the safetensors header checked against the file: every tensor's
``data_offsets`` inside the data, its byte size that of its shape and dtype, the data covered with
no gap (as safetensors itself demands), so a truncated or doctored file is refused here and never
inside a worker's step. ``follow_symlinks=False`` (runtime loads under --lora-root) refuses files
that are symbolic links.

PEFT's layout (peft.utils.save_and_load): ``adapter_config.json`` (``peft_type`` "LORA", ``r``,
``lora_alpha``, ``use_rslora``, ...) and ``adapter_model.safetensors`` with, per adapted linear,
``base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight`` ([r, in]) and ``...lora_B.weight``
([out, r]); the delta is ``scaling * x A^T B^T`` with scaling ``lora_alpha / r`` or, with rsLoRA,
``lora_alpha / sqrt(r)``.
"""
from __future__ import annotations

import json
import math
import os
import re
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
CONFIG_MAX_BYTES = 256 << 10  # a PEFT config is a few KiB
HEADER_MAX_BYTES = 100 << 20  # safetensors' own limit on a header
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8}
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


def open_regular(path: Path, follow_symlinks: bool = True):
    """``path`` opened for binary reading if it is a regular file (LoRAAdapterError otherwise), with
    its size: opened non-blocking, so a FIFO in its place never waits for a writer; a symbolic link is
    refused unless ``follow_symlinks``."""
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    if not follow_symlinks:
        flags |= os.O_NOFOLLOW
    try:
        fd = os.open(path, flags)
    except OSError as e:
        if not follow_symlinks and os.path.islink(path):
            raise LoRAAdapterError(f"{path} is a symbolic link (not followed under --lora-root)") from None
        raise LoRAAdapterError(f"cannot read {path}: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise LoRAAdapterError(f"{path} is not a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb"), st.st_size
    except BaseException:
        os.close(fd)
        raise


def read_safetensors_header(path: Path, follow_symlinks: bool = True) -> dict:
    """The tensor table of a safetensors file: name -> {"dtype", "shape", "data_offsets"}, each
    entry's offsets and size checked against the file (``check_tensor_data``)."""
    f, file_size = open_regular(path, follow_symlinks)
    try:
        with f:
            head = f.read(8)
            if len(head) != 8:
                raise LoRAAdapterError(f"{path} is not a safetensors file (too short)")
            (size,) = struct.unpack("<Q", head)
            if size > HEADER_MAX_BYTES or size > file_size - 8:
                raise LoRAAdapterError(f"{path} is not a safetensors file (header of {size} bytes in a file "
                                       f"of {file_size})")
            table = json.loads(f.read(size))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LoRAAdapterError(f"cannot read {path}: {e}") from None
    if not isinstance(table, dict):
        raise LoRAAdapterError(f"{path} is not a safetensors file (bad header)")
    table.pop("__metadata__", None)
    check_tensor_data(path, table, file_size - 8 - size)
    return table


def check_tensor_data(path: Path, table: dict, data_size: int) -> None:
    """Each tensor's ``data_offsets`` [begin, end) lies in the ``data_size`` bytes after the header
    and holds exactly its shape x dtype, and the tensors cover the data without gap or overlap: what
    safetensors demands when the weights are loaded, checked before any worker loads them."""
    spans = []
    for name, info in table.items():
        if not isinstance(info, dict):
            raise LoRAAdapterError(f"{path}: tensor {name!r} has no header entry")
        offsets, shape = info.get("data_offsets"), info.get("shape")
        if (not isinstance(offsets, list) or len(offsets) != 2
                or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
                or not 0 <= offsets[0] <= offsets[1]):
            raise LoRAAdapterError(f"{path}: tensor {name!r} has bad data_offsets")
        if (not isinstance(shape, list)
                or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
            raise LoRAAdapterError(f"{path}: tensor {name!r} has a bad shape")
        if offsets[1] > data_size:
            raise LoRAAdapterError(f"{path}: tensor {name!r} lies past the end of the file (truncated?)")
        itemsize = _DTYPE_BYTES.get(info.get("dtype"))
        if itemsize is not None and offsets[1] - offsets[0] != math.prod(shape) * itemsize:
            raise LoRAAdapterError(f"{path}: tensor {name!r} does not hold the bytes for its shape and dtype")
        spans.append(offsets)
    end = 0
    for begin, stop in sorted(spans):
        if begin != end:
            raise LoRAAdapterError(f"{path}: the tensors' data_offsets overlap or leave a gap")
        end = stop
    if end != data_size:
        raise LoRAAdapterError(f"{path}: {data_size - end} bytes after the last tensor (not a safetensors file)")


def _read_config(directory: Path, follow_symlinks: bool = True) -> dict:
    cfg_path = directory / CONFIG_FILE
    if not os.path.lexists(cfg_path):
        raise LoRAAdapterError(f"{directory} holds no {CONFIG_FILE}: not a PEFT adapter directory")
    f, size = open_regular(cfg_path, follow_symlinks)
    try:
        with f:
            if size > CONFIG_MAX_BYTES:
                raise LoRAAdapterError(f"{cfg_path} is larger than {CONFIG_MAX_BYTES} bytes")
            data = f.read(CONFIG_MAX_BYTES + 1)
        if len(data) > CONFIG_MAX_BYTES:
            raise LoRAAdapterError(f"{cfg_path} is larger than {CONFIG_MAX_BYTES} bytes")
        cfg = json.loads(data)
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


def read_adapter(path: str, hf_config: dict, max_rank: int, follow_symlinks: bool = True) -> AdapterSpec:
    """Check a PEFT adapter directory against the base model's config; LoRAAdapterError if unusable.
    ``follow_symlinks=False``: its files must not be symbolic links."""
    directory = Path(path)
    if not directory.is_dir():
        raise LoRAAdapterError(f"adapter path {path!r} is not a directory")
    rank, scaling = _check_config(_read_config(directory, follow_symlinks), max_rank)
    weights = directory / WEIGHTS_FILE
    if not os.path.lexists(weights):
        if (directory / "adapter_model.bin").is_file():
            raise LoRAAdapterError(f"{directory} has adapter_model.bin (a pickle, which this server never loads): "
                                   f"save the adapter with safetensors (save_pretrained(..., "
                                   f"safe_serialization=True))")
        raise LoRAAdapterError(f"{directory} holds no {WEIGHTS_FILE}")
    table = read_safetensors_header(weights, follow_symlinks)
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
