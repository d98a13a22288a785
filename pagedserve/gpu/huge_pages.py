"""The weights on transparent huge pages (2 MiB) once they are loaded.

Why: a decode step streams every weight once, and with 4 KiB pages it misses the TLB on each page
it reads. The default model's single-stream decode ran 78-80 tok/s with its weights on 4 KiB pages
and 88-90 with them on huge pages (unquantized, interleaved runs; loadtest/PERF.md, "huge pages").
Linux here grants huge pages only where asked (transparent_hugepage/enabled = madvise), and the
weights are hundreds of tensors from torch's allocator, so after loading, every anonymous memory
range that the load added is collapsed in place (MADV_COLLAPSE, Linux 6.1+): same addresses, no
copy held by us, nothing else to rebind. Memory mapped before the load (the interpreter, torch) and
after it (the KV cache, whose untouched pages must stay untouched) is left alone. Where the kernel
refuses, pages stay as they were and a debug line says so.
"""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import logging
import threading

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE, _MADV_COLLAPSE = 14, 25


@functools.cache
def _madvise():
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


def anonymous_ranges() -> list[tuple[int, int]]:
    """Private writable anonymous mappings (and the heap) of this process: [start, end) pairs."""
    ranges = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split()
                if parts[1].startswith("rw") and parts[1][3] == "p" and (len(parts) < 6 or parts[5] == "[heap]"):
                    lo, hi = parts[0].split("-")
                    ranges.append((int(lo, 16), int(hi, 16)))
    except OSError:
        return []
    return ranges


def _added(after: list[tuple[int, int]], before: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of ``after``'s ranges that no range of ``before`` covers."""
    out = []
    for lo, hi in after:
        pieces = [(lo, hi)]
        for blo, bhi in before:
            pieces = [p for a, b in pieces for p in ((a, min(b, blo)), (max(a, bhi), b)) if p[0] < p[1]]
        out.extend(pieces)
    return out


def collapse(ranges: list[tuple[int, int]]) -> int:
    """Collapse the whole huge pages inside ``ranges`` into huge pages; returns the bytes that were."""
    fn = _madvise()
    done = 0
    for lo, hi in ranges:
        start, end = -(-lo // HUGE_PAGE) * HUGE_PAGE, hi // HUGE_PAGE * HUGE_PAGE
        if fn is None or end <= start:
            continue
        fn(start, end - start, _MADV_HUGEPAGE)
        if fn(start, end - start, _MADV_COLLAPSE) == 0:
            done += end - start
        else:
            logger.debug("MADV_COLLAPSE refused for %d MiB (errno %d)", (end - start) >> 20, ctypes.get_errno())
    return done


@contextlib.contextmanager
def loaded_onto_huge_pages(what: str = "weights", background: bool = False):
    """Collapse the anonymous memory the body of the ``with`` added (a model load) onto huge pages.
    ``background``: on a daemon thread, so a start-up does not wait the ~0.5 s the kernel takes to
    copy ~90 MiB (the ranges are taken at the end of the body; a step reading the weights meanwhile
    sees the same bytes at the same addresses, on small pages until their range is done)."""
    before = anonymous_ranges()
    yield
    ranges = _added(anonymous_ranges(), before)

    def run() -> None:
        done = collapse(ranges)
        if done:
            logger.info("%s: %d MiB on 2 MiB pages", what, done >> 20)

    if background:
        threading.Thread(target=run, name="pagedserve-huge-pages", daemon=True).start()
    else:
        run()
