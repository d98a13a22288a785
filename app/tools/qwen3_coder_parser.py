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

from app.partial_tags import held_prefix
from app.tools.calls import CallDelta, ParsedDelta, new_call_id

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
        self._buf = ""  # text not yet consumed
        self._block = ""  # the current block's raw text (content again if it is malformed)
        self._call: CallDelta | None = None
        self._param: str | None = None  # the parameter whose value is being read
        self._num_args = 0

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        if self.failed:
            out.content = text
            return out
        self._buf += text
        while self._buf and not self.failed and self._step(out):
            pass
        return out

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if self.failed:
            return out
        if self._state == _OUTSIDE:
            self._content(self._buf, out)
        elif self._state in (_BLOCK, _FUNCTION):  # the reply ended inside a call
            self._fail(out)
        self._buf = ""
        return out

    # ---- one step: True when it consumed something and may go on --------------------------------

    def _step(self, out: ParsedDelta) -> bool:
        buf = self._buf
        if self._state == _OUTSIDE:
            at = buf.find(self.start_tag)
            if at < 0:
                hold = held_prefix(buf, self.start_tag)
                self._content(buf[:len(buf) - hold], out)
                self._buf = buf[len(buf) - hold:]
                return False
            self._content(buf[:at], out)
            self._state, self._block, self._buf = _BLOCK, self.start_tag, buf[at + len(self.start_tag):]
            return True
        head = buf.lstrip()
        if self._state == _BLOCK:  # expecting <function=NAME>
            tag = self._tag(head, _FN)
            if tag is None:
                return False
            name = tag.strip() if tag is not False else ""
            if not name:
                return self._fail(out)
            self._open(name, out)
            self._state = _FUNCTION
            return True
        if self._state == _FUNCTION and self._param is not None:  # a parameter's value, to </parameter>
            end = buf.find(_PARAM_END)
            if end < 0:
                return False
            value = buf[:end]
            self._take(end + len(_PARAM_END))
            self._argument(self._param, value, out)
            self._param = None
            return True
        if self._state == _FUNCTION:  # parameters, then </function>
            if head.startswith(_FN_END):
                self._take(len(buf) - len(head) + len(_FN_END))
                self._close_call(out)
                self._state = _AFTER
                return True
            if _FN_END.startswith(head):
                return False
            param = self._tag(head, _PARAM)
            if param is None:
                return False
            if param is False or not param.strip():
                return self._fail(out)
            self._param = param.strip()
            return True
        # _AFTER: whitespace, then </tool_call> (or, leniently, anything else)
        if head.startswith(self.end_tag):
            self._buf = head[len(self.end_tag):]
            self._state = _OUTSIDE
            return True
        if head and not self.end_tag.startswith(head):
            self._buf, self._state = head, _OUTSIDE
            return True
        return False

    def _tag(self, head: str, opener: str) -> str | None | bool:
        """``<opener NAME>`` at the start of ``head``: its NAME, consumed; None while incomplete;
        False when the text cannot become it."""
        if not head.startswith(opener):
            return None if opener.startswith(head) else False
        close = head.find(">")
        if close < 0:
            return None
        self._take(len(self._buf) - len(head) + close + 1)
        return head[len(opener):close]

    def _take(self, n: int) -> None:
        self._block += self._buf[:n]
        self._buf = self._buf[n:]

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

    def _content(self, text: str, out: ParsedDelta) -> None:
        if text and (not self.calls or text.strip()):  # whitespace between calls is dropped
            out.content += text

    def _fail(self, out: ParsedDelta) -> bool:
        """Malformed: from here on everything is content; a call already announced stays."""
        self.failed = True
        announced = self._call is not None and self._sent(self._call)
        out.content += ("" if announced else self._block) + self._buf
        self._buf = ""
        return False
