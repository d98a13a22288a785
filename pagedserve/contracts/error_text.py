"""The one-line form of a worker's error text, for clients.

A worker reports a failed step with its traceback (``StepOutput.error``), and executor errors
quote it. A traceback names the server's files and code: it belongs in the server log, never
in a 500 body or an SSE error event. Lives in contracts so executors and the HTTP layer share it.
"""
from __future__ import annotations

_TRACEBACK_HEADER = "Traceback (most recent call last)"


def error_summary(text: str, limit: int = 1000) -> str:
    """What precedes a traceback, then its final exception ("Type: message"), on one line of at
    most ``limit`` characters. Text without a traceback is only collapsed onto one line and cut.
    """
    lines = text.strip().splitlines()
    starts = [i for i, ln in enumerate(lines) if ln.startswith(_TRACEBACK_HEADER)]
    if starts:
        # The exception follows the last indented line (frames, code, ^^^ markers); earlier
        # tracebacks of a chain end before it.
        last_frame = max((i for i, ln in enumerate(lines) if ln.startswith(" ")), default=starts[-1])
        lines = lines[: starts[0]] + (lines[last_frame + 1:] or lines[-1:])
    one = " ".join(" ".join(lines).split())
    return one if len(one) <= limit else one[: limit - 3] + "..."
