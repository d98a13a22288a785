"""Rotary position embedding, neox layout (the halves of each head rotate together) as HF Llama uses.

cos/sin are precomputed in float32 for every position up to max_position and gathered by the
flat ``positions`` tensor, so one call covers a whole mixed batch.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from pagedserve.contracts.errors import ModelLoadError
from pagedserve.kernels import fused
from pagedserve.kernels.attention import use_triton

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope", "yarn")
_FUSED_DTYPES = (torch.float32, torch.bfloat16)


def rope_params_from_config(cfg: dict) -> tuple[float, dict | None]:
    """(theta, scaling dict or None) from either the old rope_theta/rope_scaling keys or the
    transformers-5 ``rope_parameters`` dict."""
    params = cfg.get("rope_parameters") or {}
    theta = float(cfg.get("rope_theta") or params.get("rope_theta") or 10000.0)
    scaling = cfg.get("rope_scaling") or None
    if scaling is None and params:
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    if scaling is not None:
        rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
        if rope_type == "default":
            return theta, None
        scaling = dict(scaling, rope_type=rope_type)
        if rope_type in ("longrope", "yarn") and scaling.get("original_max_position_embeddings") is None:
            # transformers' fallbacks: the top-level key (Phi-3), else the model's own length (YaRN)
            scaling["original_max_position_embeddings"] = (cfg.get("original_max_position_embeddings")
                                                           or (cfg.get("max_position_embeddings")
                                                               if rope_type == "yarn" else None))
    return theta, scaling


def yarn_inv_freq(rotary_dim: int, theta: float, scaling: dict) -> tuple[torch.Tensor, float]:
    """YaRN (Qwen2.5 / Qwen3 long context, DeepSeek): (inverse frequencies, the factor cos and sin
    are multiplied by). Dimensions that turn more than ``beta_fast`` times over the original length
    keep their frequency, those under ``beta_slow`` turns are divided by ``factor``, a linear ramp
    between; transformers' formula (modeling_rope_utils._compute_yarn_parameters)."""
    factor = float(scaling["factor"])
    original = float(scaling["original_max_position_embeddings"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = scaling.get("attention_factor")
    if attention is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast, beta_slow = float(scaling.get("beta_fast") or 32), float(scaling.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return rotary_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim)
    keep = 1 - ramp  # the share of the original frequency
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep
    return inv_freq, float(attention)


def compute_inv_freq(rotary_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
    if scaling is None:
        return inv_freq
    rope_type = scaling["rope_type"]
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are slowed by `factor`, short ones kept, the band between blended.
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, blended, scaled)
    raise ModelLoadError(
        f"unsupported rope scaling type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
    )


def longrope_table(rotary_dim: int, max_position: int, theta: float, scaling: dict) -> torch.Tensor:
    """The cos/sin table of LongRoPE (Phi-3, Phi-4-mini): positions below
    ``original_max_position_embeddings`` rotate with the short factors, later ones with the long
    factors, and both are scaled by the attention factor. transformers switches the whole
    sequence to the long factors once it passes the original length; a paged cache keeps the
    keys it already rotated, so (as vLLM) each position keeps the factors of its own range."""
    original = scaling.get("original_max_position_embeddings")
    if not original:
        raise ModelLoadError("longrope scaling needs original_max_position_embeddings")
    original = int(original)
    factor = float(scaling.get("factor") or max_position / original)
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    exponent = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    parts = []
    for key, lo, hi in (("short_factor", 0, min(original, max_position)), ("long_factor", original, max_position)):
        if hi <= lo:
            continue
        ext = torch.tensor(scaling[key], dtype=torch.float32)
        if ext.numel() != rotary_dim // 2:
            raise ModelLoadError(f"longrope {key} has {ext.numel()} entries, the rotary dimension needs "
                                 f"{rotary_dim // 2}")
        inv_freq = 1.0 / (ext * theta ** exponent)
        freqs = torch.outer(torch.arange(lo, hi, dtype=torch.float32), inv_freq)
        parts.append(torch.cat([freqs.cos(), freqs.sin()], dim=-1) * float(attention))
    return torch.cat(parts)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, rotary_dim: int, max_position: int, theta: float,
                 scaling: dict | None = None):
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim
        if scaling is not None and scaling["rope_type"] == "longrope":
            table = longrope_table(rotary_dim, max_position, theta, scaling)
        elif scaling is not None and scaling["rope_type"] == "yarn":
            inv_freq, attention = yarn_inv_freq(rotary_dim, theta, scaling)
            freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
            table = torch.cat([freqs.cos(), freqs.sin()], dim=-1) * attention
        else:
            inv_freq = compute_inv_freq(rotary_dim, theta, scaling)
            t = torch.arange(max_position, dtype=torch.float32)
            freqs = torch.outer(t, inv_freq)  # [P, rotary_dim / 2]
            table = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
        # [P, rotary_dim]: cos half then sin half.
        self.register_buffer("cos_sin_cache", table, persistent=False)

    def prepare(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple:
        """What every layer's ``apply_`` needs for this step, computed once per forward: the
        positions for the fused CPU op or the Triton kernel (each reads the fp32 table itself),
        else cos and sin."""
        if (positions.device.type == "cpu" and self.cos_sin_cache.device.type == "cpu"
                and dtype in _FUSED_DTYPES and fused.available()
                and (positions.numel() == 0 or int(positions.max()) < self.cos_sin_cache.shape[0])):
            return (None, None, positions.to(torch.int64).contiguous())  # out of range: eager raises
        if use_triton(positions):
            return (None, None, positions)  # the Triton kernel reads the fp32 table itself
        cos, sin = self.cos_sin(positions, dtype)
        return (cos, sin, None)

    def apply_(self, x: torch.Tensor, rope: tuple) -> torch.Tensor:
        """Rotate x ``[T, H, D]`` in place with ``prepare``'s output; x may be a strided view
        (e.g. the q and k heads of a fused qkv output)."""
        cos, sin, positions = rope
        if positions is not None and use_triton(x) and x.stride(2) == 1:
            from pagedserve.kernels import triton_elementwise  # imports triton: only on the CUDA path

            triton_elementwise.rotary_neox_(x, self.cos_sin_cache, positions, self.rotary_dim)
            return x
        if positions is not None and x.dtype in _FUSED_DTYPES and x.stride(2) == 1 and x.stride(1) == x.shape[2]:
            fused.rotary_neox_(x, x.shape[1], x.shape[2], self.rotary_dim, self.cos_sin_cache, positions)
            return x
        if cos is None:
            cos, sin = self.cos_sin(positions, x.dtype)
        return self.rotate_(x, cos, sin)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[T, 1, rotary_dim / 2]`` for a step's positions; computed once per forward."""
        cs = self.cos_sin_cache.index_select(0, positions).to(dtype)
        cos, sin = cs.unsqueeze(1).chunk(2, dim=-1)
        return cos, sin

    def rotate_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate x ``[T, H, D]`` in place (neox layout) and return it. x may be a strided view
        (e.g. the q and k heads of a fused qkv output), so q and k rotate in one pass."""
        half = self.rotary_dim // 2
        x1, x2 = x[..., :half], x[..., half:self.rotary_dim]
        x1_orig = x1.clone()
        x1.mul_(cos).addcmul_(x2, sin, value=-1.0)  # x1 cos - x2 sin
        x2.mul_(cos).addcmul_(x1_orig, sin)  # x2 cos + x1 sin
        return x
