"""GGUF tensors as (Hugging Face name, float32 tensor) pairs, one at a time.

Quantized tensors are dequantized to float32 (gpu.models.gguf_quants: fast paths for Q4_0 /
Q4_1 / Q8_0, the ``gguf`` package for the rest). llama.cpp's converter permutes the
rows of attn_q / attn_k (and their biases) for its rotary layout on Llama-architecture files;
that is undone here so the weights match the Hugging Face (neox) layout our rotary uses.
"""
from __future__ import annotations

import re
from collections.abc import Iterator

import numpy as np
import torch

from pagedserve.contracts.errors import ModelLoadError

_TOP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # mixture of experts: the router, and each projection of all experts as one 3D tensor
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
# Where an architecture's converter names a block tensor otherwise (Gemma's four norms; Phi-3's
# fused qkv and gate/up, the latter written as ffn_up).
_ARCH_BLOCK = {
    "gemma2": {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"},
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
}
_ARCH_BLOCK["gemma3"] = _ARCH_BLOCK["gemma2"]
_SKIPPED = {"rope_factors_long.weight", "rope_factors_short.weight"}  # read into the config (LongRoPE)
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
# Architectures whose converter permuted q/k rows.
_PERMUTED_ARCHS = {"llama", "mistral"}
# Architectures whose converter stored norm scales as 1 + w (Gemma's RMSNorm reads w).
_SHIFTED_NORM_ARCHS = {"gemma2", "gemma3"}


def gguf_to_hf_name(name: str, arch: str = "llama") -> str | None:
    """The Hugging Face name of GGUF tensor ``name`` in an ``arch`` file; None for a tensor the
    model holds no parameter for (LongRoPE factors) or does not know."""
    if name in _TOP:
        return _TOP[name]
    m = _BLOCK_RE.match(name)
    if m:
        part = _ARCH_BLOCK.get(arch, {}).get(m.group(2)) or _BLOCK.get(m.group(2))
        if part is not None:
            return f"model.layers.{m.group(1)}.{part}.{m.group(3)}"
    return None


def file_arch(reader) -> str:
    field = reader.fields.get("general.architecture")
    return field.contents() if field is not None else "llama"


def unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (per head: interleaved pairs -> two halves)."""
    rows = w.shape[0]
    rest = w.shape[1:]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *rest).swapaxes(1, 2).reshape(rows, *rest)


def iter_gguf_weights(path: str, hf_config: dict, reader=None, only: set[str] | None = None,
                      progress=None) -> Iterator[tuple[str, torch.Tensor]]:
    """Pass ``reader`` (contracts.gguf_file.read_gguf of ``path``) to skip parsing the file again;
    ``only``: the GGUF names to read (the others are loaded packed, gpu.models.gguf_packed);
    ``progress``: a gpu.models.load_progress.LoadProgress, told each tensor's file bytes."""
    from pagedserve.gpu.models.gguf_quants import dequantize

    if reader is None:
        from pagedserve.contracts.hf_config import open_gguf

        reader = open_gguf(path)
    arch = file_arch(reader)
    heads = {"q_proj": hf_config["num_attention_heads"], "k_proj": hf_config["num_key_value_heads"]}
    for t in reader.tensors:
        if (only is not None and t.name not in only) or t.name in _SKIPPED:
            continue
        hf_name = gguf_to_hf_name(t.name, arch)
        if hf_name is None:
            raise ModelLoadError(f"{path}: tensor {t.name!r} has no counterpart in the model")
        try:
            w = dequantize(t.data, t.tensor_type)
        except NotImplementedError as e:
            raise ModelLoadError(f"{path}: tensor {t.name!r}: cannot dequantize {t.tensor_type.name}: {e}") from None
        # GGUF lists dims fastest-first; the array comes out as (rows, cols).
        w = np.asarray(w, dtype=np.float32).reshape(tuple(int(d) for d in reversed(t.shape.tolist())))
        proj = hf_name.rsplit(".", 2)[-2]
        if arch in _PERMUTED_ARCHS and proj in heads:
            w = unpermute_rows(w, heads[proj])
        if arch in _SHIFTED_NORM_ARCHS and hf_name.endswith("norm.weight"):
            w = w - 1.0
        if not w.flags.writeable:  # F32 tensors come straight from the read-only memory map
            w = w.copy()
        yield hf_name, torch.from_numpy(np.ascontiguousarray(w))
        if progress is not None:
            progress.update(t.n_bytes)
