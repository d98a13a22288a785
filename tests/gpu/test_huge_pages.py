"""Weights collapsed onto 2 MiB pages after loading (gpu/huge_pages.py): exactly the memory the
load added, never what was mapped before or after it (the KV cache must stay untouched)."""
from __future__ import annotations

import mmap
import os

import pytest

from pagedserve.gpu import huge_pages
from pagedserve.gpu.huge_pages import HUGE_PAGE, _added, anonymous_ranges, loaded_onto_huge_pages


def _thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            text = f.read()
    except OSError:
        return "none"
    return text[text.find("[") + 1:text.find("]")] if "[" in text else "none"


def _thp_allowed() -> bool:
    return _thp_mode() in ("always", "madvise")


def _kernel_at_least(major: int, minor: int) -> bool:
    try:
        got = tuple(int(x) for x in os.uname().release.split("-")[0].split(".")[:2])
    except ValueError:
        return False
    return got >= (major, minor)


needs_thp = pytest.mark.skipif(not _thp_allowed() or not _kernel_at_least(6, 1),
                               reason="no transparent huge pages or no MADV_COLLAPSE here")


def _huge_bytes_in(lo: int, hi: int) -> int:
    """AnonHugePages of the mappings overlapping [lo, hi)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                a, b = (int(x, 16) for x in head.split("-"))
                inside = a < hi and lo < b
            elif inside and head == "AnonHugePages:":
                total += int(line.split()[1]) * 1024
    return total


def test_added_is_the_set_difference_of_ranges():
    before = [(100, 200), (300, 400)]
    after = [(50, 250), (300, 450), (500, 600)]
    assert _added(after, before) == [(50, 100), (200, 250), (400, 450), (500, 600)]
    assert _added(before, before) == []


@needs_thp
def test_memory_mapped_inside_the_block_is_collapsed_and_memory_outside_is_not():
    outside = mmap.mmap(-1, 8 * HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    outside.write(b"x" * (8 * HUGE_PAGE))  # touched, but mapped before the load
    with loaded_onto_huge_pages("test"):
        inside = mmap.mmap(-1, 8 * HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        inside.write(b"y" * (8 * HUGE_PAGE))
    later = mmap.mmap(-1, 8 * HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # the "KV cache"
    addr = {name: huge_pages.ctypes.addressof(huge_pages.ctypes.c_char.from_buffer(m))
            for name, m in (("inside", inside), ("outside", outside), ("later", later))}
    size = 8 * HUGE_PAGE
    if _huge_bytes_in(addr["inside"], addr["inside"] + size) == 0 and \
            huge_pages.collapse([(addr["inside"], addr["inside"] + size)]) == 0:
        pytest.skip("the kernel refused to collapse (no free huge pages?)")
    assert _huge_bytes_in(addr["inside"], addr["inside"] + size) >= 6 * HUGE_PAGE  # all whole pages inside
    assert inside[:1] == b"y" and inside[-1:] == b"y"  # same contents, same addresses
    assert _huge_bytes_in(addr["later"], addr["later"] + size) == 0  # untouched: nothing resident at all
    if _thp_mode() == "madvise":  # ("always" gives touched memory huge pages without asking)
        assert _huge_bytes_in(addr["outside"], addr["outside"] + size) == 0
    rss_before = _rss()
    del later  # (untouched: never resident)
    assert _rss() <= rss_before


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1])


def test_anonymous_ranges_include_a_new_mapping():
    m = mmap.mmap(-1, HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    a = huge_pages.ctypes.addressof(huge_pages.ctypes.c_char.from_buffer(m))
    assert any(lo <= a < hi for lo, hi in anonymous_ranges())
