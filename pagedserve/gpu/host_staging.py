"""A step's index arrays sent to the GPU in one non-blocking copy from pinned memory.

Why: ``ModelRunner.prepare`` built five or six small tensors a step (input ids, positions, query
starts, sequence lengths, block tables, slots) and moved each with a synchronous copy from
pageable memory: each one a driver call and a wait. Here they are written side by side into
one pinned host buffer and copied in one ``non_blocking`` transfer; the device tensors are views
into the copy. Two buffers alternate, each guarded by a CUDA event recorded after its copy, so a
step never overwrites bytes an earlier copy is still reading.

Off CUDA nothing is staged (``stage`` builds the tensors where they are used); ``force`` stages
anyway through ordinary memory, which is how the packing is tested on CPU.
"""
from __future__ import annotations

import numpy as np
import torch

_ALIGN = 8  # every array starts on an 8-byte boundary (int64 views need it)
_NUMPY = {torch.int32: np.int32, torch.int64: np.int64}


class HostStaging:
    def __init__(self, device: torch.device, force: bool = False):
        self.device = torch.device(device)
        self.enabled = self.device.type == "cuda" or force
        self._pinned = self.device.type == "cuda"
        self._buffers: list[torch.Tensor | None] = [None, None]
        self._events: list = [None, None]
        self._turn = 0

    def stage(self, arrays: list[tuple[object, torch.dtype, tuple[int, ...]]]) -> list[torch.Tensor]:
        """``arrays``: (values: a flat sequence or numpy array, dtype int32 | int64, shape) each;
        returns the tensors on the device, in order."""
        if not self.enabled:
            return [torch.as_tensor(np.asarray(v, dtype=_NUMPY[dt]).reshape(shape)).to(self.device)
                    for v, dt, shape in arrays]
        offsets, total = [], 0
        for v, dt, shape in arrays:
            offsets.append(total)
            nbytes = int(np.prod(shape)) * torch.tensor([], dtype=dt).element_size()
            total += -(-nbytes // _ALIGN) * _ALIGN
        host = self._buffer(max(total, _ALIGN))
        raw = host.numpy()
        for (v, dt, shape), off in zip(arrays, offsets):
            n = int(np.prod(shape))
            raw[off:off + n * np.dtype(_NUMPY[dt]).itemsize].view(_NUMPY[dt])[:] = np.asarray(v).reshape(-1)
        # (forced on CPU, .to() would alias the reused buffer: copy it)
        device_buf = host[:total].to(self.device, non_blocking=True) if self._pinned else host[:total].clone()
        if self._pinned:
            event = torch.cuda.Event()
            event.record()
            self._events[self._turn] = event
        self._turn ^= 1
        out = []
        for (v, dt, shape), off in zip(arrays, offsets):
            n = int(np.prod(shape))
            size = torch.tensor([], dtype=dt).element_size()
            out.append(device_buf[off:off + n * size].view(dt).view(shape))
        return out

    def _buffer(self, nbytes: int) -> torch.Tensor:
        """This turn's host buffer, at least ``nbytes``, once the copy that last read it is done."""
        event = self._events[self._turn]
        if event is not None:
            event.synchronize()
        buf = self._buffers[self._turn]
        if buf is None or buf.numel() < nbytes:
            size = max(nbytes, 2 * (buf.numel() if buf is not None else 4096))
            buf = torch.empty(size, dtype=torch.uint8, pin_memory=self._pinned)
            self._buffers[self._turn] = buf
        return buf
