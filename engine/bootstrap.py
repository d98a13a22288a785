"""Turn user options into a running engine core: resolve the model, read its config, load the
tokenizer, start the executor. Shared by the offline LLM and the AsyncEngine.
"""
from __future__ import annotations

import concurrent.futures
import logging
import os
from dataclasses import dataclass

from contracts.config import DEFAULT_MODEL_NAME, ConfigError, EngineConfig, default_model_path

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class EngineParts:
    config: EngineConfig
    hf_config: dict
    tokenizer: object
    executor: object
    core: object


def resolve_config(config: EngineConfig) -> tuple[EngineConfig, dict]:
    """Fill in the model path, its HF config, the served name and the context length."""
    from contracts.hf_config import load_hf_config

    m = config.model
    if m.model is None and not (m.load_format == "dummy" and m.hf_config):
        m.model = default_model_path()
        m.served_model_name = m.served_model_name or DEFAULT_MODEL_NAME
    if m.model is not None and not os.path.exists(m.model):
        raise ConfigError(f"model path {m.model!r} does not exist: pass a .gguf file or a model directory")
    hf = dict(m.hf_config) if m.hf_config else load_hf_config(m.model)
    if m.hf_config is None:
        m.hf_config = hf
    model_max = int(hf.get("max_position_embeddings") or hf.get("n_positions") or 2048)
    if m.max_model_len is None:
        m.max_model_len = model_max
    elif m.max_model_len > model_max:
        raise ConfigError(f"--max-model-len {m.max_model_len} is over the model's context of {model_max} tokens")
    if m.served_model_name is None:
        m.served_model_name = os.path.basename(os.path.normpath(m.model)) if m.model else "dummy"
    config.parallel.executor = config.parallel.resolved_executor()
    bs = config.cache.block_size
    if bs < 8 or bs & (bs - 1):
        raise ConfigError(f"--block-size {bs} must be a power of two >= 8")
    _check_device(config)
    _check_kv_cache_dtype(config)
    from engine.spec_decode import check_supported

    check_supported(config)  # speculative decoding's refusals, before any worker starts
    return config, hf


def _check_device(config: EngineConfig) -> None:
    """--device cuda where torch cannot use CUDA is refused, saying why, before any worker starts.
    Only an explicit cuda imports torch here (auto and cpu keep the main process's cold start)."""
    if not config.parallel.device.startswith("cuda"):
        return
    from gpu.device import resolve_device

    resolve_device(config.parallel.device)


def _check_kv_cache_dtype(config: EngineConfig) -> None:
    """--kv-cache-dtype refused before any worker starts (the worker resolves it again). "auto" is
    the model's dtype and always valid: no torch import then, which would hold the workers' start
    (they import torch themselves) by ~2 s of a cold start."""
    if config.cache.cache_dtype == "auto":
        return
    import torch

    from gpu.device import resolve_device
    from kernels.kv_cache_dtype import KVCacheDtypeError, resolve

    try:
        resolve(config.cache.cache_dtype, torch.bfloat16, resolve_device(config.parallel.device))
    except KVCacheDtypeError as e:
        raise ConfigError(str(e)) from None


def _tokenizer_path(config: EngineConfig) -> str:
    path = config.model.model
    if path is None:
        raise ConfigError("a dummy model without a path has no tokenizer; pass --model with a tokenizer")
    return path


def load_tokenizer(config: EngineConfig):
    from engine.tokenizer import Tokenizer

    return Tokenizer.from_model(_tokenizer_path(config))


def build_engine(config: EngineConfig, tokenizer=None, cancel=None) -> EngineParts:
    """``cancel`` (a threading.Event): set by a shutdown, it stops a start still loading the model
    (gpu.executor_factory.create_executor), so a restart never holds the shutdown for a whole load."""
    from engine.core import EngineCore
    from gpu.executor_factory import create_executor

    config, hf = resolve_config(config)
    pending = None
    if tokenizer is None:
        _tokenizer_path(config)  # a missing path fails before any worker starts
        # Built on a thread while the workers start (a spawned worker spends seconds importing
        # torch and loading weights, waiting for it holds no GIL): cold start pays for the
        # slower of the two, not their sum.
        pending = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pagedserve-tokenizer")
        future = pending.submit(load_tokenizer, config)
    try:
        executor = create_executor(config, cancel=cancel)
    finally:
        if pending is not None:
            pending.shutdown(wait=True)
    try:
        if pending is not None:
            tokenizer = future.result()
        core = EngineCore(config, executor, tokenizer)
    except BaseException:
        executor.shutdown()
        raise
    logger.info("engine ready: model %s, %d KV blocks x %d tokens, max_model_len %d",
                config.model.served_model_name, executor.num_blocks, config.cache.block_size,
                config.model.max_model_len)
    return EngineParts(config, hf, tokenizer, executor, core)
