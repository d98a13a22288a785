"""A model's recommended sampling settings: the defaults requests get for the fields they leave out
(vLLM's ``--generation-config``). Qwen3, for one, asks for temperature 0.6, top_p 0.95, top_k 20;
served without them it loops.

Read from the model's ``generation_config.json`` (a Hugging Face directory) or from a GGUF file's
``general.sampling.*`` keys (llama.cpp's names: gguf.constants.Keys.General.SAMPLING_*), with
``--generation-config auto`` (the default); ``vllm`` takes none; a path names a directory with a
generation_config.json (or the file). No torch import: read before any worker starts.
"""
from __future__ import annotations

import json
import math
import os

from pagedserve.contracts.config import ConfigError

# generation_config.json keys -> the SamplingParams fields they set (vLLM's set).
HF_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
           "repetition_penalty": "repetition_penalty"}
# GGUF metadata keys (llama.cpp's general.sampling.*) -> SamplingParams fields.
GGUF_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
             "general.sampling.top_k": "top_k", "general.sampling.min_p": "min_p",
             "general.sampling.penalty_repeat": "repetition_penalty"}
_RANGES = {"temperature": (0.0, 2.0), "top_p": (0.0, 1.0), "min_p": (0.0, 1.0),
           "repetition_penalty": (0.01, 100.0)}


def generation_defaults(model: str | None, generation_config: str) -> tuple[dict[str, float | int], str | None]:
    """(default sampling fields, where they were read) for ``--generation-config``."""
    if generation_config == "vllm" or (generation_config == "auto" and model is None):
        return {}, None
    if generation_config == "auto":
        if os.path.isdir(model):
            path = os.path.join(model, "generation_config.json")
            return (_from_json(path), path) if os.path.isfile(path) else ({}, None)
        return _from_gguf(model), model
    path = generation_config
    if os.path.isdir(path):
        path = os.path.join(path, "generation_config.json")
    if not os.path.isfile(path):
        raise ConfigError(f"--generation-config {generation_config!r}: no generation_config.json there "
                          "(give auto, vllm, or a directory holding generation_config.json)")
    return _from_json(path), path


def _from_json(path: str) -> dict[str, float | int]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}: cannot read the generation config: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the generation config must be a JSON object")
    return _checked({field: data[key] for key, field in HF_KEYS.items() if data.get(key) is not None}, path)


def _from_gguf(path: str) -> dict[str, float | int]:
    from pagedserve.contracts.hf_config import is_gguf, read_gguf_metadata

    if not is_gguf(path):
        return {}
    meta, _ = read_gguf_metadata(path)
    return _checked({field: meta[key] for key, field in GGUF_KEYS.items() if meta.get(key) is not None}, path)


def _checked(values: dict, source: str) -> dict[str, float | int]:
    """The values as the sampler takes them; one it cannot take fails the start, naming it."""
    out: dict[str, float | int] = {}
    for field, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ConfigError(f"{source}: {field} must be a number, got {value!r}")
        if field == "top_k":
            if value != int(value):
                raise ConfigError(f"{source}: top_k must be an integer, got {value!r}")
            out[field] = max(int(value), 0)  # -1 / 0 = off
            continue
        low, high = _RANGES[field]
        if not low <= value <= high:
            raise ConfigError(f"{source}: {field} {value} is outside [{low}, {high}]")
        if field == "top_p" and value == 0:
            raise ConfigError(f"{source}: top_p must be > 0")
        out[field] = float(value)
    return out
