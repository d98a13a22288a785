"""Bounded rendering of a request's own chat template (AsyncEngine.render_chat): the deadline
pool (engine/prep_pools.py) abandons a thread that runs past --chat-template-timeout, but a jinja
template with nested loops would keep that thread busy for ever; here a line tracer on the
template's own frames stops it once the deadline passes, or once it has run
``MAX_TEMPLATE_LINES`` statements (loop iterations, whatever the deadline). What one statement
may build is bounded by the sandbox itself (engine/template_sandbox.py). Kept apart so
async_engine.py is about the engine loop and its requests."""
from __future__ import annotations

import time

MAX_TEMPLATE_LINES = 2_000_000  # template statements one render of a request's template may run


class _RenderInterrupted(Exception):
    """Raised inside a request's own chat template when it runs past its deadline."""


def _render_bounded(render, deadline_s: float | None, max_lines: int | None = None):
    """Call ``render()``; with a deadline, a line tracer on the template's own frames (jinja
    compiles templates to Python code named "<template>") stops it once the deadline passes
    (``_RenderInterrupted``) or it has run ``max_lines`` lines (``TemplateLimitError``), so a
    template with nested loops frees its thread instead of holding it for ever."""
    if not deadline_s and max_lines is None:
        return render()
    import sys

    deadline = time.monotonic() + deadline_s if deadline_s else float("inf")
    lines = 0

    def on_line(frame, event, arg):
        nonlocal lines
        if event == "line":
            lines += 1
            if max_lines is not None and lines > max_lines:
                from pagedserve.engine.template_sandbox import TemplateLimitError

                raise TemplateLimitError(f"the chat template ran more than {max_lines:,} statements "
                                         "(loop iterations), more than this server allows")
            if time.monotonic() > deadline:
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
