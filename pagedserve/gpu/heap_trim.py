"""Give the C heap's free pages back to the OS while a worker serves.

Each step allocates tensors whose sizes follow the batch (prompt lengths, rows, the vocabulary
times rows). glibc serves the large ones from mmap at first, then raises its mmap threshold to
the largest freed chunk, so from then on they come from the main heap; freed, they leave holes
it reuses only when sizes fit, and it gives back only the top of the heap. On the default model
the worker's RSS grew ~0.3-0.5 MiB per finished sequence that way while the bytes in use stayed
flat (issue 35: ``malloc_stats`` in a served worker, 2,900 sequences: in use 840 MB flat, heap
1.27 -> 1.37 GB; one ``malloc_trim(0)`` gave 516 MB back). ``malloc_trim`` returns every
free page inside the heap too (``MADV_DONTNEED``), so a trim now and then, and when the worker
goes idle, keeps RSS at what is in use. Elsewhere than glibc it is a no-op.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

# A trim walks the free chunks: a few ms for a 1 GB heap. Once per this many seconds of steps
# keeps that far below 0.1 % of the step time, and the heap's growth between trims small.
DEFAULT_INTERVAL_S = 5.0


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
        "keepcost")]


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "malloc_trim") else None  # musl and others have none


_LIBC = _libc()


def glibc_trim() -> bool:
    """``malloc_trim(0)``: True when memory was given back; False where there is no such call."""
    if _LIBC is None:
        return False
    return bool(_LIBC.malloc_trim(ctypes.c_size_t(0)))


def heap_bytes() -> tuple[int, int] | None:
    """(bytes in use, bytes the heap holds from the OS) of the main heap and arenas, from glibc's
    ``mallinfo2`` (glibc >= 2.33); None elsewhere."""
    if _LIBC is None or not hasattr(_LIBC, "mallinfo2"):
        return None
    fn = _LIBC.mallinfo2
    fn.restype = _Mallinfo2
    info = fn()
    return int(info.uordblks + info.hblkhd), int(info.arena + info.hblkhd)


class HeapTrimmer:
    """Trims after steps, at most once per ``interval_s`` while steps run, and once when the
    worker goes idle after some (``trim_if_dirty``). ``clock`` and ``trim`` are seams for tests."""

    def __init__(self, interval_s: float = DEFAULT_INTERVAL_S, clock: Callable[[], float] = time.monotonic,
                 trim: Callable[[], bool] = glibc_trim) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self._trim = trim
        self._last = clock()
        self._dirty = False  # a step ran since the last trim
        self.trims = 0

    @property
    def dirty(self) -> bool:
        return self._dirty

    def after_step(self) -> None:
        self._dirty = True
        if self._clock() - self._last >= self.interval_s:
            self.trim_if_dirty()

    def trim_if_dirty(self) -> None:
        if not self._dirty:
            return
        t0 = time.perf_counter()
        released = self._trim()
        self._last, self._dirty = self._clock(), False
        self.trims += 1
        logger.debug("heap trim: %s in %.1f ms", "pages given back" if released else "nothing to give back",
                     (time.perf_counter() - t0) * 1e3)
