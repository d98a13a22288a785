"""Qwen3-Coder tool calls (``--tool-call-parser qwen3_coder``): XML-style blocks

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Text outside the blocks is content. A parameter's value is raw text: it becomes JSON by the type the
tool's ``parameters`` schema gives it (strings stay text; numbers, booleans, objects and arrays are
parsed, falling back to the text), as vLLM's parser of the same name. The call is announced when its
name is complete; its arguments object is streamed one parameter at a time (``{"city": "Paris"``,
``, "unit": "c"``, then ``}``), so the pieces joined equal the non-streamed arguments.
"""
from __future__ import annotations

import ast
import json
from typing import Any

from pagedserve.app.partial_tags import find_split, held_prefix, joined as _joined, last as _last
from pagedserve.app.tools.calls import CallDelta, ParsedDelta, new_call_id

_OUTSIDE, _BLOCK, _FUNCTION, _AFTER = range(4)
_FN, _PARAM, _PARAM_END, _FN_END = "<function=", "<parameter=", "</parameter>", "</function>"


def convert(value: str, schema: dict | None) -> Any:
    """A parameter's text as the JSON value its schema's type says."""
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    kind = (schema or {}).get("type")
    kinds = set(kind) if isinstance(kind, list) else {kind}
    if kinds == {"string"}:
        return value
    if value.strip().lower() == "null" and (None in kinds or "null" in kinds):
        return None
    if "boolean" in kinds and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    try:
        return json.loads(value)
    except ValueError:
        pass
    if kinds & {"object", "array"}:
        try:
            return ast.literal_eval(value)
        except (ValueError, SyntaxError):
            pass
    return value


class Qwen3CoderToolParser:
    """Read in one pass (issue 37): each character is looked at a bounded number of times, and
    nothing held is copied again when a piece arrives. The tags are matched a character at a
    time; a name and a parameter's value, which may be long, are searched for their end
    (``>``, ``</parameter>``) with ``str.find`` in each new piece only."""

    name = "qwen3_coder"
    start_tag = "<tool_call>"
    end_tag = "</tool_call>"

    def __init__(self, max_calls: int | None = None, tools: list[dict] | None = None) -> None:
        self.max_calls = max_calls
        self.calls: list[CallDelta] = []  # each call's header
        self.failed = False
        self._params = {t["function"]["name"]: (t["function"].get("parameters") or {}).get("properties") or {}
                        for t in tools or [] if t.get("type") == "function"}
        self._state = _OUTSIDE
        self._pending = ""  # outside a block: text that may start the start tag
        # In a block, its text is read (consumed) tag by tag; what is not consumed yet is
        # ``_unread`` (earlier pieces) + the current piece from ``_mark``.
        self._raw: list[str] = []  # the block's consumed text (content again if it is malformed)
        self._unread: list[str] = []
        self._unread_len = 0
        self._unread_tail = ""  # the last characters of _unread (a closing tag may start in them)
        self._mark = 0
        self._head = ""  # the tag being matched (after whitespace), up to its name
        self._name: list[str] | None = None  # the name after "<function=" / "<parameter=" so far
        self._call: CallDelta | None = None
        self._param: str | None = None  # the parameter whose value is being read
        self._num_args = 0

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        if self.failed:
            out.content = text
            return out
        content: list[str] = []
        prefix, self._pending = self._pending, ""  # outside: read before text[i:]
        i, n = 0, len(text)
        self._mark = 0
        while not self.failed:
            if self._state == _OUTSIDE:
                if not prefix and i >= n:
                    break
                at = find_split(prefix, text, i, self.start_tag)
                if at < 0:
                    tail = _last(prefix, text, i, len(self.start_tag) - 1)
                    hold = held_prefix(tail, self.start_tag)
                    self._content(_joined(prefix, text, i, len(prefix) + n - i - hold), content)
                    self._pending = tail[len(tail) - hold:]
                    break
                self._content(_joined(prefix, text, i, at), content)
                i += at + len(self.start_tag) - len(prefix)  # the tag ends in text: prefix is shorter
                prefix = ""
                self._state, self._raw, self._mark = _BLOCK, [self.start_tag], i
                self._head, self._name = "", None
            elif i >= n:
                break
            elif self._state == _FUNCTION and self._param is not None:
                i = self._read_value(text, i, out)
            else:
                i, prefix = self._read_tag(text, i, out, content)
        if self._state in (_BLOCK, _FUNCTION) and not self.failed and self._mark < n:
            piece = text[self._mark:]
            self._unread.append(piece)
            self._unread_len += len(piece)
            self._unread_tail = (self._unread_tail + piece[-len(_PARAM_END):])[-len(_PARAM_END):]
        out.content = "".join(content) + out.content
        return out

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if self.failed:
            return out
        if self._state == _OUTSIDE:
            content: list[str] = []
            self._content(self._pending, content)
            out.content = "".join(content)
        elif self._state in (_BLOCK, _FUNCTION):  # the reply ended inside a call
            self._fail(out, "")
        self._pending = ""
        return out

    # ---- reading a block ------------------------------------------------------------------------

    def _read_tag(self, text: str, i: int, out: ParsedDelta, content: list[str]) -> tuple[int, str]:
        """Whitespace, then the tag the state expects: <function=NAME> (_BLOCK), <parameter=NAME>
        or </function> (_FUNCTION), </tool_call> (_AFTER: anything else leaves the block, as text
        read from (the returned prefix) + text[i:])."""
        n = len(text)
        while i < n:
            if self._name is not None:  # a name, to ">"
                close = text.find(">", i)
                if close < 0:
                    self._name.append(text[i:])
                    return n, ""
                name = "".join(self._name) + text[i:close]
                self._name = None
                self._consume(text, close + 1)
                self._named(name.strip(), out, text, close + 1)
                return close + 1, ""
            ch = text[i]
            i += 1
            if not self._head and ch.isspace():
                continue
            head = self._head = self._head + ch
            if self._state == _BLOCK:
                if head == _FN:
                    self._name = []
                elif not _FN.startswith(head):
                    self._fail(out, text)
                    return n, ""
            elif self._state == _FUNCTION:
                if head == _FN_END:
                    self._consume(text, i)
                    self._close_call(out)
                    self._state, self._head = _AFTER, ""
                    return i, ""
                if head == _PARAM:
                    self._name = []
                elif not (_FN_END.startswith(head) or _PARAM.startswith(head)):
                    self._fail(out, text)
                    return n, ""
            else:  # _AFTER
                if head == self.end_tag:
                    self._state, self._head = _OUTSIDE, ""
                    return i, ""
                if not self.end_tag.startswith(head):
                    self._state, self._head = _OUTSIDE, ""
                    return i, head
        return n, ""

    def _named(self, name: str, out: ParsedDelta, text: str, i: int) -> None:
        """A name's ">" was read (and consumed): open the call, or start the parameter's value."""
        self._head = ""
        if not name:
            self._fail(out, text)
        elif self._state == _BLOCK:
            self._open(name, out)
            self._state = _FUNCTION
        else:
            self._param = name

    def _read_value(self, text: str, i: int, out: ParsedDelta) -> int:
        """A parameter's value, to </parameter>: found in the new piece (or across its start)."""
        tail = self._unread_tail if self._unread else ""
        at = find_split(tail, text, i, _PARAM_END)
        if at < 0:
            return len(text)
        size = self._unread_len + (i - self._mark) - len(tail) + at  # the value's length
        value = self._unconsumed(text, size)
        self._consume(text, self._mark + size + len(_PARAM_END) - self._unread_len)
        self._argument(self._param, value, out)
        self._param = None
        return self._mark

    def _unconsumed(self, text: str, size: int) -> str:
        """The first ``size`` characters not consumed yet."""
        if size <= self._unread_len:
            return "".join(self._unread)[:size]
        return "".join(self._unread) + text[self._mark:self._mark + size - self._unread_len]

    def _consume(self, text: str, end: int) -> None:
        """Everything not consumed up to text[end] joins the block's text."""
        self._raw.extend(self._unread)
        self._raw.append(text[self._mark:end])
        self._unread, self._unread_len, self._unread_tail = [], 0, ""
        self._mark = end

    # ---- calls ----------------------------------------------------------------------------------

    def _open(self, name: str, out: ParsedDelta) -> None:
        self._call = CallDelta(len(self.calls), new_call_id(), name, "")
        self.calls.append(self._call)
        self._num_args = 0
        if self._sent(self._call):
            out.calls.append(CallDelta(self._call.index, self._call.id, name, ""))

    def _argument(self, key: str, value: str, out: ParsedDelta) -> None:
        schema = self._params.get(self._call.name, {}).get(key)
        piece = ("{" if self._num_args == 0 else ", ") + json.dumps(key) + ": " + json.dumps(
            convert(value, schema if isinstance(schema, dict) else None), ensure_ascii=False)
        self._num_args += 1
        if self._sent(self._call):
            out.calls.append(CallDelta(self._call.index, arguments=piece))

    def _close_call(self, out: ParsedDelta) -> None:
        if self._sent(self._call):
            out.calls.append(CallDelta(self._call.index, arguments="}" if self._num_args else "{}"))
        self._call = None

    def _sent(self, call: CallDelta) -> bool:
        return self.max_calls is None or call.index < self.max_calls

    def _content(self, text: str, content: list[str]) -> None:
        if text and (not self.calls or text.strip()):  # whitespace between calls is dropped
            content.append(text)

    def _fail(self, out: ParsedDelta, text: str) -> None:
        """Malformed: from here on everything is content (the block's text as it was, and the rest
        of ``text``); a call already announced stays, and only what was not consumed follows it."""
        self.failed = True
        announced = self._call is not None and self._sent(self._call)
        out.content += ("" if announced else "".join(self._raw)) + "".join(self._unread) + text[self._mark:]
