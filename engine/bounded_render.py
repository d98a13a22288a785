"""Bounded rendering of a request's own chat template (AsyncEngine.render_chat): the deadline
pool (engine/prep_pools.py) abandons a thread that runs past --chat-template-timeout, but a jinja
template with nested loops would keep that thread busy for ever; here a line tracer on the
template's own frames stops it once the deadline passes. Kept apart so async_engine.py is about
the engine loop and its requests."""
from __future__ import annotations

import time


class _RenderInterrupted(Exception):
    """Raised inside a request's own chat template when it runs past its deadline."""


def _render_bounded(render, deadline_s: float | None):
    """Call ``render()``; with a deadline, a line tracer on the template's own frames (jinja
    compiles templates to Python code named "<template>") stops it once the deadline passes, so a
    template with nested loops frees its thread instead of holding it for ever."""
    if not deadline_s:
        return render()
    import sys

    deadline = time.monotonic() + deadline_s

    def on_line(frame, event, arg):
        if event == "line" and time.monotonic() > deadline:
            raise _RenderInterrupted()
        return on_line

    def on_call(frame, event, arg):
        if frame.f_code.co_filename == "<template>":
            if time.monotonic() > deadline:
                raise _RenderInterrupted()
            return on_line
        return None

    previous = sys.gettrace()
    sys.settrace(on_call)
    try:
        return render()
    finally:
        sys.settrace(previous)
