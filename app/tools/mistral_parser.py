"""Mistral tool calls (``--tool-call-parser mistral``): text before ``[TOOL_CALLS]`` is content; after
it, either a JSON array of ``{"name": ..., "arguments": {...}}`` objects (Mistral 7B v0.3, Mixtral,
Nemo: tokenizer v3) or ``name[ARGS]{...}`` (tokenizer v11+, Mistral Small 3.x / Devstral; v7's
``name[CALL_ID]id[ARGS]{...}`` too), each call after its own ``[TOOL_CALLS]``. Arguments stream as
they are validated; a malformed call turns the rest into content (an announced call cannot be taken
back), as the other parsers do."""
from __future__ import annotations

from app.partial_tags import held_prefix
from app.tools.calls import CallDelta, CallTracker, ParsedDelta, TrackedCall, new_call_id
from app.tools.json_scan import JsonScanError, JsonScanner

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
        out = ParsedDelta()
        if self.failed:
            out.content = text
            return out
        buf = self._pending + text
        self._pending = ""
        while buf and not self.failed:
            buf = self._step(buf, out)
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

    # ---- one state's worth of text -----------------------------------------------------------

    def _step(self, buf: str, out: ParsedDelta) -> str:
        if self._state == _OUTSIDE:
            at = buf.find(self.start_tag)
            if at < 0:
                hold = held_prefix(buf, self.start_tag)
                out.content += buf[:len(buf) - hold]
                self._pending = buf[len(buf) - hold:]
                return ""
            if not self.calls or buf[:at].strip():
                out.content += buf[:at]
            self._state = _DECIDE
            return buf[at + len(self.start_tag):]
        if self._state == _DECIDE:
            head = buf.lstrip()
            if not head:
                self._pending = buf
                return ""
            if head[0] == "[" and not head.startswith(self.args_tag):
                self._state = _ARRAY
                self._tracker = CallTracker(self.calls, call_depth=2, arg_keys=("arguments", "parameters"),
                                            max_calls=self.max_calls)
            else:
                self._state = _NAME
            return head
        if self._state == _ARRAY:
            start = self._tracker.scanner.pos
            try:
                n = self._tracker.feed_until_done(buf)
            except JsonScanError:
                self._tracker.drain(out.calls)
                self._fail(out, buf[self._tracker.scanner.pos - start + 1:])
                return ""
            self._tracker.drain(out.calls)
            if self._tracker.done:
                self._state = _OUTSIDE
            return buf[n:]
        if self._state == _NAME:
            at = buf.find(self.args_tag)
            if at < 0:
                if len(buf) > 256 or "{" in buf:  # no name is that long, nor holds a brace
                    self._fail(out, self.start_tag + buf)
                    return ""
                self._pending = buf
                return ""
            name = buf[:at].split(self.call_id_tag)[0].strip()
            if not name:
                self._fail(out, self.start_tag + buf)
                return ""
            self._open_call(name, out)
            self._state, self._args = _ARGS, JsonScanner(_NoCalls(), call_depth=1 << 30)
            return buf[at + len(self.args_tag):]
        # _ARGS: the arguments object, released as far as it is valid
        start = self._args.pos
        try:
            n = self._args.feed_until_done(buf)
        except JsonScanError:
            n = self._args.pos - start
            self._release(buf[:n], out)
            self._fail(out, buf[n + 1:])
            return ""
        self._release(buf[:n], out)
        if self._args.done:
            self._current.ended = self._current.finished = True
            self._state, self._args, self._current = _OUTSIDE, None, None
        return buf[n:]

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
