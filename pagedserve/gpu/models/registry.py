"""From the HF ``architectures`` name to our model class (imported lazily)."""
from __future__ import annotations

import importlib

from pagedserve.contracts.errors import UnsupportedArchitectureError

_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("pagedserve.gpu.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("pagedserve.gpu.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("pagedserve.gpu.models.llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("pagedserve.gpu.models.llama", "LlamaForCausalLM"),
    "GPT2LMHeadModel": ("pagedserve.gpu.models.gpt2", "GPT2LMHeadModel"),
    "Gemma2ForCausalLM": ("pagedserve.gpu.models.gemma", "GemmaForCausalLM"),
    "Gemma3ForCausalLM": ("pagedserve.gpu.models.gemma", "GemmaForCausalLM"),
    "Gemma3ForConditionalGeneration": ("pagedserve.gpu.models.gemma", "GemmaForCausalLM"),  # text only
    "Phi3ForCausalLM": ("pagedserve.gpu.models.phi3", "Phi3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("pagedserve.gpu.models.moe_models", "MoeForCausalLM"),
    "MixtralForCausalLM": ("pagedserve.gpu.models.moe_models", "MoeForCausalLM"),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def resolve_architecture(hf_config: dict) -> tuple[type, str]:
    """(model class, the architecture name it was picked for) or UnsupportedArchitectureError."""
    archs = hf_config.get("architectures") or []
    if isinstance(archs, str):
        archs = [archs]
    for arch in archs:
        if arch in _MODELS:
            module, cls = _MODELS[arch]
            return getattr(importlib.import_module(module), cls), arch
    raise UnsupportedArchitectureError(archs or None, supported_architectures())
