"""Zero-filled KV cache tensors that cost nothing until a page is used.

``torch.zeros`` on CPU writes every byte: 11 s for the default 4 GiB cache on a loaded 2-core
box, before the server can answer. The cache must read as zeros (masked-out slots are multiplied
by zero weights, and 0 * NaN is NaN), but it need not be written: a fresh anonymous ``mmap`` is
made of the kernel's zero pages, mapped on first touch. So the cache costs time and resident
memory only for the blocks requests use. (``calloc`` was used before: it usually maps fresh
pages for such sizes, but when glibc hands back heap memory that was used before it zeroes it,
making the whole tensor resident: once in a full test run, 64 MiB of a 1 GiB cache.)
CUDA memory has no such pages; there ``torch.zeros`` is a fast device memset.
"""
from __future__ import annotations

import mmap

import numpy as np
import torch

ALIGNMENT = 64  # a cache line, as torch's own CPU allocator aligns (a mapping starts on a page)


def zeroed_tensor(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A contiguous all-zero tensor; on CPU its pages are not touched here."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    itemsize = torch.empty((), dtype=dtype).element_size()
    numel = int(np.prod(shape, dtype=np.int64))
    nbytes = numel * itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    # The array keeps the mapping alive (its buffer export), the tensor keeps the array.
    pages = np.frombuffer(mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS), dtype=np.uint8)
    return torch.from_numpy(pages).view(dtype).view(shape)
