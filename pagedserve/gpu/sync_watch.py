"""A CPU stand-in for ``torch.cuda.set_sync_debug_mode("error")``: it names every operation
that would make the host wait for a CUDA device. The sampler's rule (one device read per step,
gpu.sampler) is then tested where no GPU is: tests/gpu/test_sampler_sync.py and the GPU check's
dry run (loadtest/micro/gpu_check_sampler.py).

Why two levels: some waits are aten ops whatever the device (``item``, ``nonzero``, a boolean
mask index, ``unique``, ``repeat_interleave`` without ``output_size``), seen by a dispatch mode.
Others exist only on CUDA and look like ordinary ops on the CPU; the Python call still shows
them, so a function mode sees those:
- ``t[index_tensor] = 1.0``: torch makes the Python number a CPU tensor, and ``index_put_``
  copies it to the device with a blocking copy (the H200 run of the GPU check found three);
- an index given as a Python list: a CPU index tensor, copied to the device before use;
- ``torch.tensor(...)`` / ``tolist()``: a pageable copy in or out.
The seam gpu.sampling_host (``on_device``, ``to_device``, ``to_host``) is where such copies
belong; operations called from inside it are not reported (``to_host`` reads are counted by
the callers)."""
from __future__ import annotations

import sys

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import pagedserve.gpu.sampling_host as _host
# aten ops that read a device value back on any device.
_SYNCING_OPS = {"_local_scalar_dense", "nonzero", "_unique2", "unique_dim", "unique_consecutive", "masked_select",
                "equal", "is_nonzero"}
# The seam's own functions: what they do is the allowed way across.
_SEAM = {f.__code__ for f in (_host.on_device, _host.to_device, _host.to_host)}
_FRAMES = 12


def _inside_seam() -> bool:
    frame = sys._getframe(2)
    for _ in range(_FRAMES):
        if frame is None:
            return False
        if frame.f_code in _SEAM or frame.f_code.co_name == "to_host":  # a counting wrapper of it too
            return True
        frame = frame.f_back
    return False


def _advanced(index) -> bool:
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(p, (torch.Tensor, list)) for p in parts)


def _host_list(index) -> bool:
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(p, list) for p in parts)


class _Ops(TorchDispatchMode):
    def __init__(self, events: list[str]) -> None:
        super().__init__()
        self.events = events

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        bool_index = name in ("index", "index_put", "index_put_") and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1])
        unsized = name == "repeat_interleave" and func._overloadname == "Tensor" and kwargs.get("output_size") is None
        if (name in _SYNCING_OPS or bool_index or unsized) and not _inside_seam():
            self.events.append(name)
        return func(*args, **kwargs)


class _Calls(TorchFunctionMode):
    def __init__(self, events: list[str]) -> None:
        super().__init__()
        self.events = events

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        event = None
        if func is torch.Tensor.__setitem__:
            index, value = args[1], args[2]
            if _advanced(index) and isinstance(value, (bool, int, float)):
                event = "index_put from a host scalar"
            elif _host_list(index):
                event = "index from a host list"
        elif func is torch.Tensor.__getitem__ and _host_list(args[1]):
            event = "index from a host list"
        elif func in (torch.tensor, torch.as_tensor, torch.Tensor.tolist, torch.Tensor.item):
            event = getattr(func, "__name__", str(func))
        if event is not None and not _inside_seam():
            self.events.append(event)
        return func(*args, **kwargs)


class SyncWatch:
    """``with SyncWatch() as events:`` runs the block and lists, in order, each operation that
    would have waited for a CUDA device (outside gpu.sampling_host)."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self._modes = (_Calls(self.events), _Ops(self.events))

    def __enter__(self) -> list[str]:
        for mode in self._modes:
            mode.__enter__()
        return self.events

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
