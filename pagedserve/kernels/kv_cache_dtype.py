"""The KV cache's element type (``--kv-cache-dtype``, as vLLM names it): "auto", bf16 ("bfloat16")
or fp8 e4m3 ("fp8", "fp8_e4m3") on CPU. "auto" is the model's dtype, except an fp32 model with
quantized weights on CPU (what AVX2 machines run the shipped GGUF as) keeps bf16 K/V (``auto``):
its weights are far coarser than bf16, and llama.cpp keeps f16 K/V for the same files.

Why bf16 under fp32 activations (AVX2 machines run the model in fp32): a decode step reads every
cached K/V row, from DRAM once the step's weights have passed through the caches, and at fp32 that
read was ~1.3 ms of a 5.5 ms single-stream step of the default model at 256 tokens of context
(AVX2 EPYC; loadtest/PERF.md). bf16 halves those bytes at llama.cpp's default KV precision (f16);
rows are rounded to nearest even on write (C and torch alike) and widened exactly on read.

Why fp8: a decode step reads every cached K/V row of every request, and with many streams that
is most of the step (16 rows of ~300 tokens: ~half of a decode step in the AMX attention kernel,
reading at memory speed; loadtest/PERF.md). One byte an element halves those reads and doubles
the tokens a KV budget holds. The bytes are e4m3fn without a scale (vLLM's default scale is 1.0
too): K and V of these models lie well inside +-448, the subnormal step is 2^-9, and every writer
(C: csrc/fp8.h, torch: ``.to(torch.float8_e4m3fn)``) rounds to nearest even and saturates the
same way. The kernels widen the bytes exactly (fp8 -> bf16 / fp32) and compute as before.
Accuracy is measured in loadtest/PERF.md (greedy agreement, perplexity) and pinned by a test.
"""
from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
# name -> element type; None = the model's dtype
CHOICES: dict[str, torch.dtype | None] = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16,
                                          "fp8": FP8, "fp8_e4m3": FP8}
UNSUPPORTED = {"fp8_e5m2": "use fp8 (e4m3)", "fp8_inc": "use fp8 (e4m3)", "fp8_ds_mla": "use fp8 (e4m3)"}


class KVCacheDtypeError(ValueError):
    """A --kv-cache-dtype this build cannot serve; the message says what it can."""


def resolve(name: str, model_dtype: torch.dtype, device: torch.device | str) -> torch.dtype:
    """The cache element type for ``--kv-cache-dtype name`` with this model dtype on this device."""
    if name in UNSUPPORTED:
        raise KVCacheDtypeError(f"--kv-cache-dtype {name} is not supported: {UNSUPPORTED[name]}")
    if name not in CHOICES:
        raise KVCacheDtypeError(f"--kv-cache-dtype {name!r} is not one of {', '.join(CHOICES)}")
    dtype = CHOICES[name]
    if dtype is None or dtype == model_dtype:
        return model_dtype
    if not readable(dtype, model_dtype):
        needs = "float32" if dtype == torch.bfloat16 else name
        raise KVCacheDtypeError(f"--kv-cache-dtype {name} needs a {needs} model "
                                f"(this one runs in {str(model_dtype).removeprefix('torch.')})")
    if torch.device(device).type != "cpu":
        raise KVCacheDtypeError(f"--kv-cache-dtype {name} is implemented for the CPU backend only "
                                f"(this model runs on {torch.device(device).type}); use auto")
    return dtype


def auto(model_dtype: torch.dtype, device: torch.device | str, weights_quantized: bool) -> torch.dtype:
    """What "auto" resolves to once the model is loaded (``weights_quantized``: any linear layer
    holds packed quantized weights)."""
    if weights_quantized and model_dtype == torch.float32 and torch.device(device).type == "cpu":
        return torch.bfloat16
    return model_dtype


def readable(cache_dtype: torch.dtype, act_dtype: torch.dtype) -> bool:
    """Whether attention over activations of ``act_dtype`` can keep its K/V in ``cache_dtype``: the
    same dtype, fp8 (read in the activations' dtype), or bf16 under fp32."""
    return cache_dtype in (act_dtype, FP8) or (cache_dtype == torch.bfloat16 and act_dtype == torch.float32)


def write_kind(cache_dtype: torch.dtype, act_dtype: torch.dtype) -> int:
    """The C writers' cache_kind (csrc/exports.h FZ_KV_*): 0 rows as they are, 1 fp8, 2 bf16 from fp32."""
    if cache_dtype == act_dtype:
        return 0
    return 1 if cache_dtype == FP8 else 2


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A uint8 view of an fp8 tensor (torch has no index_copy_ for fp8 on CPU), else ``t``:
    block copies move the bytes as they are."""
    return t.view(torch.uint8) if t.dtype == FP8 else t


def index_copy_rows(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.index_copy_(0, index, src)`` for every cache dtype, fp8 included."""
    as_bytes(dst).index_copy_(0, index, as_bytes(src))
