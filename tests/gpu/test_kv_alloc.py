"""KV cache memory: all zeros, yet not written at allocation (pages come on first use)."""
from __future__ import annotations

import ctypes
import ctypes.util

import pytest
import torch

from gpu.kv_alloc import ALIGNMENT, zeroed_tensor


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
def test_large_cache_is_not_touched_at_allocation():
    """torch.zeros would write (and make resident) every byte; these pages stay untouched until
    used: of the 1 GiB allocated, at most the partial first and last pages of each tensor are resident."""
    caches = [zeroed_tensor((2048, 16, 8, 64), torch.float32, torch.device("cpu")) for _ in range(16)]
    assert sum(c.numel() * 4 for c in caches) == 1 << 30
    resident = sum(_resident_bytes(c) for c in caches)
    assert resident <= 16 * 2 * 4096, f"allocating the cache made {resident >> 10} KiB resident"
    caches[0][100].fill_(1.0)  # a used block becomes resident, the rest stay zero
    assert _resident_bytes(caches[0]) >= 16 * 8 * 64 * 4
    assert float(caches[0][100].sum()) == 16 * 8 * 64
    assert torch.count_nonzero(caches[0][:100]) == 0
