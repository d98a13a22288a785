"""Tool-call parsers: model text in, content and tool-call deltas out, incrementally.

Every parser has ``feed(text) -> ParsedDelta`` for each new piece of the reply and
``finish() -> ParsedDelta`` at its end; ``failed`` says the reply did not hold well-formed calls.
A non-streamed answer is the sum of the same deltas (``parse_whole``), so the two agree.

- ``HermesToolParser`` (``--tool-call-parser hermes``; Qwen 2.5/3, Hermes, SmolLM3-style
  templates): calls are ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; text
  outside them is content. Text that may be the start of ``<tool_call>`` is held back until it
  is clear; whitespace between and after calls is dropped.
- ``Llama3JsonToolParser`` (``--tool-call-parser llama3_json``; Llama 3.1/3.2): a reply of
  ``{"name": ..., "parameters": {...}}`` objects, optionally after ``<|python_tag|>``.
- ``mistral``, ``pythonic`` (Llama 3.2 / 4), ``qwen3_coder``: app/tools/mistral_parser.py,
  pythonic_parser.py, qwen3_coder_parser.py.
- ``RequiredCallsParser``: ``tool_choice: "required"``, output constrained to
  ``[{"name": ..., "parameters": {...}}, ...]`` (vLLM's form).
- ``NamedCallParser``: ``tool_choice`` naming a function, output constrained to its arguments.
"""
from __future__ import annotations

from pagedserve.app.partial_tags import find_split, held_prefix, joined as _joined, last as _last
from pagedserve.app.tools.calls import CallDelta, CallTracker, ParsedDelta, TrackedCall, new_call_id
from pagedserve.app.tools.json_scan import JsonScanError

_OUTSIDE, _INSIDE, _AFTER = range(3)


class HermesToolParser:
    name = "hermes"
    start_tag = "<tool_call>"
    end_tag = "</tool_call>"

    def __init__(self, max_calls: int | None = None, tools: list[dict] | None = None) -> None:
        self.max_calls = max_calls
        self.calls: list[TrackedCall] = []
        self.failed = False
        self._state = _OUTSIDE
        self._pending = ""  # outside text not released (may start the start tag)
        self._ws_held: list[str] = []  # whitespace after a call, released only if text follows it
        self._tracker: CallTracker | None = None
        self._block: list[str] = []  # raw text of the current block, for the fallback to content
        self._after = ""  # after a call: the start of the end tag read so far (whitespace dropped)

    def feed(self, text: str) -> ParsedDelta:
        """Linear in ``text`` (issue 37): the piece is read by offsets, never copied from an
        offset to its end, and nothing held is copied again."""
        out = ParsedDelta()
        if self.failed:
            out.content = text
            return out
        content: list[str] = []
        prefix, self._pending = self._pending, ""  # read before text[i:]: short (a tag's start)
        i, n = 0, len(text)
        while prefix or i < n:
            if self._state == _OUTSIDE:
                at = find_split(prefix, text, i, self.start_tag)
                if at >= 0:
                    self._drain(out)  # the previous call's last pieces, before its tracker goes
                    self._content(_joined(prefix, text, i, at), content)
                    i += at + len(self.start_tag) - len(prefix)  # the tag ends in text: prefix is shorter
                    prefix = ""
                    self._state = _INSIDE
                    self._block = [self.start_tag]
                    self._tracker = CallTracker(self.calls, max_calls=self.max_calls)
                else:
                    tail = _last(prefix, text, i, len(self.start_tag) - 1)
                    hold = held_prefix(tail, self.start_tag)
                    self._content(_joined(prefix, text, i, len(prefix) + n - i - hold), content)
                    self._pending = tail[len(tail) - hold:]
                    prefix, i = "", n
            elif self._state == _INSIDE:
                start = self._tracker.scanner.pos
                try:
                    k = self._tracker.feed_until_done(text, i)
                except JsonScanError:
                    k = self._tracker.scanner.pos - start
                    self._block.append(text[i:i + k + 1])
                    self._fail(out, content, text[i + k + 1:], text[i + k])
                    out.content = "".join(content)
                    return out
                self._block.append(text[i:i + k])
                i += k
                if self._tracker.done:
                    self._state, self._after = _AFTER, ""
            else:  # _AFTER: whitespace, then the end tag (or, leniently, anything else)
                if not self._after:
                    while i < n and text[i].isspace():
                        i += 1
                    if i == n:
                        break
                need = self.end_tag[len(self._after):]
                if text.startswith(need, i):
                    self._state, self._after = _OUTSIDE, ""
                    i += len(need)
                elif i + len(need) > n and need.startswith(text[i:]):
                    self._after += text[i:]  # still the start of the end tag
                    i = n
                else:
                    self._state = _OUTSIDE
                    prefix, self._after = self._after, ""
        self._drain(out)
        out.content = "".join(content)
        return out

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if self.failed:
            return out
        content: list[str] = []
        if self._state == _OUTSIDE:
            self._content(self._pending, content)
            self._pending = ""
        elif self._state == _INSIDE:  # the reply ended inside a call's JSON
            self._fail(out, content, "", "")
        self._drain(out)
        out.content = "".join(content)
        return out

    # ---- internals ---------------------------------------------------------------------------

    def _content(self, text: str, content: list[str]) -> None:
        if not text:
            return
        if self.calls and not text.strip():
            self._ws_held.append(text)
            return
        content.extend(self._ws_held)
        content.append(text)
        self._ws_held = []

    def _drain(self, out: ParsedDelta) -> None:
        if self._tracker is not None:
            self._tracker.drain(out.calls)

    def _fail(self, out: ParsedDelta, content: list[str], rest: str, bad: str) -> None:
        """Malformed call: from here on everything is content. A call not yet announced goes out
        as the text it was; one already announced cannot be taken back and ends where it is."""
        self.failed = True
        self._drain(out)
        announced = self._tracker.header_sent()
        content.extend(self._ws_held)
        content.extend([bad] if announced else self._block)
        content.append(rest)
        self._ws_held = []
        for c in self._tracker.mine:
            c.finished = True


class RequiredCallsParser:
    """``[{"name": ..., "parameters": {...}}, ...]`` (constrained by the grammar)."""

    name = "required"

    def __init__(self, max_calls: int | None = None) -> None:
        self.calls: list[TrackedCall] = []
        self.failed = False
        self._tracker = CallTracker(self.calls, call_depth=2, arg_keys=("parameters", "arguments"),
                                    max_calls=max_calls)

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        if self.failed:
            out.content = text
            return out
        try:
            self._tracker.feed(text)
        except JsonScanError:
            self.failed = True
        self._tracker.drain(out.calls)
        return out

    def finish(self) -> ParsedDelta:
        if not self._tracker.done:
            self.failed = True
        return ParsedDelta()


class NamedCallParser:
    """The whole reply is the arguments of the named function (constrained by the grammar)."""

    def __init__(self, function_name: str) -> None:
        self.function_name = function_name
        self.calls: list[CallDelta] = []
        self.failed = False

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        if not self.calls:
            text = text.lstrip()
            if not text:
                return out
            self.calls.append(CallDelta(0, new_call_id(), self.function_name, text))
            out.calls.append(self.calls[0])
        elif text:
            out.calls.append(CallDelta(0, arguments=text))
        return out

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if not self.calls:  # an empty reply: still a call, with empty arguments
            self.calls.append(CallDelta(0, new_call_id(), self.function_name, ""))
            out.calls.append(self.calls[0])
        return out


class Llama3JsonToolParser:
    """Llama 3.1/3.2 JSON tool calls (``--tool-call-parser llama3_json``): a reply that is
    ``{"name": ..., "parameters": {...}}`` objects (optionally after ``<|python_tag|>``, separated
    by ``;``) is calls; any other reply is content."""

    name = "llama3_json"
    python_tag = "<|python_tag|>"
    start_tag = None  # the reply is read the same with or without the python tag

    def __init__(self, max_calls: int | None = None, tools: list[dict] | None = None) -> None:
        self.max_calls = max_calls
        self.calls: list[TrackedCall] = []
        self.failed = False
        self._mode = "start"  # start | calls | content
        self._head: list[str] = []  # the reply while undecided (whitespace, the python tag)
        self._tag_at = -1  # -1: before the tag; 0..len: its characters matched; then whitespace
        self._tracker: CallTracker | None = None

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        i = 0
        if self._mode == "start":
            i = self._read_head(text)
            if i < 0:
                return out  # still undecided
            if self._mode == "content":
                self._head.append(text)
                out.content = "".join(self._head)
                return out
        if self._mode == "content" or self.failed:
            out.content += text
            return out
        n = len(text)
        while i < n:
            if self._tracker is None or self._tracker.done:
                if text[i] in " \t\n\r;":
                    i += 1
                    continue
                if text[i] != "{":
                    self._fail(out, text[i:])
                    return out
                if self._tracker is not None:
                    self._tracker.drain(out.calls)
                self._tracker = CallTracker(self.calls, arg_keys=("parameters", "arguments"),
                                            max_calls=self.max_calls)
            start = self._tracker.scanner.pos
            try:
                i += self._tracker.feed_until_done(text, i)
            except JsonScanError:
                self._fail(out, text[i + self._tracker.scanner.pos - start + 1:])
                return out
        self._tracker.drain(out.calls)
        return out

    def _read_head(self, text: str) -> int:
        """Read the undecided start (whitespace, the python tag, whitespace) one character at a
        time, each once; at its first other character, the mode it decides ("calls" at a ``{``
        outside the tag, else "content") and that character's offset in ``text``; -1 while
        undecided."""
        tag = self.python_tag
        for i, ch in enumerate(text):
            if self._tag_at < 0 or self._tag_at == len(tag):  # whitespace around the tag
                if ch.isspace():
                    continue
                if self._tag_at < 0 and ch == tag[0]:
                    self._tag_at = 1
                    continue
                self._mode = "calls" if ch == "{" else "content"
                return i
            if ch != tag[self._tag_at]:
                self._mode = "content"
                return i
            self._tag_at += 1
        self._head.append(text)
        return -1

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if self._mode == "start":
            out.content = "".join(self._head)
        elif self._mode == "calls" and not self.failed and not self._tracker.done:
            self._fail(out, "")
        return out

    def _fail(self, out: ParsedDelta, rest: str) -> None:
        self.failed = True
        if self._tracker is not None:
            self._tracker.drain(out.calls)
            for c in self._tracker.mine:
                c.finished = True
        out.content += rest


def _auto_parsers() -> dict[str, type]:
    from pagedserve.app.tools.mistral_parser import MistralToolParser
    from pagedserve.app.tools.pythonic_parser import PythonicToolParser
    from pagedserve.app.tools.qwen3_coder_parser import Qwen3CoderToolParser

    return {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser, "mistral": MistralToolParser,
            "pythonic": PythonicToolParser, "qwen3_coder": Qwen3CoderToolParser}


# --tool-call-parser: each takes (max_calls=, tools=) and has ``start_tag``, the special token
# (if any) a reply's calls start with, which the detokenizer must then keep.
AUTO_PARSERS = _auto_parsers()


def parse_whole(parser, text: str) -> tuple[str, list[dict]]:
    """Non-streamed result: (content, tool calls in OpenAI's message form). A call's arguments
    may come in many pieces (qwen3_coder: one a parameter): joined once."""
    content, calls, pieces = "", {}, {}
    for delta in (parser.feed(text), parser.finish()):
        content += delta.content
        for d in delta.calls:
            if d.id is not None:
                calls[d.index] = {"id": d.id, "type": "function", "function": {"name": d.name}}
                pieces[d.index] = [d.arguments]
            else:
                pieces[d.index].append(d.arguments)
    for i, call in calls.items():
        call["function"]["arguments"] = "".join(pieces[i])
    return content, [calls[i] for i in sorted(calls)]
