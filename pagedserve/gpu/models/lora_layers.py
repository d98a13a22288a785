"""Multi-LoRA on the linear layers: stacked per-layer A/B slots, every adapter of a step in one pass.

Each adapted linear (qkv_proj, o_proj, gate_up_proj, down_proj of every decoder layer) gets a
``LoRALinear`` holding, for each of ``max_loras`` slots, A of its S sections stacked ([S*R, in])
and B^T block-diagonal over them ([S*R, out]: section i's R rows feed only section i's output
columns), the adapter's scaling folded into B; R = max_lora_rank (a smaller rank is zero-padded,
so it contributes exact zeros). The slots' dtype is --lora-dtype's (gpu/lora_worker.py
resolve_lora_dtype): the model's, or bf16 under fp32 activations over a quantized base. A step's
rows carry a slot each (-1 = base model): as int32 slots (``LoRABatch.rows``) and as a 0/1 mask
``[rows, k]`` over the k lowest slots in use.

On CPU the delta is C (csrc/fused_lora.h, through ``kernels.fused.lora_add`` here and inside the
fused decode layer): rows grouped by slot, each row times its own slot's A and the live columns of
its B only, one parallel region a call. Measured against the torch forms it replaced (loadtest/
PERF.md, fourteenth session): a 16-sequence prefill of 4 adapters ran ~3,800 small MKL matmuls a
step, each its own OpenMP region, which on a shared 2-core box cost more than their flops.

Elsewhere (CUDA, or a CPU without the C library) it is punica's shrink/expand as two dense matmuls
over the k slots, with no loop over rows, adapters or sections: ``t = x @ A[:k]^T`` ([rows,
k*S*R]), ``t *= mask`` (each row keeps its own slot's columns; a base row keeps none; skipped when
every row uses slot 0), then ``y += t @ B[:k]``: three ops a layer whatever the mix, with fixed
shapes (CUDA graphs), at the price of multiplying the other slots' and sections' zeros too.

Tensor parallelism follows the base layer: a column-parallel layer (qkv, gate/up) keeps this
rank's output columns of B; a row-parallel one (o, down) keeps this rank's input columns of A and
adds its partial delta before the all-reduce, which sums the ranks' parts as it does the base's.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.gpu.forward_context import current_lora
from pagedserve.gpu.models.layers import QKVParallelLinear, RowParallelLinear, linear
from pagedserve.gpu.parallel_state import divide, tp_all_reduce
from pagedserve.kernels import abi, fused


@dataclass(slots=True)
class LoRABatch:
    """One step's rows by adapter slot: ``mask[row, s]`` = 1 where the row uses slot s (s < k)."""

    mask: torch.Tensor | None  # [rows, k], the model's dtype; None when every row uses slot 0 (k = 1)
    k: int
    rows: torch.Tensor | None = None  # int32 [rows] on the host: each row's slot, -1 = base (the C delta's form)


class StaticLoRABatch:
    """A step's adapter slots in fixed buffers, for the decode graph runner (gpu/graphs.py): a
    captured CUDA graph reads the mask at one address and shape, so every step's LoRABatch (any
    k <= max_loras, a mask or None, or no adapter rows at all) is written into ``mask``
    [max_size, max_loras] (the model's dtype) and ``rows`` int32 [max_size] (host memory: only the
    fused C decode layer on CPU reads it, by address), and the graph runs over a LoRABatch of
    views of them with k = max_loras. Rows past the step's, and every row of a base-only step, get
    mask 0 and slot -1, so one set of graphs serves adapter and base steps."""

    def __init__(self, max_size: int, max_loras: int, dtype: torch.dtype, device):
        self.max_loras = max_loras
        self.mask = torch.zeros(max_size, max_loras, dtype=dtype, device=device)
        self.rows = torch.full((max_size,), -1, dtype=torch.int32)

    def view(self, size: int) -> LoRABatch:
        """The LoRABatch a graph of batch size ``size`` is captured with and runs over."""
        return LoRABatch(self.mask[:size], self.max_loras, self.rows[:size])

    def fill(self, batch: LoRABatch | None, n: int, size: int) -> LoRABatch:
        """Write the step's ``n`` rows (``batch``: None when none uses an adapter), reset rows n..size."""
        mask, rows = self.mask, self.rows
        if batch is None:
            mask[:size].zero_()
            rows[:size].fill_(-1)
            return self.view(size)
        if batch.rows is not None:
            rows[:n].copy_(batch.rows)
        else:  # only a mask (or slot 0 everywhere): each row's slot, -1 where it has none
            rows[:n].copy_(batch.mask.argmax(1).masked_fill(batch.mask.sum(1) == 0, -1).to(torch.int32)
                           if batch.mask is not None else torch.zeros(n, dtype=torch.int32))
        rows[n:size].fill_(-1)
        if batch.mask is not None:
            mask[:n, :batch.k].copy_(batch.mask)
            mask[:n, batch.k:].zero_()
        else:  # k = 1: every row on slot 0
            mask[:n, 0].fill_(1)
            mask[:n, 1:].zero_()
        mask[n:size].zero_()
        return self.view(size)



@dataclass(slots=True)
class Section:
    """One adapted checkpoint module inside a (possibly fused) layer, on this rank."""

    module: str  # q_proj, ..., as PEFT names it
    out_offset: int  # first output column in this rank's layer output
    out_size: int  # output columns on this rank
    out_start: int  # first of them in the full (unsharded) module output


class LoRALinear:
    """The adapter slots of one linear layer; replaces the layer's ``forward`` when LoRA is on."""

    def __init__(self, base: nn.Module, sections: list[Section], max_loras: int, max_rank: int,
                 dtype: torch.dtype, device):
        self.base = base
        self.base_forward = base.forward
        self.sections = sections
        self.row_parallel = isinstance(base, RowParallelLinear)
        self.tp_rank, self.tp_size = base.tp_rank, base.tp_size
        in_local = base.input_size_per_rank if self.row_parallel else base.input_size
        self.in_local = in_local
        self.rank = max_rank
        self.out_local = sum(s.out_size for s in sections)
        self.a = torch.zeros(max_loras, len(sections) * max_rank, in_local, dtype=dtype, device=device)
        self.b = torch.zeros(max_loras, len(sections) * max_rank, self.out_local, dtype=dtype, device=device)
        # CPU: the C delta (kernels/fused.py lora_add) reads the same slots through this spec
        self.spec = None
        if fused.supports(self.a):
            self.spec = abi.LinearSpec()
            fused.attach_lora(self.spec, self.a, self.b, max_rank, self.cols())

    def cols(self) -> list[int]:
        """Section i feeds output columns cols[i]:cols[i+1] (the C delta's section bounds)."""
        return [s.out_offset for s in self.sections] + [self.out_local]

    def set_slot(self, slot: int, weights: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Slot ``slot`` takes the adapter's (A, scaled B) per module (full checkpoint shapes);
        sections the adapter does not adapt are zeroed."""
        self.clear_slot(slot)
        R = self.rank
        for i, sec in enumerate(self.sections):
            pair = weights.get(sec.module)
            if pair is None:
                continue
            a, b = pair  # [r, in_full], [out_full, r] (already scaled)
            r = a.shape[0]
            if self.row_parallel:
                a = a.narrow(1, self.tp_rank * self.in_local, self.in_local)
            else:
                b = b.narrow(0, sec.out_start, sec.out_size)
            self.a[slot, i * R:i * R + r].copy_(a)
            self.b[slot, i * R:i * R + r, sec.out_offset:sec.out_offset + sec.out_size].copy_(b.t())

    def clear_slot(self, slot: int) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()

    def delta_into(self, x: torch.Tensor, y: torch.Tensor, batch: LoRABatch) -> None:
        """y += this step's LoRA delta for every row (base rows get exact zeros, or are left alone)."""
        if self.spec is not None and batch.rows is not None and fused.supports(x) and y.dtype == x.dtype:
            # CPU: each row times its own slot only, in C (the fused decode layer's arithmetic)
            fused.lora_add(self.spec, x.contiguous(), y, batch.rows)
            return
        k, width = batch.k, self.a.shape[1]
        # slots of another dtype than the activations (--lora-dtype) are widened (exactly, for bf16
        # under fp32) for the matmuls, as the fused C layer widens them
        t = F.linear(x, self.a[:k].view(k * width, self.in_local).to(x.dtype))
        if batch.mask is not None:
            t.view(x.shape[0], k, width).mul_(batch.mask.unsqueeze(2))
        y.addmm_(t, self.b[:k].view(k * width, self.out_local).to(x.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch = current_lora()
        if batch is None:
            return self.base_forward(x)
        if not self.row_parallel:
            y = self.base_forward(x)
            self.delta_into(x, y, batch)
            return y
        base = self.base
        y = linear(x, base.weight, None, base.pweight) if base.qweight is None else base.qweight.linear(x)
        self.delta_into(x, y, batch)
        if self.tp_size > 1:
            y = tp_all_reduce(y)
        if base.bias is not None:
            y = y + base.bias
        return y


class SkipFastPathForLoRA:
    """A fused C decode path (gpu/models/fast_decode.py) that steps aside (returns None, so the
    caller runs the per-linear torch path) when the step has adapter rows: for the fused layers
    that cannot carry the adapter slots (``FastDecodeLayer.attach_lora`` refused them). Base-only
    steps keep it."""

    def __init__(self, fast):
        self.fast = fast
        self.max_rows = getattr(fast, "max_rows", None)  # optional: the per-layer path has it

    def forward(self, rope, x, residual):
        if current_lora() is not None:
            return None
        return self.fast.forward(rope, x, residual)


def _qkv_sections(layer: QKVParallelLinear) -> list[Section]:
    hd, tp_rank = layer.head_dim, layer.tp_rank
    q, kv = layer.num_heads * hd, layer.num_kv_heads * hd
    kv_start = (tp_rank // layer.kv_replicas) * kv
    return [Section("q_proj", 0, q, tp_rank * q), Section("k_proj", q, kv, kv_start),
            Section("v_proj", q + kv, kv, kv_start)]


def _gate_up_sections(layer) -> list[Section]:
    size = divide(layer.output_sizes[0], layer.tp_size, "fused linear part")
    return [Section("gate_proj", 0, size, layer.tp_rank * size),
            Section("up_proj", size, size, layer.tp_rank * size)]


def install(model: nn.Module, max_loras: int, max_rank: int, dtype: torch.dtype,
            device) -> dict[int, list[LoRALinear]]:
    """Put LoRA slots on every decoder layer's linears (a Llama-family model); returns
    layer index -> its LoRALinears (which cover every module of TARGET_MODULES)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None or not hasattr(layers[0], "self_attn") or not hasattr(layers[0].self_attn, "qkv_proj"):
        raise ValueError(f"--enable-lora supports the Llama family of models, not {type(model).__name__}")
    hidden = int(model.config["hidden_size"])
    out: dict[int, list[LoRALinear]] = {}
    for i, layer in enumerate(layers):
        attn, mlp = layer.self_attn, layer.mlp
        holders = [
            LoRALinear(attn.qkv_proj, _qkv_sections(attn.qkv_proj), max_loras, max_rank, dtype, device),
            LoRALinear(attn.o_proj, [Section("o_proj", 0, hidden, 0)],
                       max_loras, max_rank, dtype, device),
            LoRALinear(mlp.gate_up_proj, _gate_up_sections(mlp.gate_up_proj), max_loras, max_rank, dtype, device),
            LoRALinear(mlp.down_proj, [Section("down_proj", 0, hidden, 0)],
                       max_loras, max_rank, dtype, device),
        ]
        for h in holders:
            h.base.forward = h.forward  # the layer's callers call .forward directly
        out[i] = holders
        fast = layer.fast_decode
        if fast is not None and not fast.attach_lora(dict(zip(("qkv", "o", "gate_up", "down"), holders))):
            layer.fast_decode = SkipFastPathForLoRA(fast)
    stack = inner.fast_stack
    if stack is not None and any(layer.lora is None for layer in stack.layers):
        inner.fast_stack = SkipFastPathForLoRA(stack)
    return out
