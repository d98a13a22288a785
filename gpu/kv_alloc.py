"""Zero-filled KV cache tensors that cost nothing until a page is used.

``torch.zeros`` on CPU writes every byte: 11 s for the default 4 GiB cache on a loaded 2-core
box, before the server can answer. The cache must read as zeros (masked-out slots are multiplied
by zero weights, and 0 * NaN is NaN), but it need not be written: memory from ``calloc`` (numpy's
``zeros``) that is large enough to come from ``mmap`` is made of the kernel's zero pages, mapped
on first touch. So the cache costs time and resident memory only for the blocks requests use.
CUDA memory has no such pages; there ``torch.zeros`` is a fast device memset.
"""
from __future__ import annotations

import numpy as np
import torch

ALIGNMENT = 64  # a cache line, as torch's own CPU allocator aligns


def zeroed_tensor(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A contiguous all-zero tensor; on CPU its pages are not touched here."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    itemsize = torch.empty((), dtype=dtype).element_size()
    numel = int(np.prod(shape, dtype=np.int64))
    nbytes = numel * itemsize
    raw = torch.from_numpy(np.zeros(nbytes + ALIGNMENT, dtype=np.uint8))
    skip = -raw.data_ptr() % ALIGNMENT  # calloc's mmap chunks start 16 bytes into a page
    return raw[skip:skip + nbytes].view(dtype).view(shape)
