"""Where host values meet the sampler's device tensors, so every sampling module moves data the
same way: host data enters only through ``on_device`` (on the logits' device, so CUDA ops never
mix a stray CPU tensor), rows are picked without a copy when all are kept, and a step's results
leave in one device-to-host copy (``fetch_to_host``)."""
from __future__ import annotations

import torch
from torch import Tensor


def on_device(like: Tensor, data, dtype: torch.dtype | None = None) -> Tensor:
    """Host values as a tensor on ``like``'s device: the one place host data enters the sampler."""
    return torch.tensor(data, dtype=dtype, device=like.device)


def fetch_to_host(ints: list[Tensor], floats: list[Tensor]) -> tuple[list[list[int]], list[list[float]]]:
    """Everything a step returns, flattened, in ONE device-to-host copy.

    float64 holds every float32 logprob and every token id (< 2**53) exactly."""
    parts = [t.reshape(-1) for t in ints + floats]
    if not parts:
        return [], []
    flat: list[float] = torch.cat([t.to(torch.float64) for t in parts]).tolist()
    out, at = [], 0
    for t in parts:
        out.append(flat[at:at + t.numel()])
        at += t.numel()
    return [[int(x) for x in v] for v in out[:len(ints)]], out[len(ints):]


def select_rows(t: Tensor, rows: list[int], total: int) -> Tensor:
    """Rows of t; the tensor itself when every row is selected (no copy)."""
    return t if len(rows) == total else t[on_device(t, rows)]
