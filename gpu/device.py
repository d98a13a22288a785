"""Device and dtype choice: CUDA when present, else CPU; bf16 where the hardware does it fast."""
from __future__ import annotations

import functools
import logging

import torch

from contracts.config import ConfigError

logger = logging.getLogger(__name__)

_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
           "fp16": torch.float16, "half": torch.float16, "float32": torch.float32, "fp32": torch.float32,
           "float": torch.float32}


def resolve_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device {name!r} asked for, but CUDA is not available; use --device cpu")
    return torch.device(name)


@functools.cache
def cpu_has_bf16() -> bool:
    """avx512_bf16 / amx_bf16 make bf16 matmuls fast on x86; elsewhere fp32 is the safe choice."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        if device.type == "cuda" or cpu_has_bf16():
            return torch.bfloat16
        return torch.float32
    try:
        return _DTYPES[name]
    except KeyError:
        raise ConfigError(f"unknown dtype {name!r}: choose auto, bfloat16, float16 or float32") from None
