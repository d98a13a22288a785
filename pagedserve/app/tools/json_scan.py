"""An incremental JSON validator that reports where each tool call's fields start and end.

Tool-call output arrives a few characters at a time and its arguments must be streamed as they
come, yet only text that is still a valid JSON prefix may leave as arguments, and the server must
know the moment a call's ``name`` is complete. ``JsonScanner`` reads one JSON value character by
character (a strict JSON grammar: strings with escapes, numbers, literals, nesting) and calls its
listener for the "call objects" at ``call_depth`` (1: the value itself is the call, as in
``<tool_call>{...}</tool_call>``; 2: the value is an array of calls, as constrained output for
``tool_choice: required``). Positions are character offsets in everything fed so far.
"""
from __future__ import annotations

from typing import Protocol

WHITESPACE = " \t\n\r"
_OBJ, _ARR = 0, 1
# object states / array states
_KEY_OR_END, _KEY, _COLON, _VALUE, _COMMA_OR_END, _VALUE_OR_END = range(6)
_ESCAPES = '"\\/bfnrtu'
_HEX = "0123456789abcdefABCDEF"
_DIGITS = "0123456789"
# number states; the ones a number may end in
_N_MINUS, _N_ZERO, _N_INT, _N_DOT, _N_FRAC, _N_E, _N_ESIGN, _N_EXP = range(8)
_N_FINAL = {_N_ZERO, _N_INT, _N_FRAC, _N_EXP}


class JsonScanError(ValueError):
    """The text is not (a prefix of) a JSON value of the expected shape."""


class CallListener(Protocol):
    def call_start(self, pos: int) -> None: ...
    def call_key(self, key: str) -> None: ...
    def value_start(self, pos: int) -> None: ...
    def value_end(self, pos: int) -> None: ...
    def call_end(self, pos: int) -> None: ...


class JsonScanner:
    """Feed text with ``feed``; ``done`` once the value is complete (trailing whitespace allowed,
    anything else raises). ``pos`` = characters consumed."""

    def __init__(self, listener: CallListener, call_depth: int = 1) -> None:
        self.listener = listener
        self.call_depth = call_depth
        self.stack: list[list[int]] = []  # [kind, state] per open container
        self.pos = 0
        self.done = False
        self.started = False
        # the scalar being read: None, "s" (string), "n" (number), "l" (literal)
        self._tok: str | None = None
        self._is_key = False
        self._key_chars: list[str] = []
        self._escape = 0  # 0 = none, 1 = after backslash, 2..5 = reading \\u hex digits
        self._num = 0
        self._lit = ""
        self._lit_at = 0

    def feed(self, text: str, start: int = 0) -> None:
        """Read ``text[start:]`` (an offset, not a slice: a parser reading many calls from one
        piece must not copy the rest of it for each)."""
        char = self._char
        for i in range(start, len(text)):
            char(text[i])
            self.pos += 1

    def feed_until_done(self, text: str, start: int = 0) -> int:
        """Feed ``text[start:]`` until the value is complete; return how many characters were
        read (on a JsonScanError, ``pos`` is the offending character's position)."""
        char = self._char
        i, end = start, len(text)
        while i < end and not self.done:
            char(text[i])
            self.pos += 1
            i += 1
        return i - start

    # ---- internals ---------------------------------------------------------------------------

    def _char(self, ch: str) -> None:
        tok = self._tok
        if tok == "s":
            self._string_char(ch)
            return
        if tok == "n":
            if self._number_char(ch):
                return
            self._tok = None
            self._value_done(self.pos)  # the number ended just before ch; ch is read below
        elif tok == "l":
            if ch != self._lit[self._lit_at]:
                raise JsonScanError(f"invalid literal at {self.pos}")
            self._lit_at += 1
            if self._lit_at == len(self._lit):
                self._tok = None
                self._value_done(self.pos + 1)
            return
        if ch in WHITESPACE:
            return
        if self.done:
            raise JsonScanError(f"text after the JSON value at {self.pos}")
        if not self.stack:
            self._start_value(ch)
            return
        ctx = self.stack[-1]
        kind, state = ctx
        if kind == _OBJ:
            if state == _KEY_OR_END or state == _KEY:
                if ch == '"':
                    self._start_string(is_key=True)
                elif ch == "}" and state == _KEY_OR_END:
                    self._close()
                else:
                    raise JsonScanError(f"expected a key at {self.pos}")
            elif state == _COLON:
                if ch != ":":
                    raise JsonScanError(f"expected ':' at {self.pos}")
                ctx[1] = _VALUE
            elif state == _VALUE:
                self._start_value(ch)
            else:  # _COMMA_OR_END
                if ch == ",":
                    ctx[1] = _KEY
                elif ch == "}":
                    self._close()
                else:
                    raise JsonScanError(f"expected ',' or '}}' at {self.pos}")
        else:
            if state == _VALUE_OR_END and ch == "]":
                self._close()
            elif state == _VALUE_OR_END or state == _VALUE:
                self._start_value(ch)
            elif ch == ",":
                ctx[1] = _VALUE
            elif ch == "]":
                self._close()
            else:
                raise JsonScanError(f"expected ',' or ']' at {self.pos}")

    def _start_value(self, ch: str) -> None:
        depth = len(self.stack)
        self.started = True
        if depth == self.call_depth - 1 and ch != "{":
            raise JsonScanError(f"expected a JSON object at {self.pos}")
        if depth == 0 and self.call_depth == 2 and ch != "[":
            raise JsonScanError(f"expected a JSON array at {self.pos}")
        if depth == self.call_depth:
            self.listener.value_start(self.pos)
        if ch == "{":
            self.stack.append([_OBJ, _KEY_OR_END])
            if depth + 1 == self.call_depth:
                self.listener.call_start(self.pos)
        elif ch == "[":
            self.stack.append([_ARR, _VALUE_OR_END])
        elif ch == '"':
            self._start_string(is_key=False)
        elif ch == "-" or ch in _DIGITS:
            self._tok = "n"
            self._num = _N_MINUS if ch == "-" else (_N_ZERO if ch == "0" else _N_INT)
        elif ch in "tfn":
            self._tok = "l"
            self._lit = {"t": "true", "f": "false", "n": "null"}[ch]
            self._lit_at = 1
        else:
            raise JsonScanError(f"unexpected {ch!r} at {self.pos}")

    def _start_string(self, is_key: bool) -> None:
        self._tok = "s"
        self._is_key = is_key
        self._escape = 0
        if is_key:
            self._key_chars = ['"']

    def _string_char(self, ch: str) -> None:
        if self._is_key:
            self._key_chars.append(ch)
        if self._escape == 1:
            if ch not in _ESCAPES:
                raise JsonScanError(f"invalid escape at {self.pos}")
            self._escape = 2 if ch == "u" else 0
            return
        if self._escape >= 2:
            if ch not in _HEX:
                raise JsonScanError(f"invalid \\u escape at {self.pos}")
            self._escape = 0 if self._escape == 5 else self._escape + 1
            return
        if ch == "\\":
            self._escape = 1
        elif ch == '"':
            self._tok = None
            if self._is_key:
                self.stack[-1][1] = _COLON
                if len(self.stack) == self.call_depth:
                    import json

                    self.listener.call_key(json.loads("".join(self._key_chars)))
            else:
                self._value_done(self.pos + 1)
        elif ord(ch) < 0x20:
            raise JsonScanError(f"control character in a string at {self.pos}")

    def _number_char(self, ch: str) -> bool:
        """True if ch continues the number; False if the number ended before ch."""
        s = self._num
        digit = ch in _DIGITS
        if s == _N_MINUS:
            if not digit:
                raise JsonScanError(f"invalid number at {self.pos}")
            self._num = _N_ZERO if ch == "0" else _N_INT
        elif s in (_N_ZERO, _N_INT, _N_FRAC) and ch in "eE":
            self._num = _N_E
        elif s in (_N_ZERO, _N_INT) and ch == ".":
            self._num = _N_DOT
        elif s == _N_INT and digit:
            pass
        elif s in (_N_DOT, _N_FRAC) and digit:
            self._num = _N_FRAC
        elif s == _N_E and ch in "+-":
            self._num = _N_ESIGN
        elif s in (_N_E, _N_ESIGN, _N_EXP) and digit:
            self._num = _N_EXP
        elif s in _N_FINAL:
            return False
        else:
            raise JsonScanError(f"invalid number at {self.pos}")
        return True

    def _close(self) -> None:
        self.stack.pop()
        if len(self.stack) + 1 == self.call_depth:
            self.listener.call_end(self.pos + 1)
        self._value_done(self.pos + 1)

    def _value_done(self, end: int) -> None:
        if not self.stack:
            self.done = True
            return
        ctx = self.stack[-1]
        ctx[1] = _COMMA_OR_END
        if len(self.stack) == self.call_depth:
            self.listener.value_end(end)
