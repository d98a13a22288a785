"""Weight-only quantized linear layers on CPU: ``--quantization auto|none|int8|int4`` (and the
switch to ``fp8``, W8A8 on CUDA: gpu/models/fp8.py).

A quantized layer (q/k/v, o, gate/up, down, the LM head; a tied or quantized-in-the-file token
embedding too) holds a packed low-bit copy of its weight (``module.qweight``) instead of a
full-precision one, and its forward calls the CPU kernel in kernels/qgemm.py. Packed layouts:
- ``q8_0``: int8 in groups of 32 with an fp16 scale (GGUF Q8_0) — ``int8``;
- ``q4_1``: 4-bit codes in groups of 32 with an fp16 scale and minimum (GGUF Q4_1; Q4_0 loads as
  it with minimum -8 d) — ``int4``; the LM head stays q8_0 (4 bits there cost most of the accuracy);
- ``int8c``: int8 with one scale per output channel, for input sizes that are not a multiple of 32.

GGUF files load straight into these layouts (gpu/models/gguf_packed.py), one tensor at a time,
without a full-precision copy; ``auto`` keeps what the file says (vLLM's behaviour). A full
precision checkpoint (safetensors, or ``none``) under int8/int4 is quantized after loading
(``quantize_model``), each rank quantizing the shard it holds. Activations and outputs stay in the
model's dtype (fp32 or bf16).
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from pagedserve.contracts.errors import ModelLoadError

logger = logging.getLogger(__name__)

MODES = ("auto", "none", "int8", "int4", "fp8")  # fp8: CUDA only, gpu/models/fp8.py


class QuantizedWeight:
    """The packed weight of one linear layer or embedding table (this rank's shard), the matmul
    that reads it and its row lookup."""

    __slots__ = ("mode", "bias", "out_features", "in_features", "dtype", "_linear")

    def __init__(self, mode: str, tensors: tuple[torch.Tensor, ...], bias: torch.Tensor | None = None,
                 dtype: torch.dtype = torch.float32):
        from pagedserve.kernels.qgemm import PackedLinear

        self._linear = PackedLinear(mode, tensors, bias)
        self.mode, self.bias = self._linear.mode, bias  # (the kernel may keep only a re-laid copy)
        self.out_features, self.in_features = self._linear.n, self._linear.k
        self.dtype = dtype  # the model's dtype: what the row lookup returns

    @classmethod
    def from_float(cls, weight: torch.Tensor, mode: str, bias: torch.Tensor | None = None) -> "QuantizedWeight":
        """``mode``: a layout (q8_0, q4_1, int8c) or a user mode (int8, int4)."""
        from pagedserve.kernels import qgemm

        k = weight.shape[1]
        layout = {"int8": layout_for("int8", k), "int4": layout_for("int4", k)}.get(mode, mode)
        if layout not in qgemm.LAYOUTS:
            raise ValueError(f"unknown quantization mode {mode!r}")
        b = None if bias is None else bias.detach().to(torch.float32).contiguous()
        return cls(layout, qgemm.quantize(weight, layout), b, weight.dtype)

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The packed weight in its layout's form (kernels/qgemm.py LAYOUTS)."""
        return self._linear.row_tensors()

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._linear.tensors)

    @property
    def kernel(self):
        """The kernels.qgemm.PackedLinear that computes this layer."""
        return self._linear

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        y = self._linear(x)
        return y if y.dtype is x.dtype else y.to(x.dtype)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """An embedding lookup on the packed table, in the model's dtype."""
        y = self._linear.rows(ids, self.dtype)
        return y if y.dtype is self.dtype else y.to(self.dtype)

    def dequantize(self) -> torch.Tensor:
        """The weight this layer now computes with, in fp32 (tests and accuracy checks)."""
        from pagedserve.kernels import qgemm

        return qgemm.dequantize(self.mode, self.tensors)


def layout_for(mode: str, in_features: int, head: bool = False) -> str:
    """The packed layout ``--quantization mode`` gives a layer with this input size."""
    from pagedserve.kernels.qgemm import GROUP

    if in_features % GROUP:
        return "int8c"  # grouped layouts need whole groups of 32 inputs
    if mode == "int4" and not head:
        return "q4_1"
    return "q8_0"  # int8; and int4's LM head (measured: an int4 head cut greedy agreement to 0.32)


def check_mode(mode: str | None, device, capability: tuple[int, int] | None = None) -> None:
    """Raise unless ``--quantization mode`` runs on ``device``: int8 / int4 on the CPU, fp8 on a
    GPU of compute capability >= 8.9 (ConfigError naming the option and what is supported;
    ``capability`` stands in for the device's own, for a check about a card not present)."""
    if mode in (None, "none", "auto"):
        return
    if mode not in MODES:
        raise ModelLoadError(f"unknown quantization {mode!r}; use one of {', '.join(MODES)}")
    if mode == "fp8":
        from pagedserve.contracts.config import ConfigError
        from pagedserve.kernels import fp8_linear

        try:
            fp8_linear.check_device(device, capability)
        except fp8_linear.Fp8UnsupportedError as e:
            raise ConfigError(str(e)) from None
        return
    if torch.device(device).type != "cpu":
        raise ModelLoadError(f"--quantization {mode} runs on CPU only; use --quantization none on {device}")


def quantizable_types():
    from pagedserve.gpu.models.layers import ColumnParallelLinear, ParallelLMHead, RowParallelLinear

    return ColumnParallelLinear, RowParallelLinear, ParallelLMHead


def drop_weight(module: nn.Module) -> None:
    """Free a packed module's full-precision weight (an empty parameter keeps attribute access)."""
    w = module.weight
    module.weight = nn.Parameter(torch.empty(0, dtype=w.dtype, device=w.device), requires_grad=False)


def attach(model: nn.Module, name: str, module: nn.Module, qweight: QuantizedWeight) -> None:
    """Make ``module`` compute with ``qweight``; a tied head and embedding share one packed table
    (the lookup reads its rows), so the full-precision table goes too."""
    from pagedserve.gpu.models.layers import ParallelLMHead, VocabParallelEmbedding

    module.qweight = qweight
    tied = getattr(model, "tie_word_embeddings", False)  # optional: declared by models that can tie them
    if tied and isinstance(module, VocabParallelEmbedding):
        head, embedding = model.lm_head, model.model.embed_tokens
        if qweight.mode == "int8c":  # no row lookup: the embedding keeps its table
            if isinstance(module, ParallelLMHead):
                return
        else:
            head.qweight = embedding.qweight = qweight
            drop_weight(embedding)
            head.weight = embedding.weight
            return
    drop_weight(module)


def quantize_model(model: nn.Module, mode: str, device: torch.device | str = "cpu") -> nn.Module:
    """Swap every linear layer's full-precision weight for a packed ``mode`` copy, in place;
    ``none`` and ``auto`` (nothing in the checkpoint to keep) leave the model untouched. Raises
    ModelLoadError for an unknown mode or a non-CPU device."""
    check_mode(mode, device)
    if mode in (None, "none", "auto"):
        return model
    if mode == "fp8":
        from pagedserve.gpu.models.fp8 import quantize_model_fp8

        return quantize_model_fp8(model)
    from pagedserve.gpu.models.packed_linear import dense_weight
    from pagedserve.kernels import qgemm

    qgemm.library()  # build (or load) the kernel now: a missing compiler fails the load, not a step
    column, row, head = quantizable_types()
    before = after = 0
    counts: dict[str, int] = {}
    with torch.no_grad():
        for name, module in list(model.named_modules()):
            if not isinstance(module, (column, row, head)) or module.qweight is not None:
                continue
            weight = dense_weight(module)  # a model loaded unquantized may hold it packed
            layout = layout_for(mode, weight.shape[1], head=isinstance(module, head))
            bias = None if isinstance(module, row) else module.bias
            qweight = QuantizedWeight.from_float(weight, layout, bias)
            before += weight.numel() * weight.element_size()
            after += qweight.nbytes()
            counts[layout] = counts.get(layout, 0) + 1
            attach(model, name, module, qweight)
            module.pweight = None
    logger.info("quantized linear weights to %s (%s kernel; layouts %s): %.1f MB -> %.1f MB", mode, qgemm.isa(),
                counts, before / 1e6, after / 1e6)
    return model

