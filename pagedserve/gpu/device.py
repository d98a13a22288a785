"""Device and dtype choice: CUDA when present, else CPU; bf16 where the hardware does it fast."""
from __future__ import annotations

import functools
import logging

import torch

from pagedserve.contracts.config import ConfigError

logger = logging.getLogger(__name__)

_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
           "fp16": torch.float16, "half": torch.float16, "float32": torch.float32, "fp32": torch.float32,
           "float": torch.float32}


def resolve_device(name: str = "auto") -> torch.device:
    """auto: CUDA when torch can use it, else the CPU (with a warning where an NVIDIA driver is
    present, so a torch that cannot use it does not run on the CPU silently). cuda without a
    usable GPU is a ConfigError that says why."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        _warn_gpu_unused()
        return torch.device("cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"--device {name}: CUDA is not available: {cuda_unavailable_reason()}; "
                          "or use --device cpu")
    return torch.device(name)


def nvidia_driver_version() -> str | None:
    """The loaded NVIDIA kernel module's version ("580.65.06"), None without one (Linux)."""
    try:
        with open("/proc/driver/nvidia/version") as f:
            text = f.read()
    except OSError:
        return None
    for word in text.split():
        parts = word.split(".")
        if len(parts) >= 2 and all(p.isdigit() for p in parts):
            return word
    return None


def driver_cuda_version() -> str | None:
    """The newest CUDA the installed driver supports ("12.4"), from libcuda; None without it."""
    import ctypes

    try:
        lib = ctypes.CDLL("libcuda.so.1")
        version = ctypes.c_int()
        if lib.cuDriverGetVersion(ctypes.byref(version)) != 0:
            return None
    except (OSError, AttributeError):
        return None
    return f"{version.value // 1000}.{version.value % 1000 // 10}"


def _version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split(".") if p.isdigit())


def why_no_cuda(torch_version: str, torch_cuda: str | None, driver: str | None, driver_cuda: str | None) -> str:
    """Why torch cannot use a GPU, from what it was built for and what the machine's driver offers."""
    if torch_cuda is None:
        return (f"torch {torch_version} is a CPU build (no CUDA in it): install a CUDA build of torch "
                "(the Makefile pins the CPU build where nvidia-smi is missing)")
    if driver is None and driver_cuda is None:
        return f"torch {torch_version} is built for CUDA {torch_cuda}, but no NVIDIA driver was found"
    if driver_cuda is not None and _version_tuple(driver_cuda)[:1] < _version_tuple(torch_cuda)[:1]:
        return (f"torch {torch_version} is built for CUDA {torch_cuda}, but the NVIDIA driver "
                f"{driver or '(version unknown)'} supports CUDA {driver_cuda} at most: update the driver, "
                f"or install a torch built for CUDA {driver_cuda}")
    return (f"torch {torch_version} (CUDA {torch_cuda}) finds no usable GPU with driver {driver or '?'} "
            f"(CUDA {driver_cuda or '?'}): check CUDA_VISIBLE_DEVICES and nvidia-smi")


def cuda_unavailable_reason() -> str:
    return why_no_cuda(torch.__version__, torch.version.cuda, nvidia_driver_version(), driver_cuda_version())


@functools.cache
def _warn_gpu_unused() -> None:
    if nvidia_driver_version() is not None or driver_cuda_version() is not None:
        logger.warning("an NVIDIA driver is present but the model runs on the CPU: %s", cuda_unavailable_reason())


def describe_device(device: torch.device) -> str:
    """One line for the start-up log: the device, torch and (on CUDA) its CUDA and the driver's."""
    if device.type != "cuda":
        return f"device {device} (torch {torch.__version__})"
    index = device.index if device.index is not None else torch.cuda.current_device()
    return (f"device cuda:{index} ({torch.cuda.get_device_name(index)}; torch {torch.__version__}, "
            f"CUDA {torch.version.cuda}; NVIDIA driver {nvidia_driver_version() or '?'}, "
            f"supports CUDA {driver_cuda_version() or '?'})")


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


def checkpoint_dtype(hf_config: dict | None) -> str | None:
    """The dtype a checkpoint's config.json names (``dtype`` in newer transformers, else
    ``torch_dtype``; a multimodal model's ``text_config``), None when it names none."""
    for cfg in (hf_config or {}, (hf_config or {}).get("text_config") or {}):
        name = cfg.get("dtype") or cfg.get("torch_dtype")
        if isinstance(name, str):
            return name.removeprefix("torch.")
    return None


def auto_dtype(checkpoint: str | None, device_type: str, cpu_bf16: bool, cuda_bf16: bool = True) -> torch.dtype:
    """--dtype auto. On a GPU the checkpoint's own half type, as vLLM does (an fp16 model can
    overflow in bf16's range the other way round, and its numbers match the trainer's): fp16
    stays fp16, bf16 stays bf16 (fp16 on a GPU without bf16), and an fp32 or unlabelled
    checkpoint is served in the GPU's preferred half type. On the CPU the checkpoint does not
    matter: bf16 where the CPU has native bf16, else fp32 (fp16 matmuls are slow there)."""
    if device_type != "cuda":
        return torch.bfloat16 if cpu_bf16 else torch.float32
    preferred = torch.bfloat16 if cuda_bf16 else torch.float16
    want = _DTYPES.get(checkpoint or "float32", torch.float32)
    if want == torch.float32 or (want == torch.bfloat16 and not cuda_bf16):
        return preferred
    return want


def _cuda_has_bf16() -> bool:
    """Asked only where this process already has a CUDA context (the worker): the engine process
    checks flags without creating one, and assumes an Ampere or newer GPU."""
    return not torch.cuda.is_initialized() or torch.cuda.is_bf16_supported()


def resolve_dtype(name: str, device: torch.device, checkpoint: str | None = None) -> torch.dtype:
    """--dtype as a torch dtype; ``checkpoint`` (``checkpoint_dtype`` of its config) guides auto."""
    if name == "auto":
        cpu_bf16 = device.type != "cuda" and cpu_has_bf16()
        return auto_dtype(checkpoint, device.type, cpu_bf16, device.type != "cuda" or _cuda_has_bf16())
    try:
        return _DTYPES[name]
    except KeyError:
        raise ConfigError(f"unknown dtype {name!r}: choose auto, bfloat16, float16 or float32") from None
