"""What ``--reasoning-parser`` means for one request: ``ReasoningPlan``, and the reply split into
reasoning and answer for the chat (and responses) routes. Tool calls and the answer's fields are
made from the answer part only."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedserve.app.reasoning.parser import END_TAG, REASONING_PARSERS, START_TAG, ReasoningDelta, ReasoningParser, prompt_state

if TYPE_CHECKING:
    from pagedserve.engine.client import TokenizerClient


@dataclass(frozen=True)
class ReasoningPlan:
    """``parser_name`` None: no parser (the reply is all content, as before)."""

    parser_name: str | None = None
    prompt: str | None = None  # the rendered prompt: it may open or close the thinking
    include: bool = True  # vLLM's include_reasoning: false leaves the reasoning out of the response

    @property
    def active(self) -> bool:
        return self.parser_name is not None

    def new_parser(self) -> ReasoningParser:
        return REASONING_PARSERS[self.parser_name](self.prompt)

    def fields(self, reasoning: str) -> dict[str, str]:
        """The message / delta fields of some reasoning text: vLLM's ``reasoning_content`` and its
        newer name ``reasoning``."""
        if not self.include or not reasoning:
            return {}
        return {"reasoning_content": reasoning, "reasoning": reasoning}


def check_parser_name(name: str | None) -> None:
    if name is not None and name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of {sorted(REASONING_PARSERS)}")


def grammar_start(plan: ReasoningPlan) -> str | None:
    """Where a request's grammar (structured outputs, tool_choice required / named) starts to bind:
    after the end of the thinking (``</think>``), so that it constrains the answer only; None =
    from the first token (no parser, or the prompt closed the thinking: Qwen3 with
    ``enable_thinking: false``). A reply that never closes its thinking is never constrained."""
    if not plan.active or prompt_state(plan.prompt) == "closed":
        return None
    return END_TAG


def keeps_special_tokens(plan: ReasoningPlan, tokenizer: TokenizerClient) -> bool:
    """Must the reply keep special tokens for the parser to see the think tags?"""
    if not plan.active or not tokenizer.all_special_ids:
        return False
    return any(tokenizer.token_to_id(tag) in tokenizer.all_special_ids for tag in (START_TAG, END_TAG))


def split_whole(plan: ReasoningPlan, text: str) -> tuple[str | None, str]:
    """Non-streamed: (reasoning or None, answer)."""
    if not plan.active:
        return None, text
    return plan.new_parser().parse_whole(text)


class ReasoningDeltas:
    """One streamed choice: each text delta → (reasoning piece, answer piece)."""

    def __init__(self, plan: ReasoningPlan) -> None:
        self.parser = plan.new_parser()

    def split(self, text: str, finished: bool) -> ReasoningDelta:
        out = self.parser.feed(text) if text else ReasoningDelta()
        if finished:
            out += self.parser.finish()
        return out
