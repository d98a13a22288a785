"""Reasoning parsers: model text in, reasoning and answer (content) out, incrementally.

A reasoning model writes its thinking between ``<think>`` and ``</think>``, then the answer. The
parser is fed each new piece of the reply (tags may be split across pieces: ``"<th"``, ``"ink>"``)
and holds back only text that may still turn out to be a tag. As vLLM's parsers of the same names:

- ``deepseek_r1``: the reply starts inside the reasoning (DeepSeek-R1's and QwQ's templates open
  ``<think>`` in the prompt); a leading ``<think>`` is dropped; everything up to ``</think>`` is
  reasoning, the rest is the answer. A reply without ``</think>`` is all reasoning.
- ``qwen3``: reasoning only when the reply holds both tags (``<think>`` at its start, leading
  whitespace aside); a reply that does not open with ``<think>`` is all answer, and so, when not
  streamed, is one whose ``</think>`` never comes (streamed, reasoning already sent stays sent).

Where the prompt the template rendered settles it, it wins over those defaults: a prompt that ends
inside an open ``<think>`` starts the reply in the reasoning (both parsers); one whose last tag is
``</think>`` (Qwen3 with ``enable_thinking: false`` writes ``<think>\\n\\n</think>``) starts it in the
answer, and no reasoning is looked for.
"""
from __future__ import annotations

from dataclasses import dataclass

from pagedserve.app.partial_tags import held_prefix

START_TAG = "<think>"
END_TAG = "</think>"

_LEAD, _REASONING, _CONTENT = range(3)  # before anything is known, inside the thinking, the answer


@dataclass(slots=True)
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""

    def __iadd__(self, other: "ReasoningDelta") -> "ReasoningDelta":
        self.reasoning += other.reasoning
        self.content += other.content
        return self



def prompt_state(prompt: str | None) -> str | None:
    """What the rendered prompt says about the reply: "open" (it ends inside ``<think>``),
    "closed" (its last think tag is ``</think>``, with only whitespace after it: thinking off), or
    None (it says nothing: the parser's default applies)."""
    if not prompt:
        return None
    start, end = prompt.rfind(START_TAG), prompt.rfind(END_TAG)
    if start > end:
        return "open"
    if end >= 0 and not prompt[end + len(END_TAG):].strip():
        return "closed"
    return None


class ReasoningParser:
    """One reply's parser. ``feed(text)`` for each new piece, ``finish()`` at its end; each returns
    what can be released. ``ended``: the reasoning is over (everything after is the answer)."""

    name = ""
    starts_in_reasoning = False  # the parser's default when the prompt does not settle it

    def __init__(self, prompt: str | None = None) -> None:
        state = prompt_state(prompt)
        if state == "open" or (state is None and self.starts_in_reasoning):
            self._state = _REASONING
            self._lead_ok = True  # a leading "<think>" is still dropped (the model repeated it)
        elif state == "closed":
            self._state = _CONTENT
            self._lead_ok = False
        else:
            self._state = _LEAD
            self._lead_ok = True
        self._pending = ""  # text held back: it may be (the start of) a tag
        # Leading whitespace held back with it, as its pieces: a reply of whitespace streamed a
        # few characters at a time was copied whole for each (issue 37).
        self._lead_ws: list[str] = []
        self.saw_reasoning = self._state == _REASONING  # the reply has a reasoning part (maybe empty)

    @property
    def ended(self) -> bool:
        return self._state == _CONTENT

    def feed(self, text: str) -> ReasoningDelta:
        out = ReasoningDelta()
        if self._lead_ok and text.isspace() and (self._lead_ws or self._pending.isspace()):
            if not self._lead_ws:
                self._lead_ws.append(self._pending)
                self._pending = ""
            self._lead_ws.append(text)  # still only whitespace: kept as pieces, not copied again
            return out
        if self._lead_ws:
            self._pending = "".join(self._lead_ws) + self._pending
            self._lead_ws = []
        buf = self._pending + text
        self._pending = ""
        while buf:
            if self._state == _CONTENT:
                out.content += buf
                break
            if self._lead_ok:  # whitespace, then maybe "<think>"
                head = buf.lstrip()
                if head.startswith(START_TAG):
                    buf = head[len(START_TAG):]
                    self._lead_ok = False
                    self._state = _REASONING
                    self.saw_reasoning = True
                    continue
                if not head or START_TAG.startswith(head):
                    self._pending = buf  # not known yet
                    break
                self._lead_ok = False
                if self._state == _LEAD:  # qwen3: the reply does not open with <think>
                    self._state = _CONTENT
                    continue
            at = buf.find(END_TAG)
            if at >= 0:
                out.reasoning += buf[:at]
                self._state = _CONTENT
                buf = buf[at + len(END_TAG):]
                continue
            hold = held_prefix(buf, END_TAG)
            out.reasoning += buf[:len(buf) - hold]
            self._pending = buf[len(buf) - hold:]
            break
        return out

    def finish(self) -> ReasoningDelta:
        """The reply ended: what was held back goes where it was headed."""
        out = ReasoningDelta()
        pending, self._pending = "".join(self._lead_ws) + self._pending, ""
        self._lead_ws = []
        if self._state == _REASONING:
            out.reasoning = pending
        else:
            out.content = pending
        return out

    def parse_whole(self, text: str) -> tuple[str | None, str]:
        """Non-streamed: (reasoning or None, content)."""
        out = self.feed(text)
        out += self.finish()
        return (out.reasoning if self.saw_reasoning else None), out.content


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    starts_in_reasoning = True


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
    starts_in_reasoning = False

    def parse_whole(self, text: str) -> tuple[str | None, str]:
        """vLLM's qwen3 rule: without the closing tag, the reply is all answer."""
        opened_by_prompt = self._state == _REASONING
        reasoning, content = super().parse_whole(text)
        if reasoning is not None and not self.ended and not opened_by_prompt:
            return None, text
        return reasoning, content


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "qwen3": Qwen3ReasoningParser,
}
