"""``--quantization fp8`` on CUDA (compute capability >= 8.9): every decoder linear layer (q/k/v,
o, gate/up, down; not the LM head nor the embedding, as in vLLM) computes from e4m3 weights with
one scale per output channel and activations quantized per token, through ``torch._scaled_mm``
(kernels/fp8_linear.py holds the math and the device check).

Two sources of the fp8 weights:
- a full-precision checkpoint (or dummy weights): each layer's weight quantized once at load, on
  the device, one layer at a time (``quantize_model_fp8``);
- an FP8 checkpoint (config.json ``quantization_config.quant_method == "fp8"``, as AutoFP8,
  llm-compressor's and vLLM's own exports write it): each linear's ``weight`` is e4m3 and its
  ``weight_scale`` a float32 scale per tensor or per output channel. The e4m3 values load exactly
  into the model's dtype (bf16/fp16/fp32 hold every e4m3 value), the scales into a ``weight_scale``
  parameter (``add_checkpoint_scales``; a per-tensor scale is repeated over the tensor's rows, so
  fused q/k/v and gate/up keep each part's own scale); ``quantize_model_fp8`` then casts the
  values back to e4m3 without rounding. Activations are always dynamic per token, so a checkpoint's
  static ``input_scale`` is not read. On a device without FP8 (or under --quantization none /
  int8 / int4) the scales are folded into the weights (``dequantize_checkpoint``).
Layers whose sizes ``torch._scaled_mm`` cannot take (K or N not a multiple of 16) stay in the
model's dtype.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from pagedserve.contracts.errors import ModelLoadError
from pagedserve.kernels import fp8_linear

logger = logging.getLogger(__name__)

SCALE = "weight_scale"


class Fp8Weight:
    """One linear layer's e4m3 weight [N, K] and float32 scales [N] (this rank's shard)."""

    __slots__ = ("mode", "weight", "scale", "bias", "out_features", "in_features", "dtype")

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype):
        self.mode = "fp8"
        self.weight, self.scale, self.bias, self.dtype = weight, scale.reshape(-1).float().contiguous(), bias, dtype
        self.out_features, self.in_features = weight.shape

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> "Fp8Weight":
        q, s = fp8_linear.quantize_weight(weight)
        return cls(q, s, bias, weight.dtype)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear.fp8_linear(x, self.weight, self.scale, self.bias)

    def nbytes(self) -> int:
        return self.weight.numel() + self.scale.numel() * 4

    def dequantize(self) -> torch.Tensor:
        """The weight this layer computes with, in float32 (tests and accuracy checks)."""
        return fp8_linear.dequantize(self.weight, self.scale)


def checkpoint_is_fp8(hf_config: dict) -> bool:
    qc = hf_config.get("quantization_config") or {}
    if qc.get("quant_method") != "fp8":
        return False
    if qc.get("weight_block_size"):
        raise ModelLoadError(f"block-wise FP8 checkpoints (weight_block_size {qc['weight_block_size']}) are not "
                             "supported; per-tensor or per-channel weight_scale only")
    return True


def linear_layers(model: nn.Module):
    """(name, module) of the layers fp8 quantizes: column- and row-parallel linears, not the head."""
    from pagedserve.gpu.models.layers import ColumnParallelLinear, RowParallelLinear

    for name, module in model.named_modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            yield name, module


def _full_rows(module: nn.Module, shard_id) -> int:
    """The rows of checkpoint tensor ``shard_id`` of ``module`` before the tensor-parallel split."""
    from pagedserve.gpu.models.layers import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear

    if isinstance(module, RowParallelLinear):
        return module.weight.shape[0]
    if isinstance(module, QKVParallelLinear) and shard_id is not None:
        if shard_id == "q":
            return module.num_heads * module.head_dim * module.tp_size
        return module.num_kv_heads * module.head_dim * module.tp_size // module.kv_replicas
    if isinstance(module, MergedColumnParallelLinear) and shard_id is not None:
        return module.output_sizes[shard_id]
    return module.output_size_per_rank * module.tp_size


def add_checkpoint_scales(model: nn.Module) -> int:
    """Give every linear layer a ``weight_scale`` parameter [rows, 1] for an FP8 checkpoint's
    scales (optional: a layer the checkpoint keeps unquantized has none); returns how many."""
    from pagedserve.gpu.models.layers import RowParallelLinear, default_weight_loader

    count = 0
    for _, module in linear_layers(model):
        rows = module.weight.shape[0]
        param = nn.Parameter(torch.ones(rows, 1, dtype=torch.float32, device=module.weight.device),
                             requires_grad=False)

        def loader(param, loaded, shard_id=None, module=module):
            loaded = loaded.reshape(-1).float()
            full = _full_rows(module, shard_id)
            if loaded.numel() == 1:
                loaded = loaded.expand(full)  # per tensor: each row of this part gets the one scale
            loaded = loaded.reshape(-1, 1)
            if isinstance(module, RowParallelLinear):
                default_weight_loader(param, loaded)
            else:
                module.weight_loader(param, loaded, shard_id)

        param.weight_loader = loader
        param.optional = True
        shard_ids = getattr(module.weight, "shard_ids", None)  # optional: only fused layers have them
        if shard_ids:
            param.shard_ids = shard_ids
        module.register_parameter(SCALE, param)
        count += 1
    return count


def _take_scale(module: nn.Module) -> torch.Tensor | None:
    scale = getattr(module, SCALE, None)  # optional: only an FP8 checkpoint's layers have one
    if scale is None:
        return None
    delattr(module, SCALE)
    return scale.detach().reshape(-1)


def dequantize_checkpoint(model: nn.Module) -> None:
    """An FP8 checkpoint served without fp8 matmuls: each weight times its scale, in place."""
    with torch.no_grad():
        for _, module in linear_layers(model):
            scale = _take_scale(module)
            if scale is not None:
                module.weight.copy_((module.weight.float() * scale[:, None].to(module.weight.device))
                                    .to(module.weight.dtype))


def quantize_model_fp8(model: nn.Module) -> nn.Module:
    """Swap every eligible linear layer's weight for an Fp8Weight, in place (the device check is
    the caller's: gpu.models.quantization.check_mode)."""
    from pagedserve.gpu.models.layers import RowParallelLinear

    before = after = kept = 0
    with torch.no_grad():
        for _, module in linear_layers(model):
            scale = _take_scale(module)
            weight = module.weight
            if module.qweight is not None:
                continue
            if not fp8_linear.eligible(*weight.shape):
                kept += 1
                if scale is not None:  # an fp8 checkpoint's odd-sized layer: its real weight
                    weight.copy_((weight.float() * scale[:, None]).to(weight.dtype))
                continue
            bias = None if isinstance(module, RowParallelLinear) else module.bias
            if scale is None:
                qweight = Fp8Weight.from_float(weight, bias)
            else:  # the checkpoint's e4m3 values, held exactly in the model's dtype
                qweight = Fp8Weight(weight.to(fp8_linear.FP8), scale, bias, weight.dtype)
            before += weight.numel() * weight.element_size()
            after += qweight.nbytes()
            module.qweight = qweight
            module.pweight = None
            # the full-precision weight freed (an empty parameter keeps attribute access), as
            # gpu.models.quantization.drop_weight does; that module imports this one
            module.weight = nn.Parameter(torch.empty(0, dtype=weight.dtype, device=weight.device), requires_grad=False)
    logger.info("fp8 linear weights (per-channel scales, per-token activations): %.1f MB -> %.1f MB%s",
                before / 1e6, after / 1e6, f"; {kept} layer(s) of sizes torch._scaled_mm cannot take kept" if kept
                else "")
    return model
