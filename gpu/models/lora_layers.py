"""Multi-LoRA on the linear layers: stacked per-layer A/B slots, every adapter of a step in one pass.

Each adapted linear (qkv_proj, o_proj, gate_up_proj, down_proj of every decoder layer) gets a
``LoRALinear`` holding, for each of ``max_loras`` slots, A of its S sections stacked ([S*R, in])
and B^T block-diagonal over them ([S*R, out]: section i's R rows feed only section i's output
columns), the adapter's scaling folded into B; R = max_lora_rank (a smaller rank is zero-padded,
so it contributes exact zeros). The slots' dtype is --lora-dtype's (gpu/lora_worker.py
resolve_lora_dtype): the model's, or bf16 under fp32 activations over a quantized base. A step's rows carry a slot each (-1 = base model), as a 0/1 mask
``[rows, k]`` over the k lowest slots in use (``LoRABatch``).

The delta is punica's shrink/expand written as two dense matmuls over the k slots, with no loop
over rows, adapters or sections: ``t = x @ A[:k]^T`` ([rows, k*S*R]), ``t *= mask`` (each row keeps
its own slot's columns; a base row keeps none; skipped when every row uses slot 0), then
``y += t @ B[:k]``. Three torch ops per layer whatever the mix, at the price of multiplying the
other slots' and sections' zeros too, which at LoRA ranks is small next to the base matmul; on a
busy CPU each op's dispatch (tens of us) costs more than those flops (per-section expands
measured slower).

Tensor parallelism follows the base layer: a column-parallel layer (qkv, gate/up) keeps this
rank's output columns of B; a row-parallel one (o, down) keeps this rank's input columns of A and
adds its partial delta before the all-reduce, which sums the ranks' parts as it does the base's.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from gpu.forward_context import current_lora
from gpu.models.layers import QKVParallelLinear, RowParallelLinear, linear
from gpu.parallel_state import divide, tp_all_reduce


@dataclass(slots=True)
class LoRABatch:
    """One step's rows by adapter slot: ``mask[row, s]`` = 1 where the row uses slot s (s < k)."""

    mask: torch.Tensor | None  # [rows, k], the model's dtype; None when every row uses slot 0 (k = 1)
    k: int
    rows: torch.Tensor | None = None  # int32 [rows]: each row's slot, -1 = base (the fused C layer's form)
    # (start, end, slot) of each run of consecutive adapter rows, where runs are long (prefill): the
    # delta then multiplies each run by its own slot only (slot_runs)
    runs: list[tuple[int, int, int]] | None = None


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
        self.slot_ids = torch.arange(max_loras, dtype=torch.int32)

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
        elif batch.runs is None and batch.k == 1:  # every row on slot 0
            mask[:n, 0].fill_(1)
            mask[:n, 1:].zero_()
        else:  # the run-by-run form carries no mask: built from the rows
            mask[:n].copy_(rows[:n].unsqueeze(1) == self.slot_ids)
        mask[n:size].zero_()
        return self.view(size)


RUN_MIN_ROWS = 8  # mean adapter rows per run from which a step's delta goes run by run


def slot_runs(seq_slots: list[int], query_lens: list[int]) -> list[tuple[int, int, int]] | None:
    """The step's adapter rows as runs of one slot, (start, end, slot), when they average at least
    RUN_MIN_ROWS rows a run (a prefill's rows share its sequence's slot); else None.

    Why: the dense form (``LoRALinear.delta_into``) multiplies every row by all k slots' A and B and
    masks; over a 16-sequence prefill of 4 adapters that is 4x the delta's flops (~15 G multiply-adds
    a 512-token prefill of the default model at rank 16, +19 % of its CPU time; loadtest/PERF.md,
    "LoRA overhead, thirteenth session"). Run by run it is two matmuls per run on row slices (no
    copies), worth it only when runs are long: a decode step's runs are single rows."""
    runs: list[tuple[int, int, int]] = []
    start = 0
    for slot, n in zip(seq_slots, query_lens):
        if slot >= 0 and n > 0:
            if runs and runs[-1][2] == slot and runs[-1][1] == start:
                runs[-1] = (runs[-1][0], start + n, slot)
            else:
                runs.append((start, start + n, slot))
        start += n
    adapter_rows = sum(end - begin for begin, end, _ in runs)
    return runs if runs and adapter_rows >= RUN_MIN_ROWS * len(runs) else None


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
        if batch.runs is not None:
            a, b = self.a[:batch.k].to(x.dtype), self.b[:batch.k].to(x.dtype)  # widened once a call
            for start, end, slot in batch.runs:
                y[start:end].addmm_(F.linear(x[start:end], a[slot]), b[slot])
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
