"""Admission before work: what one request may ask for, checked before anything is built for it.

The routes and the engine loop share one event loop, so a request that may ask for unbounded
work (tens of thousands of stop strings, a prompt list times ``n`` of 256,000 choices) freezes
every other user while it is prepared. Each bound here is a server flag (``AdmissionLimits``:
one name for the field and the flag, ``--max-stop-sequences`` = ``max_stop_sequences``) and a
request past one gets a 400 in OpenAI's format naming the field, the limit and the flag.

Two checks, each linear in what it reads:

- ``check_body`` on the decoded JSON body, before the request model validates it: list lengths
  (prompts, ``stop``, ``stop_token_ids``, ``bad_words``, ``logit_bias``, ``messages``, ``tools``),
  string lengths (each ``stop`` string and bad word and all of them together, names and ids, the
  size of ``tools``, a request's ``chat_template``: issue 37), ``logit_bias`` keys in the
  vocabulary (as OpenAI and vLLM), logprob counts (vLLM's ``--max-logprobs``);
- ``check_choices`` (prompts x max(n, best_of / beam width), before any prompt is tokenized) and
  ``check_commitment`` (choices x (prompt + max_tokens), before ``make_choices``).

The same bounds are published in /openapi.json (app/openapi.py fills the ``LIMIT_KEY`` markers
of the request models with these values).
"""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any

import orjson

from pagedserve.app.errors import APIError
from pagedserve.contracts.config import ModelConfig

LIMIT_CODE = "limit_exceeded"  # one field past its bound (the schema states it)
# a rule across fields past its bound (prompts x n, the token commitment): the schema cannot state it
REQUEST_LIMIT_CODE = "request_limit_exceeded"


def _limit(default: int, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True, slots=True)
class AdmissionLimits:
    """Per-request bounds of the server (``serve --help`` lists each as ``--max-...``)."""

    # The engine's own limit (contracts.config.ModelConfig.max_logprobs): its flag is the engine's
    # --max-logprobs (app/engine_args.py), read here under the same name; -1 = no cap.
    max_logprobs: int = field(default=ModelConfig().max_logprobs, metadata={
        "help": "most logprobs / top_logprobs / prompt_logprobs a request may ask for", "engine": True})
    max_prompts: int = _limit(1024, "prompts in one /v1/completions request")
    max_request_choices: int = _limit(1024, "sequences one request may ask for: prompts x max(n, "
                                            "best_of) (best_of = the beam width with use_beam_search)")
    max_request_tokens: int = _limit(2 * 1024 * 1024, "tokens one request may commit: its sequences x "
                                                      "(prompt + max_tokens)")
    max_stop_sequences: int = _limit(256, "strings in `stop`")
    max_stop_chars: int = _limit(8192, "characters of the `stop` strings in all (each at most as many): "
                                       "their matcher is built as the request starts, about 0.7 us a "
                                       "character")
    max_stop_token_ids: int = _limit(256, "ids in `stop_token_ids`")
    max_bad_words: int = _limit(256, "words in `bad_words`")
    max_bad_words_chars: int = _limit(16384, "characters of the `bad_words` in all (each at most as "
                                             "many): each is tokenized twice")
    max_logit_bias: int = _limit(300, "entries in `logit_bias` (OpenAI's bound)")
    max_messages: int = _limit(2048, "messages of one conversation (chat, /tokenize)")
    max_tools: int = _limit(128, "tools of one request (OpenAI's bound)")
    max_tools_bytes: int = _limit(1024 * 1024, "size of one request's `tools` as JSON (names, "
                                               "descriptions, parameter schemas)")
    max_name_chars: int = _limit(1024, "characters of a name or id: tool and function names, message "
                                       "names, tool call ids, `request_id` (it names every streamed "
                                       "chunk), `cache_salt`, `user`, `model` and the like")
    max_chat_template_chars: int = _limit(64 * 1024, "characters of a request's own `chat_template` "
                                                     "(--trust-request-chat-template): it is parsed and "
                                                     "compiled, about 3 s per MB")
    max_tokenize_body_bytes: int = _limit(256 * 1024, "request body of /tokenize and /detokenize "
                                                      "(larger ones get 413): tokenizing holds the "
                                                      "interpreter, about 0.7 s per MiB of text")
    max_token_strs: int = _limit(65536, "tokens /tokenize returns as strings (return_token_strs)")

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            lowest = -1 if f.name == "max_logprobs" else 0  # vLLM's -1: no cap
            if not isinstance(value, int) or isinstance(value, bool) or value < lowest:
                raise ValueError(f"{f.name} must be an integer >= {lowest}, got {value!r}")

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        g = parser.add_argument_group("request limits (a request past one gets 400 naming it)")
        for f in dataclasses.fields(cls):
            if f.metadata.get("engine"):
                continue  # an engine flag (app/engine_args.py) of the same name sets it
            g.add_argument(flag(f.name), dest=f.name, type=int, default=f.default,
                           help=f"{f.metadata['help']} (default: %(default)s)")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "AdmissionLimits":
        """From serve's flags: ``add_arguments`` defines each field's (engine ones: app/engine_args.py)."""
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def refuse(param: str, message: str, limit_name: str, limit: int, code: str = LIMIT_CODE) -> APIError:
    return APIError.bad_request(f"{message}; this server allows at most {limit} ({flag(limit_name)})",
                                param=param, code=code)


# (body field, limit) of the lists each kind of request may hold.
_LISTS = {
    "completions": (("stop", "max_stop_sequences"), ("stop_token_ids", "max_stop_token_ids"),
                    ("bad_words", "max_bad_words")),
    "chat": (("messages", "max_messages"), ("tools", "max_tools"), ("stop", "max_stop_sequences"),
             ("stop_token_ids", "max_stop_token_ids"), ("bad_words", "max_bad_words")),
    "tokenize": (("messages", "max_messages"), ("tools", "max_tools")),
    "embeddings": (),
    "score": (),
    "responses": (("input", "max_messages"), ("tools", "max_tools")),
}
_LOGPROBS = {"completions": ("logprobs", "prompt_logprobs"), "chat": ("top_logprobs", "prompt_logprobs"),
             "tokenize": (), "embeddings": (), "score": (), "responses": ("top_logprobs",)}


def check_body(kind: str, data: Any, limits: AdmissionLimits, vocab_size: int | None,
               max_model_len: int | None = None) -> None:
    """The bounds a JSON body can be held to before validation (``kind``: completions, chat,
    tokenize, embeddings, score or responses). Only reads lengths and a bounded number of keys; shapes that are
    wrong are left to the request model's validation."""
    if not isinstance(data, dict):
        return
    if kind in ("embeddings", "score"):
        if kind == "embeddings":
            check_id_prompt_lengths(data.get("input"), "input", max_model_len, "input")
        check_strings(kind, data, limits)
        return
    if kind == "completions" and data.get("truncate_prompt_tokens") is None:
        check_id_prompt_lengths(data.get("prompt"), "prompt", max_model_len, "prompt")
    allowed = data.get("allowed_token_ids")
    if isinstance(allowed, list) and vocab_size is not None and len(allowed) > vocab_size:
        # A longer list repeats ids or holds ids the model does not have: refused before each id
        # is validated (and again for every choice).
        raise APIError.bad_request(f"'allowed_token_ids' has {len(allowed)} ids but the vocabulary has "
                                   f"{vocab_size} tokens", param="allowed_token_ids")
    for name, limit_name in _LISTS[kind]:
        value = data.get(name)
        limit = getattr(limits, limit_name)
        if isinstance(value, list) and len(value) > limit:
            raise refuse(name, f"'{name}' has {len(value)} items", limit_name, limit)
    if kind == "completions":
        prompt = data.get("prompt")
        # A list of strings or of token-id lists is several prompts; a list of ids is one.
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) \
                and len(prompt) > limits.max_prompts:
            raise refuse("prompt", f"'prompt' holds {len(prompt)} prompts", "max_prompts", limits.max_prompts)
    check_strings(kind, data, limits)
    if kind != "tokenize":
        check_logit_bias(data.get("logit_bias"), limits, vocab_size)
    for name in _LOGPROBS[kind]:
        value = data.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and 0 <= limits.max_logprobs < value:
            raise refuse(name, f"'{name}' asks for {value}", "max_logprobs", limits.max_logprobs)


# Names and ids, as paths in the body ("*": each item of a list), each at most max_name_chars.
_TOP_NAMES = (("model",), ("user",), ("request_id",), ("cache_salt",))
_OPENAI_IDS = (("service_tier",), ("prompt_cache_key",), ("safety_identifier",))
_CONVERSATION_NAMES = (("messages", "*", "name"), ("messages", "*", "tool_call_id"),
                       ("messages", "*", "tool_calls", "*", "id"),
                       ("messages", "*", "tool_calls", "*", "function", "name"),
                       ("tools", "*", "function", "name"), ("tool_choice", "function", "name"))
_NAMES = {
    "completions": _TOP_NAMES,
    "chat": _TOP_NAMES + _OPENAI_IDS + _CONVERSATION_NAMES + (("reasoning_effort",),),
    "tokenize": (("model",),) + _CONVERSATION_NAMES,
    "embeddings": _TOP_NAMES,
    "score": _TOP_NAMES,
    "responses": _TOP_NAMES + _OPENAI_IDS + (("input", "*", "id"), ("input", "*", "call_id"), ("input", "*", "name"),
                                             ("tools", "*", "name"), ("tool_choice", "name"), ("reasoning", "effort")),
}
# Lists of strings bounded one by one and in all: (field, limit)
_STRING_LISTS = {"completions": (("stop", "max_stop_chars"), ("bad_words", "max_bad_words_chars")),
                 "chat": (("stop", "max_stop_chars"), ("bad_words", "max_bad_words_chars"))}


def _strings_at(value: Any, path: tuple[str, ...], where: str):
    """(param, string) for each string at ``path`` under ``value``."""
    if not path:
        if isinstance(value, str):
            yield where, value
        return
    key, rest = path[0], path[1:]
    if key == "*":
        if isinstance(value, list):
            for i, item in enumerate(value):
                yield from _strings_at(item, rest, f"{where}.{i}")
    elif isinstance(value, dict) and key in value:
        yield from _strings_at(value[key], rest, f"{where}.{key}" if where else key)


def check_strings(kind: str, data: dict, limits: AdmissionLimits) -> None:
    """Each string and each list of strings within its length (issue 37): one 1,000,000-character
    stop string froze the event loop 0.75 s while its matcher was built, a 16 MiB ``request_id``
    named every streamed chunk. Reads only lengths (and ``tools`` once as JSON, in C)."""
    for name, limit_name in _STRING_LISTS.get(kind, ()):
        value = data.get(name)
        limit = getattr(limits, limit_name)
        strings = [value] if isinstance(value, str) else value if isinstance(value, list) else ()
        total = 0
        for item in strings:
            if isinstance(item, str):
                if len(item) > limit:
                    raise refuse(name, f"'{name}' holds a string of {len(item)} characters", limit_name, limit)
                total += len(item)
        if total > limit:
            raise refuse(name, f"'{name}' holds {total} characters in all", limit_name, limit,
                         REQUEST_LIMIT_CODE)
    for path in _NAMES[kind]:
        for param, text in _strings_at(data, path, ""):
            if len(text) > limits.max_name_chars:
                raise refuse(param, f"'{param}' has {len(text)} characters", "max_name_chars",
                             limits.max_name_chars)
    tools = data.get("tools")
    if isinstance(tools, list) and tools and kind not in ("embeddings", "score"):
        size = len(orjson.dumps(tools))
        if size > limits.max_tools_bytes:
            raise refuse("tools", f"'tools' takes {size} bytes as JSON", "max_tools_bytes",
                         limits.max_tools_bytes, REQUEST_LIMIT_CODE)
    template = data.get("chat_template")
    if isinstance(template, str) and len(template) > limits.max_chat_template_chars:
        raise refuse("chat_template", f"'chat_template' has {len(template)} characters",
                     "max_chat_template_chars", limits.max_chat_template_chars)


def check_id_prompt_lengths(value: Any, param: str, max_model_len: int | None, what: str) -> None:
    """A token-id prompt (a list of ids, or a list of such lists) longer than the context cannot
    fit: refused from its length, before each id is validated (a 16 MiB body holds ~3M ids, ~2 s
    of the event loop)."""
    if max_model_len is None or not isinstance(value, list) or not value:
        return
    lists = [value] if not isinstance(value[0], list) else value
    for i, ids in enumerate(lists):
        if isinstance(ids, list) and len(ids) > max_model_len and not isinstance(ids[0], str):
            which = f"{what} {i}" if len(lists) > 1 else f"your {what}"
            raise APIError.bad_request(
                f"This model's maximum context length is {max_model_len} tokens. However, {which} has "
                f"{len(ids)} tokens. Please shorten it.", param=param, code="context_length_exceeded")


def check_logit_bias(bias: Any, limits: AdmissionLimits, vocab_size: int | None) -> None:
    """At most ``max_logit_bias`` keys, each a token id of the vocabulary written in decimal
    (as OpenAI and vLLM: an id the model does not have is a 400, not ignored)."""
    if not isinstance(bias, dict):
        return
    if len(bias) > limits.max_logit_bias:
        raise refuse("logit_bias", f"'logit_bias' has {len(bias)} entries", "max_logit_bias",
                     limits.max_logit_bias)
    for key in bias:
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 18):
            continue  # the request model says what is wrong with it
        if len(key) > 1 and key[0] == "0":
            raise APIError.bad_request(f"logit_bias keys are token ids in decimal without leading "
                                       f"zeros, got {key!r}", param="logit_bias")
        if vocab_size is not None and int(key) >= vocab_size:
            raise APIError.bad_request(
                f"logit_bias token id {key} is not in the vocabulary (ids 0..{vocab_size - 1})",
                param="logit_bias")


def width_of(req: Any) -> tuple[int, str]:
    """Sequences per prompt and the field that asks for them: n, or best_of when it is larger
    (the beam width with use_beam_search)."""
    n = req.n
    best_of = req.best_of
    if best_of is not None and best_of > n:
        return best_of, "best_of"
    return n, "n"


def check_choices(req: Any, num_prompts: int, limits: AdmissionLimits) -> None:
    """prompts x width, before a prompt is tokenized or a choice built."""
    width, param = width_of(req)
    total = num_prompts * width
    if total > limits.max_request_choices:
        if width == 1:
            param = "prompt"
        raise refuse(param, f"this request asks for {num_prompts} prompt{'s' if num_prompts > 1 else ''} "
                            f"x {param if param != 'prompt' else 'n'} {width} = {total} sequences",
                     "max_request_choices", limits.max_request_choices, REQUEST_LIMIT_CODE)


def check_commitment(req: Any, prompt_lens: list[int], max_tokens: list[int], limits: AdmissionLimits,
                     param: str = "max_tokens") -> None:
    """The tokens the request commits the server to: its sequences x (prompt + max_tokens)."""
    width, _ = width_of(req)
    total = width * sum(p + m for p, m in zip(prompt_lens, max_tokens))
    if total > limits.max_request_tokens:
        raise refuse(param, f"this request commits {width} sequence{'s' if width > 1 else ''} per prompt x "
                            f"(prompt + max_tokens) = {total} tokens; lower max_tokens or n",
                     "max_request_tokens", limits.max_request_tokens, REQUEST_LIMIT_CODE)


def int_range_pattern(maximum: int) -> str:
    """A regular expression (anchored) of the decimal integers 0..maximum, without leading zeros:
    the JSON Schema of ``logit_bias`` keys for a vocabulary of maximum + 1 tokens."""
    top = str(maximum)
    alts = ["0"] if maximum >= 0 else []
    for length in range(1, len(top)):  # every shorter number
        alts.append("[1-9]" + (f"[0-9]{{{length - 1}}}" if length > 1 else ""))
    # numbers of top's length up to top: a smaller digit at position i after top's prefix
    for i, ch in enumerate(top):
        lo = 1 if i == 0 else 0
        d = int(ch)
        if d - 1 >= lo:
            rest = len(top) - i - 1
            digit = str(lo) if d - 1 == lo else f"[{lo}-{d - 1}]"
            alts.append(top[:i] + digit + (f"[0-9]{{{rest}}}" if rest else ""))
    if maximum > 0:
        alts.append(top)
    return "^(" + "|".join(dict.fromkeys(alts)) + ")$"
