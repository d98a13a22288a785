"""Where host values meet the sampler's device tensors, so every sampling module moves data the
same way: host data enters only through ``on_device`` / ``to_device`` (on the logits' device, so
CUDA ops never mix a stray CPU tensor), rows are picked without a copy when all are kept, and
device values leave only through ``to_host``, once per common step (``fetch_to_host``).

Why: on CUDA each host read (``tolist``, ``item``, ``bool(t)``) waits for every queued kernel,
and so does a copy from pageable host memory to the device (torch syncs the stream after it);
each wait leaves the GPU idle while Python launches the next kernels. Host data therefore goes
in from pinned memory without blocking, and results come out in one copy."""
from __future__ import annotations

import torch
from torch import Tensor


def to_device(t: Tensor, device: torch.device) -> Tensor:
    """A host tensor on ``device``: on CUDA from pinned memory, not blocking (stream-ordered, so
    later kernels see it; the caching host allocator keeps the block until the copy is done)."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def on_device(like: Tensor | torch.device, data, dtype: torch.dtype | None = None) -> Tensor:
    """Host values as a tensor on ``like``'s device (or on ``like``, a device): the one place
    host data enters the sampler."""
    device = like if isinstance(like, torch.device) else like.device
    if device.type != "cuda":
        return torch.tensor(data, dtype=dtype, device=device)
    return torch.tensor(data, dtype=dtype, device="cpu", pin_memory=True).to(device, non_blocking=True)


def to_host(t: Tensor):
    """The sampler's one way to read device values (``tolist``): a device sync on CUDA, so a
    common step calls it once (tests/gpu/test_sampler_sync.py counts the calls)."""
    return t.tolist()


def fetch_to_host(ints: list[Tensor], floats: list[Tensor]) -> tuple[list[list[int]], list[list[float]]]:
    """Everything a step returns, flattened, in ONE device-to-host copy.

    float64 holds every float32 logprob and every token id (< 2**53) exactly; without floats
    the ints travel as int64."""
    parts = [t.reshape(-1) for t in ints + floats]
    if not parts:
        return [], []
    wide = [t.to(torch.float64) if floats else t.long() for t in parts]
    flat = to_host(torch.cat(wide) if len(wide) > 1 else wide[0])
    out, at = [], 0
    for t in parts:
        out.append(flat[at:at + t.numel()])
        at += t.numel()
    host_ints = [[int(x) for x in v] for v in out[:len(ints)]] if floats else out[:len(ints)]
    return host_ints, out[len(ints):]


def select_rows(t: Tensor, rows: list[int], total: int) -> Tensor:
    """Rows of t; the tensor itself when every row is selected (no copy)."""
    return t if len(rows) == total else t[on_device(t, rows)]


def spread_rows(flags: Tensor | None, rows: Tensor, total: int) -> Tensor | None:
    """Flags of a subset ``rows`` of ``total`` rows as flags of all of them (True elsewhere)."""
    if flags is None:
        return None
    out = torch.ones(total, dtype=torch.bool, device=flags.device)
    out[rows] = flags
    return out
