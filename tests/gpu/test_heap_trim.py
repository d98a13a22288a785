"""The worker gives its C heap's free pages back (gpu/heap_trim.py, issue 35): when trims happen,
and that a trim really lowers RSS after the kind of fragmentation variable-size steps leave."""
from __future__ import annotations

import ctypes

import pytest

from pagedserve.gpu.heap_trim import HeapTrimmer, glibc_trim, heap_bytes


def test_trims_at_most_once_per_interval_while_steps_run_and_once_when_idle():
    now = [0.0]
    calls: list[float] = []
    heap = HeapTrimmer(interval_s=5.0, clock=lambda: now[0], trim=lambda: calls.append(now[0]) or True)
    for t in (1.0, 2.0, 4.9):
        now[0] = t
        heap.after_step()
    assert calls == [] and heap.dirty
    now[0] = 5.0
    heap.after_step()
    assert calls == [5.0] and not heap.dirty
    heap.trim_if_dirty()  # nothing ran since: no trim
    assert calls == [5.0]
    now[0] = 6.0
    heap.after_step()  # inside the interval: left for the idle trim
    heap.trim_if_dirty()
    assert calls == [5.0, 6.0] and heap.trims == 2


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


@pytest.mark.skipif(heap_bytes() is None, reason="the C library is not glibc >= 2.33 (no malloc_trim/mallinfo2)")
def test_a_trim_gives_back_the_free_pages_inside_the_heap():
    """Chunks below the mmap threshold, freed except every 16th: the heap cannot shrink from the
    top (live chunks pin it), only a trim returns the pages between them."""
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    size, count = 96 * 1024, 2048  # 192 MiB
    ptrs = [libc.malloc(size) for _ in range(count)]
    try:
        for p in ptrs:
            ctypes.memset(p, 1, size)  # resident
        for i, p in enumerate(ptrs):
            if i % 16:
                libc.free(p)
        before = _rss_kib()
        assert glibc_trim()
        released_mib = (before - _rss_kib()) / 1024
        assert released_mib > 100, released_mib  # ~180 MiB were free inside the heap
    finally:
        for i, p in enumerate(ptrs):
            if i % 16 == 0:
                libc.free(p)
