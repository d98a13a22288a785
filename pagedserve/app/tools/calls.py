"""Tool calls as they are recognised in model output: header (id, name) first, then arguments in
pieces, numbered in the order the calls appear.

``CallTracker`` listens to a ``JsonScanner`` over call objects (``{"name": ..., "arguments": ...}``)
and turns what the scanner has validated so far into ``CallDelta`` items: a call is announced
once its name string is complete, and its arguments are the raw JSON text of the arguments value,
released as far as it has been read. Streaming and non-streaming answers are built from the same
deltas, so the arguments string a client reassembles is byte for byte the non-streamed one.
"""
from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field

from pagedserve.app.partial_tags import Pieces
from pagedserve.app.tools.json_scan import JsonScanError, JsonScanner


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclass(slots=True)
class CallDelta:
    """One piece of one call: the first piece of a call carries id and name."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def wire(self) -> dict:
        """The OpenAI streaming form (``choices[].delta.tool_calls[]``)."""
        if self.id is not None:
            return {"index": self.index, "id": self.id, "type": "function",
                    "function": {"name": self.name, "arguments": self.arguments}}
        return {"index": self.index, "function": {"arguments": self.arguments}}


@dataclass(slots=True)
class ParsedDelta:
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.calls)


@dataclass(slots=True)
class TrackedCall:
    index: int
    name: str | None = None
    name_start: int | None = None
    args_start: int | None = None
    args_end: int | None = None
    args_is_string: bool = False
    emitted: int = 0  # arguments characters released so far (text offset)
    header_sent: bool = False
    ended: bool = False
    finished: bool = False  # everything released
    key: str | None = None


class CallTracker:
    """Call objects found by one scanner; ``drain`` releases what is known. ``calls`` is shared
    across trackers of one response, so indices run on from call to call."""

    def __init__(self, calls: list[TrackedCall], call_depth: int = 1,
                 arg_keys: tuple[str, ...] = ("arguments", "parameters"),
                 max_calls: int | None = None) -> None:
        self.calls = calls
        self.arg_keys = arg_keys
        self.max_calls = max_calls
        self.text = Pieces()  # everything fed, as its pieces (issue 37: ``+=`` copied it per piece)
        self.scanner = JsonScanner(self, call_depth)
        self._cur: TrackedCall | None = None
        self.mine: list[TrackedCall] = []

    # ---- feeding ---------------------------------------------------------------------------

    def feed(self, text: str) -> None:
        self.text.append(text)
        self.scanner.feed(text)

    def feed_until_done(self, text: str, start: int = 0) -> int:
        """Read ``text[start:]`` up to the end of the JSON value; return how much was read. On a
        JsonScanError, the offending character is ``scanner.pos`` (after) - ``scanner.pos``
        (before) characters from ``start``. ``text`` is referred to, not copied: the listener
        reads characters at the positions the scanner reports while it reads."""
        held = len(self.text)
        self.text.append(text, start)
        try:
            n = self.scanner.feed_until_done(text, start)
        except JsonScanError:
            self.text.truncate(self.scanner.pos)
            raise
        self.text.truncate(held + n)
        return n

    @property
    def done(self) -> bool:
        return self.scanner.done

    # ---- scanner events --------------------------------------------------------------------

    def call_start(self, pos: int) -> None:
        self._cur = TrackedCall(index=len(self.calls))
        self.calls.append(self._cur)
        self.mine.append(self._cur)

    def call_key(self, key: str) -> None:
        self._cur.key = key

    def value_start(self, pos: int) -> None:
        c = self._cur
        if c.key == "name":
            c.name_start = pos
        elif c.key in self.arg_keys and c.args_start is None:
            c.args_start = c.emitted = pos
            c.args_is_string = self.text[pos] == '"'

    def value_end(self, pos: int) -> None:
        c = self._cur
        if c.key == "name" and c.name is None:
            name = json.loads(self.text[c.name_start:pos])
            if not isinstance(name, str) or not name:
                raise JsonScanError("a tool call's name must be a non-empty string")
            c.name = name
        elif c.key in self.arg_keys and c.args_start is not None and c.args_end is None:
            c.args_end = pos

    def call_end(self, pos: int) -> None:
        if self._cur.name is None:
            raise JsonScanError("a tool call without a name")
        self._cur.ended = True

    # ---- release ---------------------------------------------------------------------------

    def drain(self, out: list[CallDelta]) -> None:
        """Append what can be released now of this tracker's calls to ``out``."""
        for c in self.mine:
            if not c.finished:
                release(c, self.text, out, self.max_calls)

    def header_sent(self) -> bool:
        return any(c.header_sent for c in self.mine)


def release(c: TrackedCall, text: Pieces, out: list[CallDelta], max_calls: int | None) -> None:
    """Release call ``c``'s header and newly read arguments (from its tracker's ``text``)."""
    if max_calls is not None and c.index >= max_calls:
        c.finished = c.ended  # parsed, never sent (parallel_tool_calls: false)
        return
    if c.name is None:
        return
    piece = ""
    if c.args_start is not None:
        if c.args_is_string:  # arguments sent as a JSON string holding the JSON: send its content
            if c.args_end is not None and c.emitted < c.args_end:
                value = json.loads(text[c.args_start:c.args_end])
                piece, c.emitted = value, c.args_end
        else:
            end = c.args_end if c.args_end is not None else len(text)
            piece, c.emitted = text[c.emitted:end], max(c.emitted, end)
    elif c.ended:
        piece = "{}"  # a call without arguments
    if not c.header_sent:
        c.header_sent = True
        out.append(CallDelta(c.index, new_call_id(), c.name, piece))
    elif piece:
        out.append(CallDelta(c.index, arguments=piece))
    if c.ended:
        c.finished = True
