"""KV cache memory: all zeros, yet not written at allocation (pages come on first use)."""
from __future__ import annotations

import pytest
import torch

from gpu.kv_alloc import ALIGNMENT, zeroed_tensor


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_zeroed_tensor_is_zero_contiguous_aligned_and_writable(dtype):
    t = zeroed_tensor((7, 16, 3, 8), dtype, torch.device("cpu"))
    assert t.shape == (7, 16, 3, 8) and t.dtype == dtype and t.is_contiguous()
    assert t.data_ptr() % ALIGNMENT == 0
    assert torch.count_nonzero(t) == 0
    t[3, 5] = 1.5
    assert float(t.sum()) == 1.5 * 3 * 8
    assert torch.count_nonzero(t[:3]) == 0 and torch.count_nonzero(t[4:]) == 0


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/statm"), reason="needs Linux /proc")
def test_large_cache_is_not_touched_at_allocation():
    """torch.zeros would write (and make resident) every byte; these pages stay untouched until
    used. Resident memory of this process grows by far less than the 1 GiB allocated."""
    before = _rss_bytes()
    caches = [zeroed_tensor((2048, 16, 8, 64), torch.float32, torch.device("cpu")) for _ in range(16)]
    grown = _rss_bytes() - before
    assert sum(c.numel() * 4 for c in caches) == 1 << 30
    assert grown < 64 << 20, f"allocating the cache made {grown >> 20} MiB resident"
    caches[0][100].fill_(1.0)  # a used block becomes resident, the rest stay zero
    assert float(caches[0][100].sum()) == 16 * 8 * 64
    assert torch.count_nonzero(caches[0][:100]) == 0
