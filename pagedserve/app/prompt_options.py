"""How a request's extra fields shape its prompt: the chat template's arguments (vLLM's
``chat_template``, ``chat_template_kwargs``, ``documents``, ``reasoning_effort``),
``truncate_prompt_tokens`` and chat ``echo``."""
from __future__ import annotations

from typing import Any

from pagedserve.app.errors import APIError
from pagedserve.app.protocol import ChatCompletionRequest

UNTRUSTED_TEMPLATE = ("Chat template is passed with request, but --trust-request-chat-template is "
                      "not set. Refused request with untrusted chat template.")


def chat_template_options(req: Any, trusted: bool) -> dict[str, Any]:
    """Arguments for ``render_chat`` beyond the messages. As in vLLM, ``chat_template_kwargs``
    come last and may set what the fields set (``add_generation_prompt``, ``documents``...)."""
    options: dict[str, Any] = {"add_generation_prompt": req.add_generation_prompt,
                               "continue_final_message": req.continue_final_message}
    if req.documents is not None:
        options["documents"] = req.documents
    if isinstance(req, ChatCompletionRequest) and req.reasoning_effort is not None:  # chat only
        options["reasoning_effort"] = req.reasoning_effort
    options.update(req.chat_template_kwargs or {})
    if req.chat_template is not None:
        if not trusted:
            raise APIError.bad_request(UNTRUSTED_TEMPLATE, param="chat_template")
        options["chat_template"] = req.chat_template
    return options


def check_truncate(keep: int | None, max_model_len: int) -> None:
    """``truncate_prompt_tokens`` leaves room for one generated token, as the schema says."""
    if keep is not None and keep >= max_model_len:
        raise APIError.bad_request(
            f"truncate_prompt_tokens must be below the context length ({max_model_len} tokens), "
            f"got {keep}", param="truncate_prompt_tokens")


# Tokens' worth of text kept before the last ``truncate_prompt_tokens`` tokens when a long text is
# cut before encoding: the cut lands inside a word, whose tokens then differ; the margin keeps
# that word out of the tokens kept.
TRUNCATION_MARGIN_TOKENS = 16


def fit_text(text: str, param: str, max_token_chars: int | None, max_model_len: int,
             keep: int | None = None, which: str = "the prompt") -> str:
    """The part of a text prompt worth encoding, before it is encoded (encoding holds the
    interpreter, ~0.75 s per MiB: a multi-MB text would freeze the event loop for seconds).

    No text longer than ``max_model_len x max_token_chars`` characters can fit the context
    (engine.tokenizer.Tokenizer.max_token_chars): such a text is a 400 naming the limit. With
    ``keep`` (``truncate_prompt_tokens``: the last ``keep`` tokens are kept) it is not refused: only
    its end that can still make those tokens is encoded, ``keep`` tokens plus a margin, in
    characters. ``max_token_chars`` None (a tokenizer that may drop characters): no bound."""
    if not max_token_chars:
        return text
    if keep is not None:
        window = (keep + TRUNCATION_MARGIN_TOKENS) * max_token_chars
        return text if len(text) <= window else text[-window:]
    bound = max_model_len * max_token_chars
    if len(text) > bound:
        raise APIError.bad_request(
            f"This model's maximum context length is {max_model_len} tokens (--max-model-len), and a "
            f"token stands for at most {max_token_chars} characters, so no text longer than {bound} "
            f"characters can fit. However, {which} has {len(text)} characters. Please shorten it, "
            "or set truncate_prompt_tokens to keep its end.", param=param, code="context_length_exceeded")
    return text


def truncate_prompt(ids: list[int], keep: int | None) -> list[int]:
    """vLLM's ``truncate_prompt_tokens``: the last ``keep`` tokens (left truncation)."""
    return ids if keep is None or len(ids) <= keep else ids[-keep:]


def chat_echo_text(req: Any) -> str:
    """vLLM's chat ``echo``: the reply starts with the last message's content when that message
    is the assistant's (the role the reply has), else with nothing."""
    if not req.echo or not req.messages or req.messages[-1].role != "assistant":
        return ""
    return req.messages[-1].text()
