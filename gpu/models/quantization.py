"""``--quantization int8|int4``: after the weights are loaded, every linear layer (q/k/v, o, gate/up,
down and the LM head, tied or not) swaps its full-precision weight for a packed low-bit copy, and
its forward calls the CPU kernel in kernels/qgemm.py.

Why after loading: each rank quantizes exactly the shard it holds, so tensor parallelism and every
checkpoint format work unchanged. int8 is symmetric per output channel; int4 keeps a scale and a
minimum per group of 32 inputs (the GGUF Q4_1 scheme; the LM head stays int8). Activations and
outputs stay in the model's dtype. The token embedding stays full precision (a lookup reads one
row, not the table).
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from gpu.models.errors import ModelLoadError

logger = logging.getLogger(__name__)

MODES = ("none", "int8", "int4")


class QuantizedWeight:
    """The packed weight of one linear layer (this rank's shard) and the matmul that reads it."""

    __slots__ = ("mode", "tensors", "bias", "out_features", "in_features", "_linear")

    def __init__(self, mode: str, tensors: tuple[torch.Tensor, ...], bias: torch.Tensor | None,
                 out_features: int, in_features: int):
        from kernels.qgemm import PackedLinear

        self.mode, self.tensors, self.bias = mode, tensors, bias
        self.out_features, self.in_features = out_features, in_features
        self._linear = PackedLinear(mode, tensors, bias)

    @classmethod
    def from_float(cls, weight: torch.Tensor, mode: str, bias: torch.Tensor | None = None) -> "QuantizedWeight":
        from kernels import qgemm

        n, k = weight.shape
        if mode == "int8":
            tensors = qgemm.quantize_int8(weight)
        elif mode == "int4":
            tensors = qgemm.quantize_int4(weight)
        else:
            raise ValueError(f"unknown quantization mode {mode!r}")
        b = None if bias is None else bias.detach().to(torch.float32).contiguous()
        return cls(mode, tensors, b, n, k)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        y = self._linear(x)
        return y if x.dtype is torch.float32 else y.to(x.dtype)

    def dequantize(self) -> torch.Tensor:
        """The weight this layer now computes with, in fp32 (tests and accuracy checks)."""
        from kernels import qgemm

        fn = qgemm.dequantize_int8 if self.mode == "int8" else qgemm.dequantize_int4
        return fn(*self.tensors)


def _quantizable():
    from gpu.models.layers import ColumnParallelLinear, ParallelLMHead, RowParallelLinear

    return ColumnParallelLinear, RowParallelLinear, ParallelLMHead


def quantize_model(model: nn.Module, mode: str, device: torch.device | str = "cpu") -> nn.Module:
    """Swap every linear layer's weight for a packed ``mode`` copy, in place; ``none`` leaves the
    model untouched. Raises ModelLoadError for an unknown mode or a non-CPU device."""
    if mode in (None, "none"):
        return model
    if mode not in MODES:
        raise ModelLoadError(f"unknown quantization {mode!r}; use one of {', '.join(MODES)}")
    if torch.device(device).type != "cpu":
        raise ModelLoadError(f"--quantization {mode} runs on CPU only; use --quantization none on {device}")
    from kernels import qgemm

    qgemm.library()  # build (or load) the kernel now: a missing compiler fails the load, not a step
    column, row, head = _quantizable()
    before = after = 0
    fell_back = []
    with torch.no_grad():
        for name, module in model.named_modules():
            if not isinstance(module, (column, row, head)):
                continue
            weight = module.weight
            layer_mode = mode
            if mode == "int4" and isinstance(module, head):
                # The output projection decides every token: int4 there costs most of the accuracy
                # (measured: the default model's greedy agreement 0.32 with an int4 head), so it
                # stays int8, as llama.cpp keeps its output tensor at 6-8 bits in Q4 files.
                layer_mode = "int8"
            elif mode == "int4" and weight.shape[1] % qgemm.GROUP:
                layer_mode = "int8"  # int4 groups need the input size to be a multiple of 32
                fell_back.append(name)
            bias = None if isinstance(module, row) else module.bias
            module.qweight = QuantizedWeight.from_float(weight, layer_mode, bias)
            before += weight.numel() * weight.element_size()
            after += module.qweight.nbytes()
            tied = isinstance(module, head) and getattr(model, "tie_word_embeddings", False)
            if not tied:  # a tied head shares the embedding table, which the lookup still needs
                module.weight = nn.Parameter(torch.empty(0, dtype=weight.dtype), requires_grad=False)
    if fell_back:
        logger.warning("--quantization int4: %d layers have an input size that is not a multiple of %d and "
                       "use int8 instead: %s", len(fell_back), qgemm.GROUP, ", ".join(fell_back[:5]))
    logger.info("quantized linear weights to %s (%s kernel): %.1f MB -> %.1f MB", mode, qgemm.isa(),
                before / 1e6, after / 1e6)
    return model
