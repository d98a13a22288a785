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


def cuda_device_index(rank: int, local_world_size: int, dp_rank: int, device_count: int) -> int:
    """The GPU a worker uses: data-parallel replica ``dp_rank`` takes the ``local_world_size``
    GPUs after those of the replicas before it (vLLM's layout), and its rank ``rank`` the one at
    its place among them. A ConfigError when the GPUs this process sees are too few."""
    if local_world_size < 1 or not 0 <= rank < local_world_size or dp_rank < 0:
        raise ValueError(f"rank {rank} of a local world of {local_world_size}, replica {dp_rank}")
    index = dp_rank * local_world_size + rank
    if index >= device_count:
        raise ConfigError(f"data-parallel replica {dp_rank} rank {rank} needs GPU {index}, but "
                          f"{device_count} GPU(s) are visible: each replica takes {local_world_size} "
                          "(tensor x pipeline parallel size); lower --data-parallel-size or the parallel sizes")
    return index


def select_cuda_device(rank: int, local_world_size: int, dp_rank: int) -> int:
    """Make this process's current CUDA device the one ``cuda_device_index`` names; returns it."""
    index = cuda_device_index(rank, local_world_size, dp_rank, torch.cuda.device_count())
    torch.cuda.set_device(index)
    return index


def kv_cache_budget(free: int, total: int, utilization: float, weights: int, peak_activation: int) -> int:
    """Bytes of GPU memory for the KV cache (all arguments in bytes but ``utilization``).

    This process may use ``utilization`` of the device's ``total`` memory (vLLM's
    --gpu-memory-utilization), and no more than was ``free`` before it loaded anything: another
    process on the GPU keeps what it holds, so asking for more is refused, as vLLM does. The
    model's ``weights`` and the ``peak_activation`` of a profile forward come out of that share."""
    if not 0 < utilization <= 1:
        raise ConfigError(f"--gpu-memory-utilization must be in (0, 1], got {utilization}")
    allowed = int(total * utilization)
    if allowed > free:
        raise ConfigError(f"--gpu-memory-utilization {utilization:g} asks for {allowed / 2**30:.2f} GiB of the "
                          f"GPU's {total / 2**30:.2f} GiB, but only {free / 2**30:.2f} GiB were free at start "
                          f"(another process holds the rest): lower it to {int(100 * free / total) / 100:.2f} "
                          "or less, or free the GPU")
    budget = allowed - weights - peak_activation
    if budget <= 0:
        raise ConfigError(f"the weights ({weights / 2**30:.2f} GiB) and a profile step's activations "
                          f"({peak_activation / 2**30:.2f} GiB) fill the {allowed / 2**30:.2f} GiB that "
                          f"--gpu-memory-utilization {utilization:g} allows, leaving none for the KV cache: "
                          "raise --gpu-memory-utilization or lower --max-num-batched-tokens")
    return budget


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
