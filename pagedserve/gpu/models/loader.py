"""Build a model and fill its weights: GGUF, safetensors (single or sharded) or dummy.

The model is built with uninitialised parameters directly in the target dtype and device; each
checkpoint tensor is then read, cut to this rank's shard and copied in, one at a time, so at
most one checkpoint tensor exists beside the model at any moment.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import time

import torch

from pagedserve.contracts.errors import ModelLoadError, UnsupportedArchitectureError
from pagedserve.contracts.hf_config import is_gguf, load_hf_config, normalize_config
from pagedserve.gpu.models.load_progress import LoadProgress
from pagedserve.gpu.models.registry import resolve_architecture, supported_architectures
from pagedserve.gpu.models.weights import WeightTracker

__all__ = ["load_model", "build_model", "ModelLoadError", "UnsupportedArchitectureError",
           "supported_architectures", "resolve_load_format"]

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}


def _as_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str) and dtype in _DTYPES:
        return _DTYPES[dtype]
    raise ModelLoadError(f"unknown dtype {dtype!r}; use one of {', '.join(sorted(_DTYPES))}")


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(prev)


def build_model(hf_config: dict, device, dtype) -> torch.nn.Module:
    """The model class for ``hf_config['architectures']`` with uninitialised weights."""
    cls, arch = resolve_architecture(hf_config)
    with torch.device(device), _default_dtype(_as_dtype(dtype)):
        model = cls(normalize_config(hf_config), arch)
    return model.eval()


def resolve_load_format(path: str | None, load_format: str) -> str:
    if load_format not in ("auto", "gguf", "safetensors", "dummy"):
        raise ModelLoadError(f"unknown load format {load_format!r}; use auto, gguf, safetensors or dummy")
    if load_format != "auto":
        return load_format
    if path is not None and os.path.isfile(path) and is_gguf(path):
        return "gguf"
    if path is not None and os.path.isdir(path):
        return "safetensors"
    raise ModelLoadError(f"{path}: no such model file or directory (pass a .gguf file or a Hugging Face "
                         "model directory)")


def load_model(model_config, device="cpu", dtype=torch.float32) -> torch.nn.Module:
    """Build the model of ``model_config`` (contracts.config.ModelConfig) on ``device`` in ``dtype`` and
    load its weights. Raises ModelLoadError naming the file and tensor on any problem."""
    t0 = time.perf_counter()
    path = model_config.model
    fmt = model_config.load_format
    if path is None and not (fmt == "dummy" and model_config.hf_config):
        from pagedserve.contracts.config import default_model_path

        path = default_model_path()
    reader = None
    if fmt == "dummy":
        hf_config = model_config.hf_config or load_hf_config(path)
    else:
        fmt = resolve_load_format(path, fmt)
        if fmt == "gguf":
            from pagedserve.contracts.hf_config import gguf_to_hf_config, open_gguf

            if not os.path.isfile(path):
                raise ModelLoadError(f"{path}: no such GGUF file")
            reader = open_gguf(path)  # parsed once for both the config and the tensors
            hf_config = gguf_to_hf_config(path, reader)
        else:
            hf_config = load_hf_config(path)
    quantization = resolve_quantization(model_config.quantization, device)
    from pagedserve.gpu.models import fp8

    fp8_file = fmt == "safetensors" and fp8.checkpoint_is_fp8(hf_config)
    if fp8_file and (model_config.quantization or "auto") == "auto":
        quantization = _fp8_or_none(device)  # the checkpoint's own format where the device computes it
    model = build_model(hf_config, device, dtype)
    packed = {}
    if fmt == "dummy":
        _fill_dummy(model, model_config.seed)
    else:
        if fp8_file:
            fp8.add_checkpoint_scales(model)
        tracker = WeightTracker(model)
        tracker.ignored = (".input_scale",) if fp8_file else ()  # activations are scaled per token
        with torch.no_grad():
            if fmt == "gguf":  # fp8 quantizes the dequantized tensors below
                packed = _load_gguf(model, reader, path, tracker, "none" if quantization == "fp8" else quantization)
                tracker.check_complete(path)
            else:
                _load_safetensors(tracker, path)
        if fp8_file and quantization != "fp8":
            fp8.dequantize_checkpoint(model)  # the scales folded into the weights
    from pagedserve.gpu.models.moe import quantize_experts
    from pagedserve.gpu.models.quantization import quantize_model

    quantize_model(model, quantization, device)  # full-precision layers under int8/int4/fp8 (none, auto: no-op)
    quantize_experts(model, quantization)  # and a mixture of experts' expert stacks
    from pagedserve.gpu.models.packed_linear import pack_model

    pack_model(model)  # the unquantized CPU linear weights, into the GEMM library's layout
    from pagedserve.gpu.models.fast_decode import bind_fast_decode

    bind_fast_decode(model)  # small bf16-activation decode batches: each layer in two C calls
    logger.info("loaded %s (%s, %s weights, quantization %s%s) in %.1f s", path or "dummy model", fmt, dtype,
                quantization, f", packed from the file: {packed}" if packed else "", time.perf_counter() - t0)
    return model


def resolve_quantization(mode: str | None, device) -> str:
    """``auto`` keeps a GGUF file's quantization on CPU (vLLM's behaviour; nothing to keep in a
    full-precision checkpoint) and is ``none`` on other devices; int8 / int4 need a CPU, fp8 a GPU
    of compute capability >= 8.9 (an FP8 checkpoint under ``auto``: fp8 there, see load_model)."""
    from pagedserve.gpu.models.quantization import check_mode

    mode = mode or "auto"
    if mode == "auto" and torch.device(device).type != "cpu":
        return "none"
    check_mode(mode, device)
    return mode


def _fp8_or_none(device) -> str:
    from pagedserve.contracts.config import ConfigError
    from pagedserve.gpu.models.quantization import check_mode

    try:
        check_mode("fp8", device)
    except ConfigError as e:
        logger.info("an FP8 checkpoint: its weights dequantized to the model's dtype (%s)", e)
        return resolve_quantization("auto", device)
    return "fp8"


def _load_gguf(model, reader, path: str, tracker: WeightTracker, quantization: str) -> dict[str, int]:
    """Quantized tensors into packed weights where ``quantization`` keeps or asks for them (one
    tensor at a time, no full-precision copy), everything else dequantized into the parameters."""
    with LoadProgress(sum(int(t.n_bytes) for t in reader.tensors)) as progress:
        return _load_gguf_tensors(model, reader, path, tracker, quantization, progress)


def _load_gguf_tensors(model, reader, path: str, tracker: WeightTracker, quantization: str,
                       progress: LoadProgress) -> dict[str, int]:
    from pagedserve.gpu.models.gguf_loader import iter_gguf_weights

    if quantization != "none":
        from pagedserve.gpu.models import gguf_packed

        from pagedserve.gpu.models import gguf_experts

        plan = gguf_packed.plan_layouts(model, reader, quantization)
        if plan or gguf_experts.has_expert_tensors(reader):
            from pagedserve.kernels import qgemm

            qgemm.library()  # a missing compiler fails here, naming what to install
            counts = gguf_packed.load(model, reader, path, model.config, tracker, plan, take=lambda t: (
                gguf_experts.load_expert_tensor(t, model, quantization, tracker, path)), progress=progress)
            gguf_experts.finish(model)
            return counts
    tracker.load_all(iter_gguf_weights(path, model.config, reader, progress=progress), source=path)
    return {}


def _safetensors_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, KeyError, json.JSONDecodeError) as e:
            raise ModelLoadError(f"{index}: cannot read the shard index: {e}") from None
        files = sorted(set(weight_map.values()))
        for name in files:
            if not os.path.isfile(os.path.join(path, name)):
                raise ModelLoadError(f"{index}: shard {name!r} is missing from {path}")
        return [os.path.join(path, f) for f in files]
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors weights in the model directory")
    return [os.path.join(path, f) for f in files]


def _load_safetensors(tracker: WeightTracker, path: str) -> None:
    from safetensors import safe_open

    files = _safetensors_files(path)
    with LoadProgress(sum(os.path.getsize(f) for f in files)) as progress:
        for file in files:
            try:
                handle = safe_open(file, framework="pt", device="cpu")
            except Exception as e:
                raise ModelLoadError(f"{file}: cannot open safetensors file: {e}") from None
            with handle as f:
                for name in f.keys():
                    tensor = f.get_tensor(name)
                    tracker.load(name, tensor, source=file)
                    progress.update(tensor.nbytes)
    tracker.check_complete(files[0] if len(files) == 1 else path)


def _fill_dummy(model: torch.nn.Module, seed: int) -> None:
    """Random weights, reproducible for a seed on any device: normal(0, 0.02) for matrices, ones
    for norm scales, zeros for norm biases — keeps activations and logits in a sane range."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            is_norm = "norm" in name or ".ln_" in name or name.startswith("transformer.ln_")
            if is_norm and name.endswith("weight"):
                param.fill_(1.0)
            elif is_norm:
                param.zero_()
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.02)
