"""Streaming parsers cost time linear in the reply (issue 37 item 2): a parser that copied its whole
buffer for each piece (``buf += text``, ``buf.lstrip()``, ``buf.find`` from the start) stalled the
event loop for seconds on one long tool call or reasoning part. Each case of
loadtest/micro/bench_stream_parsers.py is timed at two sizes 16 times apart: the CPU time per
character may not grow more than 2.5 times (a linear parser stays near 1; the quadratic ones this
replaced were at 3 to 16). Whole-reply cases (a non-streamed answer of many calls, one feed) are
timed at larger sizes, since their per-call copies were cheap next to the scanning."""
from __future__ import annotations

import gc
import time

import pytest

from pagedserve.loadtest.micro.bench_stream_parsers import cases, run_once

MAX_RATIO = 2.5


def _best_per_char(case, n: int, rounds: int) -> float:
    gc.collect()
    gc.disable()  # a full collection landing in one run is noise here, not the parser's cost
    try:
        return min(run_once(case, n) for _ in range(rounds)) / n
    finally:
        gc.enable()


@pytest.mark.parametrize("case", cases(), ids=lambda c: c.name)
def test_time_per_character_does_not_grow_with_the_reply(case):
    small, big = (20_000, 320_000) if case.streamed else (50_000, 800_000)
    t0 = time.monotonic()
    ratio = 0.0
    for _ in range(3):  # another try only if one looked quadratic (a busy machine)
        ratio = _best_per_char(case, big, 1) / _best_per_char(case, small, 3)
        if ratio < MAX_RATIO:
            break
    assert ratio < MAX_RATIO, (f"{case.name}: {ratio:.1f}x the time per character at {big:,} "
                               f"characters as at {small:,} ({time.monotonic() - t0:.1f} s)")
