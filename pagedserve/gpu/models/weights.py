"""Per-tensor weight loading into a built model, with bookkeeping of what is still missing.

A model maps each checkpoint tensor name to (parameter name, shard id) through
``map_weight_name``; a name mapping to None is ignored (e.g. rotary buffers). The parameter's
own ``weight_loader`` cuts and copies. ``missing()`` lists parameters (or fused parts) that never
arrived, so a truncated checkpoint fails loudly instead of running on uninitialised memory.
"""
from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Iterable

import torch

from pagedserve.contracts.errors import ModelLoadError


@contextlib.contextmanager
def _one_cpu_thread():
    """Copy weights on one CPU thread. Each copy is memory-bound and faults in fresh pages; on more
    threads every copy is a parallel region that waits for all its threads, and on a busy 2-core
    box one of them is often descheduled: the default model's 272 copies took 3.1 s on 2 threads,
    0.5 s on 1. (Copies to a GPU do not use these threads.)"""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


class WeightTracker:
    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.params = dict(model.named_parameters())
        self.loaded: dict[str, set] = defaultdict(set)

    # checkpoint tensors read by nothing here (an FP8 checkpoint's static activation scales)
    ignored: tuple[str, ...] = ()

    def load(self, name: str, tensor: torch.Tensor, source: str = "checkpoint") -> None:
        if self.ignored and name.endswith(self.ignored):
            return
        mapped = self.model.map_weight_name(name)
        if mapped is None:
            return
        for param_name, shard_id, part in mapped:
            param = self.params.get(param_name)
            if param is None:
                raise ModelLoadError(f"{source}: tensor {name!r} has no matching parameter "
                                     f"({param_name!r}) in {type(self.model).__name__}")
            piece = tensor if part is None else part(tensor)
            try:
                param.weight_loader(param, piece, shard_id)
            except ModelLoadError as e:
                raise ModelLoadError(f"{source}: tensor {name!r} -> {param_name}: {e}") from None
            self.loaded[param_name].add(shard_id)

    def load_all(self, weights: Iterable[tuple[str, torch.Tensor]], source: str = "checkpoint") -> None:
        with _one_cpu_thread():
            for name, tensor in weights:
                self.load(name, tensor, source)

    def missing(self) -> list[str]:
        out = []
        for name, param in self.params.items():
            if getattr(param, "optional", False):  # optional: an FP8 checkpoint's weight_scale (gpu/models/fp8.py)
                continue
            # optional: only fused parameters (qkv, gate_up) are loaded shard by shard
            want = set(param.shard_ids) if getattr(param, "shard_ids", None) else {None}
            got = self.loaded.get(name, set())
            if None in got:  # loaded whole
                continue
            for shard in sorted(want - got, key=str):
                out.append(name if shard is None else f"{name} (part {shard})")
        return out

    def check_complete(self, source: str) -> None:
        missing = self.missing()
        if missing:
            shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
            raise ModelLoadError(f"{source}: missing tensor(s) for {shown}")
