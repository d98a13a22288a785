"""error_summary: what a client may see of a worker's error text (never the traceback)."""
from __future__ import annotations

import traceback

from pagedserve.contracts.error_text import error_summary


def _chained_traceback() -> str:
    try:
        try:
            {}["missing"]
        except KeyError:
            raise RuntimeError("step 3 failed:\nsecond line of the message") from None
    except RuntimeError:
        return "worker 0's error:\n" + traceback.format_exc()


def test_the_final_exception_of_a_traceback_after_its_preface():
    text = _chained_traceback()
    assert "File " in text  # a real traceback with this file's path
    got = error_summary(text)
    assert got == "worker 0's error: RuntimeError: step 3 failed: second line of the message"


def test_chained_tracebacks_keep_only_the_last_exception():
    try:
        try:
            raise KeyError("first")
        except KeyError:
            raise ValueError("second")
    except ValueError:
        text = traceback.format_exc()
    assert "During handling" in text
    assert error_summary(text) == "ValueError: second"


def test_plain_text_is_collapsed_and_cut():
    assert error_summary("a\n  b\tc ") == "a b c"
    long = error_summary("x" * 5000, limit=100)
    assert len(long) == 100 and long.endswith("...")
