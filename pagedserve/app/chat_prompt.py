"""A conversation to a prompt: messages (and tools) through the chat template, then tokenized.
The chat route and /tokenize with messages share it."""
from __future__ import annotations

import asyncio
from typing import Any

from pagedserve.app.errors import APIError
from pagedserve.app.request_checks import RequestChecks
from pagedserve.app.tools import prompt as tool_prompt
from pagedserve.engine.client import EngineClient


class ChatPrompts:
    """Renders and tokenizes conversations on the engine (off its loop), bounded by ``checks``."""

    def __init__(self, engine: EngineClient, checks: RequestChecks) -> None:
        self.engine = engine
        self.checks = checks

    async def template_messages(self, messages: list[Any], tools: list[dict] | None = None,
                                chat_template: str | None = None) -> tuple[list[dict], list[dict] | None]:
        """The conversation and the ``tools`` variable for the chat template (the request's own
        ``chat_template`` or the model's): tools and tool-call turns natively when the template
        knows tools, else written out (app/tools/prompt.py). A request's own template is parsed
        for that off the event loop (parsing takes about 3 s per MB of template)."""
        if chat_template is not None and "tools" in chat_template:
            native = await asyncio.to_thread(tool_prompt.template_knows_tools, chat_template)
        else:
            native = tool_prompt.template_knows_tools(chat_template or self.engine.tokenizer.chat_template)
        out = tool_prompt.template_messages(messages, native)
        if tools and not native:
            return tool_prompt.with_default_tool_prompt(out, tools), None
        return out, tools or None

    async def chat_prompt(self, messages: list[dict[str, str]], add_generation_prompt: bool,
                          continue_final_message: bool, add_special_tokens: bool = False,
                          template_options: dict[str, Any] | None = None,
                          tools: list[dict] | None = None, bounded: bool = False,
                          keep: int | None = None) -> tuple[str | None, list[int]]:
        """``template_options`` (app/prompt_options.py) may override the two flags, as vLLM's
        chat_template_kwargs do; ``tools``: the template's tools variable (app/tools/prompt.py).
        ``bounded``: the rendered text must fit the context (a 400 before it is tokenized), or
        with ``keep`` (truncate_prompt_tokens) only its end is tokenized (the text is then None)."""
        from jinja2 import TemplateError

        template_options = dict(template_options or {})
        template_options.setdefault("add_generation_prompt", add_generation_prompt)
        template_options.setdefault("continue_final_message", continue_final_message)
        if tools:
            template_options["tools"] = tools
        try:
            text = await self.engine.render_chat(messages, **template_options)
        except (TemplateError, ValueError) as e:
            param = "chat_template" if "chat_template" in template_options else "messages"
            raise APIError.bad_request(f"the chat template could not render these messages: {e}",
                                       param=param) from None
        if bounded:
            fitted = self.checks.fit_text(text, "messages", keep, "the conversation rendered by the chat template")
            text = text if fitted is text else None
        else:
            fitted = text
        ids = await self.engine.encode(fitted, add_special_tokens=add_special_tokens)
        return text, list(ids)
