"""A choice's reply as OpenAI tool-call responses: streamed deltas or the full message."""
from __future__ import annotations

from typing import Any

from pagedserve.app.tools.calls import ParsedDelta
from pagedserve.app.tools.parsers import parse_whole
from pagedserve.app.tools.plan import ToolPlan


def finish_reason(called: bool, engine_reason: str | None) -> str | None:
    """"tool_calls" when the reply made calls and ended by itself (not cut by max_tokens)."""
    return "tool_calls" if called and engine_reason == "stop" else engine_reason


class ToolDeltas:
    """One streamed choice: each text delta → the ``delta`` fields to send (content and/or
    tool_calls), calls announced with id and name, then arguments in pieces."""

    def __init__(self, plan: ToolPlan) -> None:
        self.parser = plan.new_parser()
        self.called = False

    def delta(self, text: str, engine_finish: str | None) -> tuple[dict[str, Any], str | None]:
        d = self.parser.feed(text) if text else ParsedDelta()
        if engine_finish is not None:
            tail = self.parser.finish()
            d.content += tail.content
            d.calls += tail.calls
        out: dict[str, Any] = {}
        if d.content:
            out["content"] = d.content
        if d.calls:
            out["tool_calls"] = [c.wire() for c in d.calls]
            self.called = True
        return out, finish_reason(self.called, engine_finish)


def full_message(plan: ToolPlan, text: str, engine_finish: str | None) -> tuple[dict[str, Any], str | None]:
    """The non-streamed ``message`` and finish reason. A reply whose calls do not parse is
    returned whole as content (auto), as vLLM does."""
    parser = plan.new_parser()
    content, calls = parse_whole(parser, text)
    if not calls or (plan.mode == "auto" and parser.failed):
        return {"role": "assistant", "content": text}, engine_finish
    return ({"role": "assistant", "content": content if content.strip() else None, "tool_calls": calls},
            finish_reason(True, engine_finish))
