"""Turn user options into a running engine core: resolve the model, read its config, load the
tokenizer, start the executor. Shared by the offline LLM and the AsyncEngine.
"""
from __future__ import annotations

import concurrent.futures
import logging
import os
from dataclasses import dataclass, field

from pagedserve.contracts.config import DEFAULT_MODEL_NAME, ConfigError, EngineConfig, default_model_path

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class EngineParts:
    config: EngineConfig
    hf_config: dict
    tokenizer: object
    executor: object
    core: object
    # Requests' default sampling fields from the model (--generation-config; contracts/generation_defaults.py)
    sampling_defaults: dict = field(default_factory=dict)


def resolve_config(config: EngineConfig) -> tuple[EngineConfig, dict]:
    """Fill in the model path, its HF config, the served name and the context length."""
    from pagedserve.contracts.hf_config import load_hf_config

    m = config.model
    if m.model is None and not (m.load_format == "dummy" and m.hf_config):
        m.model = default_model_path()
        m.served_model_name = m.served_model_name or DEFAULT_MODEL_NAME
    if m.model is not None and not os.path.exists(m.model):
        from pagedserve.contracts.hf_hub import looks_like_model_id, resolve_model_ref

        if not looks_like_model_id(m.model):
            raise ConfigError(f"model path {m.model!r} does not exist: pass a .gguf file, a model directory "
                              f"or a Hugging Face model id (org/name, org/name:Q4_K_M)")
        # a Hugging Face id: served under that name (as vLLM), downloaded unless cached
        m.served_model_name = m.served_model_name or m.model
        m.model = resolve_model_ref(m.model, m.revision, m.download_dir)
    if m.chat_template is not None:
        m.chat_template = read_chat_template(m.chat_template)
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
    from pagedserve.engine.spec_decode import check_supported

    check_supported(config)  # speculative decoding's refusals, before any worker starts
    return config, hf


def _check_device(config: EngineConfig) -> None:
    """--device cuda where torch cannot use CUDA is refused, saying why, before any worker starts.
    Only an explicit cuda imports torch here (auto and cpu keep the main process's cold start)."""
    if not config.parallel.device.startswith("cuda"):
        return
    from pagedserve.gpu.device import resolve_device

    resolve_device(config.parallel.device)


def _check_kv_cache_dtype(config: EngineConfig) -> None:
    """--kv-cache-dtype refused before any worker starts (the worker resolves it again). "auto" is
    the model's dtype and always valid: no torch import then, which would hold the workers' start
    (they import torch themselves) by ~2 s of a cold start."""
    if config.cache.cache_dtype == "auto":
        return
    import torch

    from pagedserve.gpu.device import checkpoint_dtype, resolve_device, resolve_dtype
    from pagedserve.kernels.kv_cache_dtype import KVCacheDtypeError, resolve

    device = resolve_device(config.parallel.device)
    try:
        dtype = resolve_dtype(config.model.dtype, device, checkpoint_dtype(config.model.hf_config))
        resolve(config.cache.cache_dtype, dtype, device)
    except KVCacheDtypeError as e:
        raise ConfigError(str(e)) from None


def _tokenizer_path(config: EngineConfig) -> str:
    path = config.model.model
    if path is None:
        raise ConfigError("a dummy model without a path has no tokenizer; pass --model with a tokenizer")
    return path


def load_tokenizer(config: EngineConfig):
    from pagedserve.engine.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_model(_tokenizer_path(config))
    if config.model.chat_template is not None:  # --chat-template (read by resolve_config)
        tokenizer.chat_template = config.model.chat_template
    return tokenizer


def read_chat_template(value: str) -> str:
    """--chat-template: a file's text, or the template itself (as vLLM); its syntax is checked here,
    so a broken template fails the start, not every request."""
    import jinja2

    if os.path.isfile(value):
        try:
            with open(value, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise ConfigError(f"--chat-template {value!r}: cannot read it: {e}") from None
    elif "{{" in value or "{%" in value:
        text = value
    else:
        raise ConfigError(f"--chat-template {value!r}: no such file, and not a Jinja template")
    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise ConfigError(f"--chat-template: the template does not parse: {e}") from None
    return text


def build_engine(config: EngineConfig, tokenizer=None, cancel=None) -> EngineParts:
    """``cancel`` (a threading.Event): set by a shutdown, it stops a start still loading the model
    (gpu.executor_factory.create_executor), so a restart never holds the shutdown for a whole load."""
    from pagedserve.engine.core import EngineCore
    from pagedserve.gpu.executor_factory import create_executor

    config, hf = resolve_config(config)
    defaults = sampling_defaults(config)
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
    return EngineParts(config, hf, tokenizer, executor, core, defaults)


def sampling_defaults(config: EngineConfig) -> dict:
    """The model's recommended sampling settings, logged once: what a request that leaves those
    fields out is sampled with."""
    from pagedserve.contracts.generation_defaults import generation_defaults

    defaults, source = generation_defaults(config.model.model, config.model.generation_config)
    if defaults:
        logger.info("default sampling settings from the model (%s): %s; a request's own fields override "
                    "them, --generation-config vllm turns them off", source,
                    ", ".join(f"{k}={v}" for k, v in sorted(defaults.items())))
    else:
        logger.info("no default sampling settings from the model (--generation-config %s)",
                    config.model.generation_config)
    return defaults
