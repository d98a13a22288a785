"""The chat route's reply as plain pieces, for the front doors that speak another API on the chat
route's path (app/anthropic_api, app/ollama_api): a conversation of theirs becomes a chat
completions body, runs through ``ChatRoute.start`` (admission, template, tools, reasoning split,
sampling, the engine call), and the one choice's output comes back here split into reasoning
text, answer text and tool-call deltas, in order. Each API then writes its own shapes."""
from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request

from pagedserve.app.admission import check_body
from pagedserve.app.chat_route import ChatRoute, ChatStart
from pagedserve.app.protocol import ChatCompletionRequest, parse
from pagedserve.app.reasoning.output import ReasoningDeltas
from pagedserve.app.tools.calls import CallDelta, ParsedDelta


@dataclass(slots=True)
class Piece:
    kind: str  # "thinking" | "text" | "call"
    text: str = ""
    call: CallDelta | None = None


async def start_chat(chat: ChatRoute, request: Request, body: dict[str, Any], id_prefix: str) -> ChatStart:
    """The translated body through the chat admission bounds (app/admission.py) and the chat route."""
    check_body("chat", body, chat.checks.limits, chat.engine.tokenizer.vocab_size, chat.engine.max_model_len)
    req = parse(ChatCompletionRequest, body)
    return await chat.start(request, req, id_prefix)


async def read_body(chat: ChatRoute, request: Request) -> Any:
    """The decoded body within --max-body-bytes (the chat bounds are checked on its translation)."""
    return await chat.checks.read_json(request)


class ChatPieces:
    """One started conversation (one choice) read as pieces; after the last one its counts and
    finish are known. Times are ``time.monotonic_ns`` (Ollama reports durations in ns)."""

    def __init__(self, run: ChatStart, chat: ChatRoute) -> None:
        self.run = run
        self.fanout = chat.fanout
        self.called = False
        self.start_ns = time.monotonic_ns()
        self.first_token_ns: int | None = None
        self.end_ns: int | None = None

    @property
    def choice(self) -> Any:
        return self.run.choices[0]

    @property
    def prompt_tokens(self) -> int:
        return len(self.choice.prompt_ids)

    @property
    def output_tokens(self) -> int:
        return len(self.choice.token_ids)

    @property
    def finish_reason(self) -> str | None:
        """The engine's ("stop", "length", ...) or "tool_calls" when the reply called a tool."""
        if self.called and self.choice.finish_reason in ("stop", None):
            return "tool_calls"
        return self.choice.finish_reason

    async def pieces(self) -> AsyncIterator[Piece]:
        plan, reasoning = self.run.plan, self.run.reasoning
        thinking = ReasoningDeltas(reasoning) if reasoning.active else None
        parser = plan.new_parser() if plan.active else None
        async for c, comp, new_ids in self.fanout.run(self.run.choices, self.run.streams):
            if self.first_token_ns is None and new_ids:
                self.first_token_ns = time.monotonic_ns()
            finished = c.finish_reason is not None
            text = comp.text
            if thinking is not None:
                split = thinking.split(text, finished)
                text = split.content
                if split.reasoning and reasoning.include:
                    yield Piece("thinking", split.reasoning)
            if parser is None:
                if text:
                    yield Piece("text", text)
                continue
            d = parser.feed(text) if text else ParsedDelta()
            if finished:
                tail = parser.finish()
                d.content += tail.content
                d.calls += tail.calls
            if d.content:
                yield Piece("text", d.content)
            for call in d.calls:
                self.called = True
                yield Piece("call", call=call)
        self.end_ns = time.monotonic_ns()
