"""Sparse mixture-of-experts MLP (Qwen3-MoE, Mixtral): a router picks ``top_k`` experts per token,
each a SiLU-gated MLP, and the token's output is their weighted sum.

Why this shape: a token reads only its experts' weights, which is why CPU users run a 30B-A3B
model at the speed of a 3B one. The experts' weights are stacked (``w13`` [E, 2I, H] gate and up,
``w2`` [E, H, I] down) and applied grouped by expert: the (token, expert) pairs are sorted by
expert, each active expert runs one matmul over its tokens, and the weighted results are summed
back per token with one ``index_add_``. The Python loop is over active experts (at most
min(E, tokens x top_k)), never over tokens.

Tensor parallelism shards every expert's intermediate dimension, as the dense MLP is sharded:
gate/up by output rows, down by input columns; the partial sums are all-reduced once per layer.
The router is replicated and computed in fp32 (as transformers does), so every rank routes alike.

Checkpoint names (Hugging Face): Qwen3-MoE ``mlp.experts.E.{gate,up,down}_proj.weight`` and
``mlp.gate.weight``; Mixtral ``block_sparse_moe.experts.E.{w1,w3,w2}.weight`` and
``block_sparse_moe.gate.weight`` (w1 gate, w3 up, w2 down). GGUF stores each projection of all
experts as one 3D tensor (``blk.N.ffn_{gate,up,down}_exps``), loaded expert by expert.

Quantized experts (GGUF q8_0 / q4_x kept packed, or ``--quantization int8|int4``): each expert
holds two packed weights (gate and up rows stacked, and down) computed by the CPU kernel of
kernels/qgemm.py, and the full-precision stacks are freed.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from contracts.errors import ModelLoadError
from gpu.models.quantization import QuantizedWeight, SelfQuantizing, layout_for
from gpu.models.layers import _copy_checked, _new_param, default_weight_loader
from gpu.parallel_state import divide, get_tp_rank, get_tp_size, tp_all_reduce

# checkpoint projection name -> (stacked parameter, part): part 0 gate, 1 up, 2 down
EXPERT_PROJECTIONS = {"gate_proj": 0, "up_proj": 1, "down_proj": 2, "w1": 0, "w3": 1, "w2": 2}


def num_experts(cfg: dict) -> int:
    """Qwen3-MoE's config says ``num_experts``; Mixtral's (and transformers 5's saved Qwen3-MoE
    configs) ``num_local_experts``."""
    return int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)


def is_sparse_layer(cfg: dict, layer_idx: int, architecture: str) -> bool:
    """Whether a decoder layer's MLP is the expert mixture (transformers' rule per family)."""
    if num_experts(cfg) <= 0:
        return False
    if architecture == "MixtralForCausalLM":
        return True
    step = int(cfg.get("decoder_sparse_step") or 1)
    return layer_idx not in (cfg.get("mlp_only_layers") or []) and (layer_idx + 1) % step == 0


class SparseMoeBlock(nn.Module, SelfQuantizing):
    def __init__(self, cfg: dict, renormalize: bool):
        super().__init__()
        hidden = cfg["hidden_size"]
        self.num_experts = num_experts(cfg)
        self.top_k = int(cfg["num_experts_per_tok"])
        if not 0 < self.top_k <= self.num_experts:
            raise ModelLoadError(f"num_experts_per_tok={self.top_k} with {self.num_experts} experts")
        self.renormalize = renormalize
        inter = int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"])
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.inter = divide(inter, self.tp_size, "expert intermediate size")
        self.hidden = hidden
        E = self.num_experts
        self.gate = nn.Module()  # the router; a submodule so its name matches the checkpoint's
        self.gate.weight = _new_param(E, hidden, loader=default_weight_loader)
        ids = tuple((e, part) for e in range(E) for part in (0, 1))
        self.w13 = _new_param(E, 2 * self.inter, hidden, loader=self._load_w13, shard_ids=ids)
        self.w2 = _new_param(E, hidden, self.inter, loader=self._load_w2, shard_ids=tuple(range(E)))

    # ------------------------------------------------------------------ loading

    def _load_w13(self, param: nn.Parameter, loaded: torch.Tensor, shard_id) -> None:
        expert, part = shard_id
        n = self.inter
        if loaded.dim() != 2 or loaded.shape != (n * self.tp_size, self.hidden):
            raise ModelLoadError(f"expert {expert} {'gate' if part == 0 else 'up'} projection: checkpoint "
                                 f"has {tuple(loaded.shape)}, model expects {(n * self.tp_size, self.hidden)}")
        _copy_checked(param.data[expert].narrow(0, part * n, n), loaded.narrow(0, self.tp_rank * n, n),
                      f"expert {expert}")

    def _load_w2(self, param: nn.Parameter, loaded: torch.Tensor, shard_id) -> None:
        n = self.inter
        if loaded.dim() != 2 or loaded.shape != (self.hidden, n * self.tp_size):
            raise ModelLoadError(f"expert {shard_id} down projection: checkpoint has {tuple(loaded.shape)}, "
                                 f"model expects {(self.hidden, n * self.tp_size)}")
        _copy_checked(param.data[shard_id], loaded.narrow(1, self.tp_rank * n, n), f"expert {shard_id}")

    def map_expert_weight(self, prefix: str, expert: int, projection: str) -> tuple[str, object]:
        """(parameter name, shard id) of one checkpoint expert tensor."""
        if not 0 <= expert < self.num_experts:
            raise ModelLoadError(f"checkpoint has expert {expert}; the config says {self.num_experts} experts")
        part = EXPERT_PROJECTIONS[projection]
        if part == 2:
            return f"{prefix}.w2", expert
        return f"{prefix}.w13", (expert, part)

    def map_stacked_weight(self, prefix: str, projection: str) -> list:
        """The (parameter, shard id, cut) triples of a 3D all-experts tensor (GGUF's layout)."""
        def cut(t: torch.Tensor, e: int) -> torch.Tensor:
            if t.dim() != 3 or t.shape[0] != self.num_experts:
                raise ModelLoadError(f"stacked {projection} of shape {tuple(t.shape)}: expected "
                                     f"{self.num_experts} experts first")
            return t[e]
        return [(*self.map_expert_weight(prefix, e, projection), lambda t, e=e: cut(t, e))
                for e in range(self.num_experts)]

    # ------------------------------------------------------------------ packed experts

    packed: list | None = None  # per expert [gate_up, down] QuantizedWeight once quantized

    def _packed_slots(self) -> list:
        if self.packed is None:
            self.packed = [[None, None, None] for _ in range(self.num_experts)]  # gate, up, down parts
        return self.packed

    def load_packed_part(self, expert: int, part: int, layout: str, tensors: tuple[torch.Tensor, ...]) -> None:
        """One expert's gate (0), up (1) or down (2) weight, already in a packed ``layout`` (the full
        checkpoint rows and columns): this rank's rows (gate, up) or columns (down) are kept."""
        n, tp, r = self.inter, self.tp_size, self.tp_rank
        rows, cols = (n * tp, self.hidden) if part < 2 else (self.hidden, n * tp)
        from kernels import qgemm

        want = qgemm.packed_shapes(layout, rows, cols)
        if [tuple(t.shape) for t in tensors] != [tuple(w) for w in want]:
            raise ModelLoadError(f"expert {expert} part {part}: packed shapes {[tuple(t.shape) for t in tensors]}, "
                                 f"model expects {want}")
        if tp > 1:
            if part < 2:
                tensors = tuple(t.narrow(0, r * n, n).contiguous() for t in tensors)
            else:
                if n % qgemm.GROUP:
                    raise ModelLoadError(f"packed experts under tensor parallelism need the per-rank expert size "
                                         f"({n}) to be a multiple of {qgemm.GROUP}")
                tensors = tuple(t.narrow(1, r * t.shape[1] // tp, t.shape[1] // tp).contiguous() for t in tensors)
        slots = self._packed_slots()[expert]
        slots[part] = (layout, tensors)
        if part < 2 and slots[1 - part] is not None:
            (la, ga), (lb, ub) = slots[0], slots[1]
            if la != lb:
                raise ModelLoadError(f"expert {expert}: gate ({la}) and up ({lb}) packed differently")
            slots[0] = QuantizedWeight(la, tuple(torch.cat([g, u]) for g, u in zip(ga, ub)), None, self.w13.dtype)
            slots[1] = "merged"
        elif part == 2:
            slots[2] = QuantizedWeight(layout, tensors, None, self.w2.dtype)

    def finish_packed(self) -> None:
        """After loading: every expert packed (then the full-precision stacks go), or none."""
        if self.packed is None:
            return
        if any(s[1] != "merged" or not isinstance(s[2], QuantizedWeight) for s in self.packed):
            raise ModelLoadError("some experts of a layer arrived packed and others did not")
        self.packed = [(s[0], s[2]) for s in self.packed]
        self._drop_dense()

    def quantize(self, mode: str) -> tuple[int, int]:
        """--quantization int8|int4 on full-precision experts: (bytes before, bytes after)."""
        if self.packed is not None:
            return 0, 0
        packed, before, after = [], 0, 0
        for e in range(self.num_experts):
            gu = QuantizedWeight.from_float(self.w13[e], layout_for(mode, self.hidden))
            down = QuantizedWeight.from_float(self.w2[e], layout_for(mode, self.inter))
            packed.append((gu, down))
            after += gu.nbytes() + down.nbytes()
        before = (self.w13.numel() + self.w2.numel()) * self.w13.element_size()
        self.packed = packed
        self._drop_dense()
        return before, after

    def _drop_dense(self) -> None:
        for name in ("w13", "w2"):
            old = getattr(self, name)
            p = nn.Parameter(torch.empty(0, dtype=old.dtype, device=old.device), requires_grad=False)
            p.weight_loader, p.shard_ids = old.weight_loader, old.shard_ids
            setattr(self, name, p)

    # ------------------------------------------------------------------ forward

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] in x's dtype, expert ids [T, k]): the router's logits in x's dtype, their
        softmax in fp32, the top k, renormalised to sum 1 when the family does (as transformers)."""
        probs = torch.softmax(F.linear(x, self.gate.weight).float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        T = x.shape[0]
        weights, ids = self.route(x)
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        tokens = order // self.top_k
        pair_weights = weights.reshape(-1)[order].unsqueeze(1)
        xs = x.index_select(0, tokens)
        out = torch.empty((T * self.top_k, self.hidden), dtype=x.dtype, device=x.device)
        start = 0
        packed = self.packed
        for expert, n in enumerate(counts):
            if n == 0:
                continue
            end = start + n
            if packed is None:
                h = F.linear(xs[start:end], self.w13[expert])
                gate, up = h.split(self.inter, dim=-1)
                out[start:end] = F.linear(F.silu(gate) * up, self.w2[expert])
            else:
                gate_up, down = packed[expert]
                gate, up = gate_up.linear(xs[start:end]).split(self.inter, dim=-1)
                out[start:end] = down.linear((F.silu(gate) * up).contiguous())
            start = end
        y = torch.zeros_like(x).index_add_(0, tokens, out.mul_(pair_weights))
        if self.tp_size > 1:
            y = tp_all_reduce(y)
        return y
