"""KV cache memory: all zeros and resident from allocation (its size is the budget the user set)."""
from __future__ import annotations

import ctypes
import ctypes.util

import pytest
import torch

from pagedserve.gpu.kv_alloc import ALIGNMENT, zeroed_tensor


def _resident_bytes(t: torch.Tensor) -> int:
    """Bytes of ``t``'s pages that are resident (mincore): the tensor's own memory, whatever other
    threads of this process allocate meanwhile (process RSS counted those: a flaky check)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    page = 4096
    start = t.data_ptr() // page * page
    length = t.data_ptr() + t.numel() * t.element_size() - start
    pages = -(-length // page)
    vec = (ctypes.c_ubyte * pages)()
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vec) == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec) * page


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_zeroed_tensor_is_zero_contiguous_aligned_and_writable(dtype):
    t = zeroed_tensor((7, 16, 3, 8), dtype, torch.device("cpu"))
    assert t.shape == (7, 16, 3, 8) and t.dtype == dtype and t.is_contiguous()
    assert t.data_ptr() % ALIGNMENT == 0
    assert torch.count_nonzero(t) == 0
    t[3, 5] = 1.5
    assert float(t.sum()) == 1.5 * 3 * 8
    assert torch.count_nonzero(t[:3]) == 0 and torch.count_nonzero(t[4:]) == 0


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="needs Linux mincore")
def test_the_cache_is_resident_from_allocation():
    """Issue 35: pages that came on first use made the worker grow by one block's bytes each time the
    free-block queue first reached a block (0.35 MiB on the default model), so its memory crept up
    to the configured budget over thousands of requests and looked like a leak (and an over-committed
    machine failed mid-service, not at start). The budget is committed when it is allocated."""
    caches = [zeroed_tensor((512, 16, 8, 64), torch.float32, torch.device("cpu")) for _ in range(4)]
    size = sum(c.numel() * 4 for c in caches)
    assert size == 64 << 20
    assert sum(_resident_bytes(c) for c in caches) == size
    assert all(torch.count_nonzero(c) == 0 for c in caches)
    caches[0][100].fill_(1.0)
    assert float(caches[0][100].sum()) == 16 * 8 * 64
    assert torch.count_nonzero(caches[0][:100]) == 0
