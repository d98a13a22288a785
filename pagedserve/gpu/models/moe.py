"""Mixture-of-experts feed-forward (Qwen3-MoE, Mixtral): a router picks ``top_k`` experts a token,
and the experts run grouped by expert.

Why grouped: a Python loop per token (or per token and expert) costs more than the matmuls on a
decode batch. Here the (token, expert) pairs are sorted by expert once, each active expert
multiplies its contiguous run of token rows in one gate/up and one down matmul, and the
weighted results are scattered back with one ``index_add_``: the loop is over active experts
(at most ``num_experts``), never over tokens.

Quantized experts (``qexperts``): ``--quantization int8|int4`` packs a checkpoint's experts
(gpu/models/quantization.py), and a GGUF file's ``ffn_*_exps`` tensors load packed expert by
expert (gpu/models/gguf_experts.py, ``load_packed_part``): each expert then holds its gate/up rows
and its down weight as two packed weights, and the full-precision stacks are freed.

Decode batches (1-16 fp32 rows) skip all of that: ``SparseMoeBlock.c_step`` runs routing, the
grouped experts and the weighted sum in one C call (kernels/moe_cpu.py), the same kernels called by
address; at one row the torch ops around the kernel calls cost as much as the kernels (PERF.md).

Tensor parallelism shards every expert's intermediate dimension (gate/up rows, down columns)
across ranks, as the dense MLP is sharded: each rank holds a slice of all experts and the down
projection's partial sums are all-reduced once per layer.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.contracts.errors import ModelLoadError
from pagedserve.gpu.models.layers import _copy_checked, _new_param, default_weight_loader
from pagedserve.gpu.models.quantization import QuantizedWeight
from pagedserve.gpu.parallel_state import divide, get_tp_rank, get_tp_size, tp_all_reduce
from pagedserve.kernels import fused, moe_cpu

logger = logging.getLogger(__name__)


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights ``[T, k]`` fp32, expert ids ``[T, k]``): softmax over all experts in fp32, the k
    largest, divided by their sum when ``renormalize`` (transformers' order of operations)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def group_by_expert(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, list[int]]:
    """(pair order, pairs per expert): ``ids.reshape(-1)[order]`` is sorted by expert (stable, so a
    token's pairs keep their rank order), and expert e owns ``counts[e]`` consecutive pairs."""
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    return order, counts


class FusedExperts(nn.Module):
    """Every expert's gate/up ``w13 [E, 2 * I_rank, H]`` and down ``w2 [E, H, I_rank]``, this
    rank's slice of the intermediate dimension."""

    # Under --quantization int8 / int4: each expert's (gate/up, down) as packed weights
    # (gpu.models.quantization.QuantizedWeight), the full-precision stacks dropped.
    qexperts: list | None = None

    def __init__(self, num_experts: int, hidden: int, intermediate: int):
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.num_experts, self.hidden = num_experts, hidden
        self.inter = divide(intermediate, self.tp_size, "expert intermediate size")
        self.w13 = _new_param(num_experts, 2 * self.inter, hidden, loader=self.load_w13,
                              shard_ids=tuple((e, p) for e in range(num_experts) for p in (0, 1)))
        self.w2 = _new_param(num_experts, hidden, self.inter, loader=self.load_w2,
                             shard_ids=tuple(range(num_experts)))

    def load_w13(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        """shard_id (expert, 0 gate | 1 up) with that expert's ``[I, H]`` tensor; None: the whole
        ``[E, 2I, H]`` stack (gate rows then up rows per expert, transformers 5's layout)."""
        n = self.inter
        if shard_id is None:
            gate = loaded.narrow(1, self.tp_rank * n, n)
            up = loaded.narrow(1, loaded.shape[1] // 2 + self.tp_rank * n, n)
            _copy_checked(param.data, torch.cat([gate, up], dim=1), "stacked expert gate/up")
            return
        expert, part = shard_id
        self._check_expert(expert)
        if loaded.shape != (n * self.tp_size, self.hidden):
            raise ModelLoadError(f"shape mismatch: checkpoint has {tuple(loaded.shape)}, model expects "
                                 f"{(n * self.tp_size, self.hidden)}")
        _copy_checked(param.data[expert, part * n:(part + 1) * n], loaded.narrow(0, self.tp_rank * n, n),
                      f"expert {expert} {'up' if part else 'gate'}")

    def _check_expert(self, expert: int) -> None:
        if not 0 <= expert < self.num_experts:
            raise ModelLoadError(f"the checkpoint has expert {expert}; the config says {self.num_experts} experts")

    def load_w2(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        n = self.inter
        if shard_id is None:
            _copy_checked(param.data, loaded.narrow(2, self.tp_rank * n, n), "stacked expert down")
            return
        self._check_expert(shard_id)
        if loaded.shape != (self.hidden, n * self.tp_size):
            raise ModelLoadError(f"shape mismatch: checkpoint has {tuple(loaded.shape)}, model expects "
                                 f"{(self.hidden, n * self.tp_size)}")
        _copy_checked(param.data[shard_id], loaded.narrow(1, self.tp_rank * n, n), f"expert {shard_id} down")

    # ------------------------------------------------------------------ packed from a file

    def load_packed_part(self, expert: int, part: int, layout: str, tensors: tuple[torch.Tensor, ...]) -> None:
        """One expert's gate (0), up (1) or down (2) weight already in a packed ``layout`` (all the
        checkpoint's rows and columns): this rank keeps its rows (gate, up) or columns (down)."""
        from pagedserve.kernels import qgemm

        n, tp, r = self.inter, self.tp_size, self.tp_rank
        rows, cols = (n * tp, self.hidden) if part < 2 else (self.hidden, n * tp)
        want = [tuple(w) for w in qgemm.packed_shapes(layout, rows, cols)]
        if [tuple(t.shape) for t in tensors] != want:
            raise ModelLoadError(f"expert {expert} {('gate', 'up', 'down')[part]}: packed shapes "
                                 f"{[tuple(t.shape) for t in tensors]}, model expects {want}")
        if tp > 1:
            if part < 2:
                tensors = tuple(t.narrow(0, r * n, n).contiguous() for t in tensors)
            elif n % qgemm.GROUP:
                raise ModelLoadError(f"packed experts under tensor parallelism need the per-rank expert size ({n}) "
                                     f"to be a multiple of {qgemm.GROUP}")
            else:
                tensors = tuple(t.narrow(1, r * t.shape[1] // tp, t.shape[1] // tp).contiguous() for t in tensors)
        if self._parts is None:
            self._parts = [[None, None, None] for _ in range(self.num_experts)]
        self._parts[expert][part] = (layout, tensors)

    _parts: list | None = None  # packed pieces while a file loads: [gate, up, down] per expert

    def finish_packed(self) -> None:
        """After loading: every expert packed (gate and up rows stacked into one weight; the
        full-precision stacks freed), or none of them."""
        if self._parts is None:
            return
        if any(p is None for parts in self._parts for p in parts):
            raise ModelLoadError("some experts of a layer arrived packed and others did not")
        packed = []
        for (lg, gate), (lu, up), (ld, down) in self._parts:
            if lg != lu:
                raise ModelLoadError(f"an expert's gate ({lg}) and up ({lu}) are packed differently")
            packed.append((QuantizedWeight(lg, tuple(torch.cat([g, u]) for g, u in zip(gate, up)), None,
                                           self.w13.dtype),
                           QuantizedWeight(ld, down, None, self.w2.dtype)))
        self._parts = None
        for name in ("w13", "w2"):
            old = getattr(self, name)
            p = nn.Parameter(torch.empty(0, dtype=old.dtype, device=old.device), requires_grad=False)
            p.weight_loader, p.shard_ids = old.weight_loader, old.shard_ids
            setattr(self, name, p)
        self.qexperts = packed

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Each token's weighted sum over its experts (this rank's partial sum under TP)."""
        top_k = ids.shape[1]
        order, counts = group_by_expert(ids, self.num_experts)
        tokens = order // top_k  # the token of each sorted (token, expert) pair
        pair_weights = weights.reshape(-1)[order].to(x.dtype)
        out = torch.zeros_like(x)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            rows = tokens[start:start + count]
            if self.qexperts is None:
                h = F.linear(x.index_select(0, rows), self.w13[expert])
                gate, up = h.chunk(2, dim=-1)
                y = F.linear(F.silu(gate).mul_(up), self.w2[expert])
            else:
                w13, w2 = self.qexperts[expert]
                gate, up = w13.linear(x.index_select(0, rows)).chunk(2, dim=-1)
                y = w2.linear(F.silu(gate).mul_(up).contiguous())
            out.index_add_(0, rows, y.mul_(pair_weights[start:start + count, None]))
            start += count
        return out


class SparseMoeBlock(nn.Module):
    """Router (``gate``, replicated) + experts: the MLP of a MoE decoder layer."""

    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int, renormalize: bool):
        super().__init__()
        self.top_k, self.renormalize = top_k, renormalize
        self.gate = nn.Module()
        self.gate.weight = _new_param(num_experts, hidden, loader=default_weight_loader)
        self.experts = FusedExperts(num_experts, hidden, intermediate)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return route(self.router_logits(x), self.top_k, self.renormalize)

    def router_logits(self, x: torch.Tensor) -> torch.Tensor:
        """The router's logits; for the rows the C step takes (1 to moe_cpu.MAX_M fp32 rows) by the
        GEMV it calls (fz_gemv_f32), so both paths route a row alike. Softmax turns a logit's absolute
        error into the same relative error of its weight (one ulp of a logit near 20 is 1.9e-6), and
        torch's GEMM sums in another order than the GEMV, one that also changes with the row count
        (issue 36: the C step's weights were 3e-6 off the eager ones at every row count)."""
        w = self.gate.weight
        if (x.dtype is torch.float32 and w.dtype is torch.float32 and x.dim() == 2 and x.device.type == "cpu"
                and w.device.type == "cpu" and w.is_contiguous() and 1 <= x.shape[0] <= moe_cpu.MAX_M
                and fused.library() is not None):
            return fused.gemv_f32(x.contiguous(), w.detach())
        return F.linear(x, w)

    _step_key: tuple | None = None  # the weights the cached C step was built on
    _step = None

    def c_step(self):
        """The block's decode step as one C call (kernels/moe_cpu.py MoeStep: the eager block's torch
        ops between its kernel calls cost as much as the kernels at batch 1), or None where the
        library is off or a weight is of a kind it does not take. Rebuilt when a weight is replaced
        (packing, loading): the step holds the weights' addresses."""
        e = self.experts
        key = (self.gate.weight.data_ptr(), self.gate.weight.dtype, e.w13.data_ptr(), e.w2.data_ptr(), e.qexperts)
        if key != self._step_key:
            experts = ([(e.w13[i], e.w2[i]) for i in range(e.num_experts)] if e.qexperts is None
                       else [(w13.kernel, w2.kernel) for w13, w2 in e.qexperts])
            self._step = moe_cpu.MoeStep.build(self.gate.weight.detach(), experts, e.hidden, e.inter, self.top_k,
                                               self.renormalize)
            self._step_key = key
        return self._step

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        step = self.c_step() if x.shape[0] <= moe_cpu.MAX_M and x.dtype is torch.float32 else None
        if step is not None and step.supports(x):
            out = step(x)
        else:
            weights, ids = self.route(x)
            out = self.experts.forward(x, weights, ids)
        return tp_all_reduce(out) if self.experts.tp_size > 1 else out


def quantize_experts(model: nn.Module, mode: str) -> None:
    """--quantization int8|int4: each expert's gate/up and down packed like a linear layer's
    weight (gpu/models/quantization.py packs the linear layers), the full-precision stacks freed.
    fp8 leaves the experts in the model's dtype (its attention and shared linears are fp8)."""
    if mode in (None, "none", "auto", "fp8"):
        return
    before = after = 0
    for module in model.modules():
        if not isinstance(module, FusedExperts) or module.qexperts is not None:
            continue
        packed = []
        for e in range(module.num_experts):
            pair = (QuantizedWeight.from_float(module.w13[e], mode), QuantizedWeight.from_float(module.w2[e], mode))
            after += sum(q.nbytes() for q in pair)
            packed.append(pair)
        for name in ("w13", "w2"):
            w = getattr(module, name)
            before += w.numel() * w.element_size()
            setattr(module, name, nn.Parameter(torch.empty(0, dtype=w.dtype, device=w.device), requires_grad=False))
        module.qexperts = packed
    if before:
        logger.info("quantized expert weights to %s: %.1f MB -> %.1f MB", mode, before / 1e6, after / 1e6)
