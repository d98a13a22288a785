"""Pythonic tool calls (``--tool-call-parser pythonic``; Llama 3.2 and Llama 4 with their pythonic
templates): a reply that is a Python list of calls with keyword arguments,
``[get_weather(city="Paris", unit="c"), get_time(tz="CET")]`` (optionally between
``<|python_start|>`` and ``<|python_end|>``), is calls; any other reply is content.

The list is read whole before any call leaves (a call's arguments are Python literals, turned into
JSON only once they parse): streamed, each call arrives in one delta when the list closes. A list
that does not parse, or holds anything but calls with literal keyword arguments, is content.
"""
from __future__ import annotations

import ast
import json
from typing import Any

from pagedserve.app.tools.calls import CallDelta, ParsedDelta, new_call_id

_START, _LIST, _CONTENT, _AFTER = range(4)
_JSON_NAMES = {"true": True, "false": False, "null": None}  # JSON literals written in the call


class PythonicCallError(ValueError):
    pass


def _literal(node: ast.AST) -> Any:
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            raise PythonicCallError("** in a dict literal")
        return {str(_literal(k)): _literal(v) for k, v in zip(node.keys, node.values)}
    try:
        value = ast.literal_eval(node)
    except ValueError:
        raise PythonicCallError(f"not a literal: {ast.unparse(node)}") from None
    if value is not None and not isinstance(value, (str, int, float)):  # a set, bytes, 1j, ...: no JSON
        raise PythonicCallError(f"not a JSON value: {ast.unparse(node)}")
    return value


def parse_calls(text: str) -> list[tuple[str, str]]:
    """``[f(a=1), g()]`` -> [(name, arguments as JSON)]; PythonicCallError when it is not that."""
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError as e:
        raise PythonicCallError(str(e)) from None
    if not isinstance(tree.body, ast.List) or not tree.body.elts:
        raise PythonicCallError("not a list of calls")
    calls = []
    for call in tree.body.elts:
        if not isinstance(call, ast.Call) or call.args:
            raise PythonicCallError("each item must be a call with keyword arguments only")
        name = ast.unparse(call.func)
        if any(k.arg is None for k in call.keywords):
            raise PythonicCallError("**kwargs in a call")
        args = {k.arg: _literal(k.value) for k in call.keywords}
        calls.append((name, json.dumps(args, ensure_ascii=False)))
    return calls


class PythonicToolParser:
    name = "pythonic"
    start_tag = "<|python_start|>"  # Llama 4; Llama 3.2 writes the list bare
    end_tag = "<|python_end|>"

    def __init__(self, max_calls: int | None = None, tools: list[dict] | None = None) -> None:
        self.max_calls = max_calls
        self.calls: list[CallDelta] = []
        self.failed = False
        self._state = _START
        # Text kept as pieces, joined once when needed (issue 37: ``+=`` copied it per piece).
        self._raw: list[str] = []  # everything read until the list closed: the content if it is no calls
        self._list: list[str] = []  # the list so far
        self._tail: list[str] = []  # text after the list (its end tag, whitespace, or content at the end)
        self._tag_at = -1  # START: -1 before the start tag; 0..len its characters matched; then whitespace
        self._depth = 0
        self._quote = ""  # the open string's quote ('' = not in a string)
        self._escape = False

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        if self._state == _CONTENT:
            out.content = text
            return out
        if self._state == _AFTER:
            self._tail.append(text)
            return out
        self._raw.append(text)
        start = 0
        if self._state == _START:
            start = self._read_head(text)
            if start < 0:
                return out  # nothing yet, or maybe the tag
            if self._state == _CONTENT:
                out.content = "".join(self._raw)
                return out
        scan = self._scan
        for i in range(start, len(text)):
            if scan(text[i]):  # the list closed
                self._list.append(text[start:i + 1])
                self._emit(out, text[i + 1:])
                return out
        self._list.append(text[start:] if start else text)
        return out

    def _read_head(self, text: str) -> int:
        """START: read whitespace, the start tag, whitespace, each character once; at the first
        other character, the state it decides (_LIST at a "[" outside the tag, else _CONTENT) and
        its offset; -1 while undecided."""
        tag = self.start_tag
        for i, ch in enumerate(text):
            if self._tag_at < 0 or self._tag_at == len(tag):  # whitespace around the tag
                if ch.isspace():
                    continue
                if self._tag_at < 0 and ch == tag[0]:
                    self._tag_at = 1
                    continue
                self._state = _LIST if ch == "[" else _CONTENT
                return i
            if ch != tag[self._tag_at]:
                self._state = _CONTENT
                return i
            self._tag_at += 1
        return -1

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if self._state in (_START, _LIST):  # no list, or one that never closed: the text as it was
            self.failed = self._state == _LIST
            out.content = "".join(self._raw)
        elif self._state == _AFTER:
            rest = "".join(self._tail).replace(self.end_tag, "")
            if rest.strip():
                out.content = rest
        return out

    # ---- internals ---------------------------------------------------------------------------

    def _scan(self, ch: str) -> bool:
        """Track strings and brackets; True when the outer list closes."""
        if self._quote:
            if self._escape:
                self._escape = False
            elif ch == "\\":
                self._escape = True
            elif ch == self._quote:
                self._quote = ""
            return False
        if ch in "'\"":
            self._quote = ch
        elif ch in "([{":
            self._depth += 1
        elif ch in ")]}":
            self._depth -= 1
            return self._depth == 0
        return False

    def _emit(self, out: ParsedDelta, rest: str) -> None:
        try:
            calls = parse_calls("".join(self._list))
        except PythonicCallError:
            self.failed = True
            self._state = _CONTENT
            out.content += "".join(self._raw)
            return
        self._state, self._tail = _AFTER, [rest]
        for name, arguments in calls if self.max_calls is None else calls[:self.max_calls]:
            call = CallDelta(len(self.calls), new_call_id(), name, arguments)
            self.calls.append(call)
            out.calls.append(call)
