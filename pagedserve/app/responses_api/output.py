"""A reply as Responses API output items, and the typed stream events that build them.

``OutputItems`` takes the reply in pieces, already split (reasoning, answer text, tool-call deltas
from app/tools): each piece extends the open item or closes it and opens the next one (a
``reasoning`` item, a ``message`` with one ``output_text`` part, a ``function_call``), and returns
the events that say so (``response.output_item.added``, ``response.output_text.delta``,
``response.function_call_arguments.delta``, ... ``response.output_item.done``). The non-streamed
route feeds it the whole reply at once and keeps only the items, so both answers hold the same
items.
"""
from __future__ import annotations

import uuid
from typing import Any

from pagedserve.app.tools.calls import CallDelta

Event = dict[str, Any]


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputItems:
    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None
        self._calls: dict[int, dict[str, Any]] = {}  # tool-call index -> its item
        # The open item's text (or a call's arguments) as its pieces, joined when it closes: one
        # long reply streamed in small deltas was copied whole for each (issue 37).
        self._pieces: list[str] = []

    # ---- pieces in, events out ----------------------------------------------------------------

    def reasoning(self, text: str) -> list[Event]:
        if not text:
            return []
        events = self._ensure("reasoning")
        item = self._open
        self._pieces.append(text)
        events.append({"type": "response.reasoning_text.delta", "item_id": item["id"],
                       "output_index": self._index(), "content_index": 0, "delta": text})
        return events

    def text(self, text: str) -> list[Event]:
        if not text:
            return []
        events = self._ensure("message")
        item = self._open
        self._pieces.append(text)
        events.append({"type": "response.output_text.delta", "item_id": item["id"],
                       "output_index": self._index(), "content_index": 0, "delta": text, "logprobs": []})
        return events

    def call(self, delta: CallDelta) -> list[Event]:
        events: list[Event] = []
        if delta.id is not None:  # a new call: its header
            events += self.close()
            item = {"id": _id("fc"), "type": "function_call", "status": "in_progress", "call_id": delta.id,
                    "name": delta.name, "arguments": ""}
            self._calls[delta.index] = item
            events += self._add(item)
        item = self._calls[delta.index]
        if item is not self._open:  # the parsers finish a call before the next one starts
            raise RuntimeError("a tool call's arguments arrived after another item began")
        if delta.arguments:
            self._pieces.append(delta.arguments)
            events.append({"type": "response.function_call_arguments.delta", "item_id": item["id"],
                           "output_index": self._index(), "delta": delta.arguments})
        return events

    def close(self, status: str = "completed") -> list[Event]:
        """End the open item (``status`` "incomplete": the reply was cut by max_output_tokens)."""
        item, self._open = self._open, None
        if item is None:
            return []
        index = self.items.index(item)
        events: list[Event] = []
        kind = item["type"]
        text, self._pieces = "".join(self._pieces), []
        if kind == "message" or kind == "reasoning":
            part = item["content"][0]
            part["text"] = text
            done = "response.output_text.done" if kind == "message" else "response.reasoning_text.done"
            text_done = {"type": done, "item_id": item["id"], "output_index": index, "content_index": 0,
                         "text": part["text"]}
            if kind == "message":
                text_done["logprobs"] = []
            events.append(text_done)
            events.append({"type": "response.content_part.done", "item_id": item["id"], "output_index": index,
                           "content_index": 0, "part": dict(part)})
        else:
            item["arguments"] = text
            events.append({"type": "response.function_call_arguments.done", "item_id": item["id"],
                           "output_index": index, "name": item["name"], "arguments": item["arguments"]})
        item["status"] = status
        events.append({"type": "response.output_item.done", "output_index": index, "item": _copy(item)})
        return events

    # ---- internals ----------------------------------------------------------------------------

    def _index(self) -> int:
        return len(self.items) - 1

    def _ensure(self, kind: str) -> list[Event]:
        if self._open is not None and self._open["type"] == kind:
            return []
        events = self.close()
        if kind == "message":
            item = {"id": _id("msg"), "type": "message", "role": "assistant", "status": "in_progress",
                    "content": [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]}
        else:
            item = {"id": _id("rs"), "type": "reasoning", "status": "in_progress", "summary": [],
                    "content": [{"type": "reasoning_text", "text": ""}]}
        events += self._add(item)
        part = dict(item["content"][0])
        events.append({"type": "response.content_part.added", "item_id": item["id"],
                       "output_index": self._index(), "content_index": 0, "part": part})
        return events

    def _add(self, item: dict[str, Any]) -> list[Event]:
        self.items.append(item)
        self._open = item
        self._pieces = []
        added = _copy(item)
        if "content" in added:
            added["content"] = []  # its part is announced next (content_part.added)
        return [{"type": "response.output_item.added", "output_index": self._index(), "item": added}]


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    out = dict(item)
    if "content" in out:
        out["content"] = [dict(p) for p in out["content"]]
    return out
