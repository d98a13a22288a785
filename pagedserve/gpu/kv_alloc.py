"""Zero-filled KV cache tensors, resident from the moment they are allocated.

The cache is the memory budget the user set (``--kv-cache-memory``), so it is committed at start,
as vLLM and llama.cpp do: an over-committed machine fails at start-up, not mid-service, and a
worker's resident memory does not creep. (Until issue 35 the pages came on first use: the prefix
cache hands out every free block before it evicts a cached one, so the worker grew by one block,
0.35 MiB on the default model, each time the free queue first reached a block, up to the whole
budget after a few thousand requests, and the soak read it as a leak.)

``torch.zeros`` writes every byte from one thread: 11 s for the default 4 GiB cache on a loaded
2-core box. A fresh anonymous ``mmap`` populated by the kernel (``MADV_POPULATE_WRITE``, Linux
5.14+; else one write per page) reads as zeros and takes ~0.5 s a GiB here. The cache must read
as zeros: masked-out slots are multiplied by zero weights, and 0 * NaN is NaN. (2 MiB pages were
tried: populating them took 7x as long, compaction included.)
CUDA memory has no such pages; there ``torch.zeros`` is a fast device memset.
"""
from __future__ import annotations

import mmap

import numpy as np
import torch

ALIGNMENT = 64  # a cache line, as torch's own CPU allocator aligns (a mapping starts on a page)
_MADV_POPULATE_WRITE = 23  # <linux/mman.h>; Python's mmap module names it from 3.13 only
_PAGE = mmap.PAGESIZE


def zeroed_tensor(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A contiguous all-zero tensor whose pages are all resident."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    itemsize = torch.empty((), dtype=dtype).element_size()
    numel = int(np.prod(shape, dtype=np.int64))
    nbytes = numel * itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    # The array keeps the mapping alive (its buffer export), the tensor keeps the array.
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    pages = np.frombuffer(mapping, dtype=np.uint8)
    try:
        mapping.madvise(_MADV_POPULATE_WRITE)
    except OSError:  # an older kernel: fault each page in by writing the zero it holds
        pages[::_PAGE] = 0
    return torch.from_numpy(pages).view(dtype).view(shape)
