"""Mistral tool calls (``--tool-call-parser mistral``): text before ``[TOOL_CALLS]`` is content; after
it, either a JSON array of ``{"name": ..., "arguments": {...}}`` objects (Mistral 7B v0.3, Mixtral,
Nemo: tokenizer v3) or ``name[ARGS]{...}`` (tokenizer v11+, Mistral Small 3.x / Devstral; v7's
``name[CALL_ID]id[ARGS]{...}`` too), each call after its own ``[TOOL_CALLS]``. Arguments stream as
they are validated; a malformed call turns the rest into content (an announced call cannot be taken
back), as the other parsers do."""
from __future__ import annotations

from pagedserve.app.partial_tags import find_split, held_prefix, joined as _joined, last as _last
from pagedserve.app.tools.calls import CallDelta, CallTracker, ParsedDelta, TrackedCall, new_call_id
from pagedserve.app.tools.json_scan import JsonScanError, JsonScanner

_OUTSIDE, _DECIDE, _ARRAY, _NAME, _ARGS = range(5)


class _NoCalls:
    """A JsonScanner listener that only needs the end of the value (the arguments object)."""

    def call_start(self, pos: int) -> None: ...
    def call_key(self, key: str) -> None: ...
    def value_start(self, pos: int) -> None: ...
    def value_end(self, pos: int) -> None: ...
    def call_end(self, pos: int) -> None: ...


class MistralToolParser:
    name = "mistral"
    start_tag = "[TOOL_CALLS]"
    args_tag = "[ARGS]"
    call_id_tag = "[CALL_ID]"

    def __init__(self, max_calls: int | None = None, tools: list[dict] | None = None) -> None:
        self.max_calls = max_calls
        self.calls: list[TrackedCall] = []  # both forms: one index sequence
        self.failed = False
        self._state = _OUTSIDE
        self._pending = ""  # text not yet released: a possible tag, a name being read
        self._tracker: CallTracker | None = None  # the array form
        self._args: JsonScanner | None = None  # the name[ARGS] form: its arguments object
        self._current: TrackedCall | None = None
        self._current_id = ""

    def feed(self, text: str) -> ParsedDelta:
        """Linear in ``text`` (issue 37): read by offsets, never copied from an offset to its end;
        only a possible tag or a name (at most 256 characters) is held from piece to piece."""
        out = ParsedDelta()
        if self.failed:
            out.content = text
            return out
        content: list[str] = []
        prefix, self._pending = self._pending, ""  # read before text[i:]
        i, n = 0, len(text)
        while (prefix or i < n) and not self.failed:
            if self._state == _OUTSIDE:
                at = find_split(prefix, text, i, self.start_tag)
                if at < 0:
                    tail = _last(prefix, text, i, len(self.start_tag) - 1)
                    hold = held_prefix(tail, self.start_tag)
                    content.append(_joined(prefix, text, i, len(prefix) + n - i - hold))
                    self._pending = tail[len(tail) - hold:]
                    break
                before = _joined(prefix, text, i, at)
                if not self.calls or before.strip():
                    content.append(before)
                self._state = _DECIDE
                i += at + len(self.start_tag) - len(prefix)  # the tag ends in text: prefix is shorter
                prefix = ""
            elif self._state == _DECIDE:  # whitespace (dropped), then "[" of an array or a name
                while i < n and text[i].isspace():
                    i += 1
                if i == n:
                    break
                if text[i] == "[" and not text.startswith(self.args_tag, i):
                    self._state = _ARRAY
                    self._tracker = CallTracker(self.calls, call_depth=2, arg_keys=("arguments", "parameters"),
                                                max_calls=self.max_calls)
                else:
                    self._state = _NAME
            elif self._state == _ARRAY:
                start = self._tracker.scanner.pos
                try:
                    k = self._tracker.feed_until_done(text, i)
                except JsonScanError:
                    self._tracker.drain(out.calls)
                    self._fail(out, text[i + self._tracker.scanner.pos - start + 1:])
                    break
                self._tracker.drain(out.calls)
                if self._tracker.done:
                    self._state = _OUTSIDE
                i += k
            elif self._state == _NAME:
                at = find_split(prefix, text, i, self.args_tag)
                if at < 0:
                    size = len(prefix) + n - i
                    rest = _joined(prefix, text, i, min(size, 257))
                    if size > 256 or "{" in rest:  # no name is that long, nor holds a brace
                        self._fail(out, self.start_tag + _joined(prefix, text, i, size))
                    else:
                        self._pending = rest
                    break
                name = _joined(prefix, text, i, at).split(self.call_id_tag)[0].strip()
                if not name:
                    self._fail(out, self.start_tag + _joined(prefix, text, i, len(prefix) + n - i))
                    break
                self._open_call(name, out)
                self._state, self._args = _ARGS, JsonScanner(_NoCalls(), call_depth=1 << 30)
                i += at + len(self.args_tag) - len(prefix)  # the tag ends in text: else found before
                prefix = ""
            else:  # _ARGS: the arguments object, released as far as it is valid
                start = self._args.pos
                try:
                    k = self._args.feed_until_done(text, i)
                except JsonScanError:
                    k = self._args.pos - start
                    self._release(text[i:i + k], out)
                    self._fail(out, text[i + k + 1:])
                    break
                self._release(text[i:i + k], out)
                if self._args.done:
                    self._current.ended = self._current.finished = True
                    self._state, self._args, self._current = _OUTSIDE, None, None
                i += k
        out.content = "".join(content) + out.content
        return out

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if self.failed:
            return out
        pending, self._pending = self._pending, ""
        if self._state == _OUTSIDE:
            out.content = pending
        elif self._state in (_DECIDE, _NAME) and pending.strip():
            self._fail(out, self.start_tag + pending)
        elif self._state in (_ARRAY, _ARGS):  # ended inside a call's JSON
            self._fail(out, "")
        return out

    def _open_call(self, name: str, out: ParsedDelta) -> None:
        self._current = TrackedCall(index=len(self.calls), name=name)
        self.calls.append(self._current)
        self._current_id = new_call_id()

    def _release(self, piece: str, out: ParsedDelta) -> None:
        """Arguments of the name[ARGS] call read so far; its first piece carries id and name."""
        c = self._current
        if c is None or (self.max_calls is not None and c.index >= self.max_calls):
            return  # parallel_tool_calls: false: parsed, never sent
        if not c.header_sent:
            piece = piece.lstrip()
            if not piece:
                return
            c.header_sent = True
            out.calls.append(CallDelta(c.index, self._current_id, c.name, piece))
        elif piece:
            out.calls.append(CallDelta(c.index, arguments=piece))

    def _fail(self, out: ParsedDelta, rest: str) -> None:
        self.failed = True
        if self._tracker is not None:
            for c in self._tracker.mine:
                c.finished = True
        out.content += rest
