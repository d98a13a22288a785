"""The request mix of a soak run: what each request sends and what counts as the right answer.

Every kind of traffic a production server sees at once: chat and completions, streamed and not,
n>1, logprobs, stop strings, clients that hang up mid-stream, and malformed input that must get
its 4xx (never a 5xx). A plan is a pure function of (seed, index), so a failing request can be
replayed by its index.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
MESSAGES = "/v1/messages"  # Anthropic's
OLLAMA_CHAT = "/api/chat"

_WORDS = ("the river bright cold winter paper engine garden quiet number seven blue market light "
          "stone window letter silver morning sound travel orange bridge forest simple answer "
          "question city music table careful golden north yellow story ocean little machine").split()
_SYSTEM = "You are a careful assistant. Answer briefly and never invent facts you do not know."

# kind -> weight. "abort" streams are dropped by the client after a few events; "bad" requests
# must get the 4xx listed with them.
MIX = {
    "completion": 14, "completion_stream": 14, "chat": 12, "chat_stream": 14,
    "completion_n_logprobs": 8, "chat_logprobs": 8, "stop_strings": 8,
    "abort_stream": 12, "bad_input": 10, "hostile": 6,
}
# What a hostile request may be answered with: served, or refused by the admission guard.
HOSTILE_OK = (200, 400, 413)
HOSTILE_KINDS = ("huge_stop", "big_bad_words", "big_logit_bias", "fanout_n", "big_tokenize",
                 "many_tool_messages", "template_kwargs_self", "huge_text_prompt",
                 # issue 37: long strings, and a request's own template (400 without
                 # --trust-request-chat-template, 400 from its bounds with it)
                 "long_stop_string", "many_long_stops", "long_bad_word", "long_tool_description",
                 "request_template",
                 # issue 40: the other front doors (Anthropic's /v1/messages, Ollama's /api/chat)
                 # pass the same admission guard
                 "anthropic_huge_stop", "anthropic_many_tool_results", "ollama_many_messages")
MIB = 1024 * 1024
# Each hostile kind's size at hostile_scale 1.0 (list items, prompts, characters; 0: no size).
HOSTILE_FULL_SIZE = {"huge_stop": 40_000, "big_bad_words": 20_000, "big_logit_bias": 50_000,
                     "fanout_n": 2000, "big_tokenize": 200_000, "many_tool_messages": 20_000,
                     "template_kwargs_self": 0, "huge_text_prompt": 200_000,
                     "long_stop_string": 4 * MIB, "many_long_stops": 200, "long_bad_word": 4 * MIB,
                     "long_tool_description": 4 * MIB, "request_template": 0,
                     "anthropic_huge_stop": 40_000, "anthropic_many_tool_results": 20_000,
                     "ollama_many_messages": 20_000}
# Request templates that froze (the first), killed (the second) or failed (the third) a server.
HOSTILE_TEMPLATES = ("{{ (7**30000000) % 10 }}", "{{ 'a' * 10**10 }}", "{{ range(10**9)|list|length }}",
                     "{% set ns = namespace(x=[1]) %}{% for i in range(80) %}{% set ns.x = [ns.x, ns.x] %}"
                     "{% endfor %}{{ ns.x }}")


@dataclass(slots=True)
class Planned:
    index: int
    kind: str
    path: str
    body: dict | None = None
    raw: bytes | None = None  # sent as is (malformed JSON)
    stream: bool = False
    expect_status: int = 200
    accept_status: tuple[int, ...] | None = None  # hostile: any of these (expect_status unused)
    n: int = 1
    drop_after_events: int | None = None  # abort: hang up after this many data events
    note: str = ""
    size: int = 0  # hostile: its size (HOSTILE_FULL_SIZE at hostile_scale 1.0)


@dataclass(slots=True)
class Outcome:
    index: int
    kind: str
    status: int | None = None  # HTTP status, None when no response came
    ok: bool = False
    aborted: bool = False
    error: str = ""
    latency_s: float = 0.0
    events: int = 0
    sequences: int = 0  # sequences the server finished for it (n of a request it answered in full)
    extra: dict = field(default_factory=dict)


def _text(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(lo, hi)))


def _messages(rng: random.Random) -> list[dict]:
    msgs = [{"role": "system", "content": _SYSTEM}] if rng.random() < 0.5 else []
    msgs.append({"role": "user", "content": _text(rng, 3, 60)})
    if rng.random() < 0.3:
        msgs += [{"role": "assistant", "content": _text(rng, 2, 20)},
                 {"role": "user", "content": _text(rng, 2, 20)}]
    return msgs


def _bad(rng: random.Random, model: str, max_model_len: int) -> tuple[str, dict | None, bytes | None, int, str]:
    """(path, body, raw, expected status, what is wrong)."""
    cases = [
        (COMPLETIONS, None, b'{"model": "' + model.encode() + b'", "prompt": ', 400, "truncated JSON"),
        (COMPLETIONS, {"model": model, "prompt": "x", "temperature": -1}, None, 400, "temperature < 0"),
        (COMPLETIONS, {"model": "no-such-model", "prompt": "x"}, None, 404, "unknown model"),
        (COMPLETIONS, {"model": model, "prompt": [5] * (max_model_len + 10)}, None, 400, "prompt too long"),
        (COMPLETIONS, {"model": model, "prompt": "x", "max_tokens": max_model_len + 10}, None, 400,
         "max_tokens past the context"),
        (COMPLETIONS, {"model": model, "prompt": [10**9]}, None, 400, "token id out of vocabulary"),
        (COMPLETIONS, {"model": model, "prompt": "x", "n": 0}, None, 400, "n = 0"),
        (COMPLETIONS, {"model": model, "prompt": "x", "top_p": 7}, None, 400, "top_p > 1"),
        (CHAT, {"model": model, "messages": "not a list"}, None, 400, "messages not a list"),
        (CHAT, {"model": model}, None, 400, "no messages"),
        (CHAT, {"model": model, "messages": [{"role": "user", "content": "x"}], "logprobs": True,
                "top_logprobs": 10**6}, None, 400, "top_logprobs too large"),
        (CHAT, None, b"[1, 2, 3]", 400, "body not an object"),
    ]
    return rng.choice(cases)


def _hostile(rng: random.Random, index: int, model: str, scale: float) -> Planned:
    """One hostile request; ``scale`` shrinks the list sizes (1.0 = the sizes that froze the
    loop for seconds before issue 22; a quick check may use less)."""
    what = rng.choice(HOSTILE_KINDS)
    n = max(2, int(HOSTILE_FULL_SIZE[what] * scale)) if HOSTILE_FULL_SIZE[what] else 0
    short = {"model": model, "max_tokens": 4, "temperature": 0.0}
    if what == "huge_stop":
        body = {**short, "prompt": _text(rng, 3, 10), "stop": [f"s{i:07d}" for i in range(n)]}
        path = COMPLETIONS
    elif what == "big_bad_words":
        body = {**short, "prompt": _text(rng, 3, 10), "bad_words": [f"w{i}x" for i in range(n)]}
        path = COMPLETIONS
    elif what == "big_logit_bias":
        # mostly past any vocabulary: must be refused (OpenAI/vLLM), never accepted and looped over
        body = {**short, "prompt": _text(rng, 3, 10),
                "logit_bias": {str(1_000_000 + i): 1.0 for i in range(n)}}
        path = COMPLETIONS
    elif what == "fanout_n":
        body = {**short, "max_tokens": 1, "prompt": [[42]] * n, "n": 128}
        path = COMPLETIONS
    elif what == "big_tokenize":
        body = {"model": model, "prompt": "hello world " * n, "return_token_strs": True}
        path = "/tokenize"
    elif what == "many_tool_messages":
        msgs = [{"role": "user", "content": "call it"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c0", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]
        msgs += [{"role": "tool", "tool_call_id": "c0", "content": "ok " * 4} for _ in range(n)]
        body = {**short, "messages": msgs}
        path = CHAT
    elif what == "long_stop_string":  # its matcher was built a character at a time on the loop
        body = {**short, "prompt": _text(rng, 3, 10), "stop": "x" * n}
        path = COMPLETIONS
    elif what == "many_long_stops":  # n stop strings of 64 KiB (13 MB at full size)
        body = {**short, "prompt": _text(rng, 3, 10), "stop": [f"{i:05d}" + "x" * 65531 for i in range(n)]}
        path = COMPLETIONS
    elif what == "long_bad_word":  # tokenized twice on the loop
        body = {**short, "messages": _messages(rng), "bad_words": ["y" * n]}
        path = CHAT
    elif what == "long_tool_description":
        body = {**short, "messages": _messages(rng), "tool_choice": "none", "tools": [
            {"type": "function", "function": {"name": "f", "description": "d" * n,
                                              "parameters": {"type": "object", "properties": {}}}}]}
        path = CHAT
    elif what == "request_template":
        body = {**short, "messages": _messages(rng), "chat_template": rng.choice(HOSTILE_TEMPLATES)}
        path = CHAT
    elif what == "huge_text_prompt":
        # a multi-MB text prompt (n sentences of 21 characters): tokenizing it held the loop ~0.75 s
        # per MiB; it cannot fit the context and is refused before it is tokenized
        body = {**short, "prompt": "The quick brown fox. " * n}
        path = COMPLETIONS
    elif what == "anthropic_huge_stop":
        body = {"model": model, "max_tokens": 4, "temperature": 0.0, "messages": _messages(rng),
                "stop_sequences": [f"s{i:07d}" for i in range(n)]}
        path = MESSAGES
    elif what == "anthropic_many_tool_results":
        use = {"type": "tool_use", "id": "t0", "name": "f", "input": {}}
        results = [{"type": "tool_result", "tool_use_id": "t0", "content": "ok " * 4} for _ in range(n)]
        body = {"model": model, "max_tokens": 4, "temperature": 0.0, "messages": [
            {"role": "user", "content": "call it"}, {"role": "assistant", "content": [use]},
            {"role": "user", "content": results}]}
        path = MESSAGES
    elif what == "ollama_many_messages":
        body = {"model": model, "stream": False, "options": {"num_predict": 4, "temperature": 0.0},
                "messages": [{"role": "user", "content": "hi " * 2} for _ in range(n)]}
        path = OLLAMA_CHAT
    else:  # template_kwargs_self: a keyword the renderer itself takes
        body = {**short, "messages": [{"role": "user", "content": "hi"}],
                "chat_template_kwargs": {"self": 1}}
        path = CHAT
    return Planned(index, "hostile", path, body, accept_status=HOSTILE_OK, note=what, size=n)


def abort_stream_tokens(max_model_len: int) -> int:
    """max_tokens of a stream the client drops: most of the context (its prompt is short: up to
    256 tokens kept free, half the context on a small one), at most 4,096."""
    return min(4096, max(max_model_len - 256, max_model_len // 2))


def plan(index: int, *, seed: int, model: str, max_model_len: int, max_tokens: int,
         hostile_scale: float = 1.0, mix: dict[str, int] | None = None) -> Planned:
    rng = random.Random(seed * 1_000_003 + index)
    mix = MIX if mix is None else mix
    kind = rng.choices(list(mix), weights=list(mix.values()))[0]
    if kind == "hostile":
        return _hostile(rng, index, model, hostile_scale)
    temp = rng.choice([0.0, 0.7, 1.0])
    mt = rng.randint(1, max_tokens)
    if kind == "bad_input":
        path, body, raw, status, note = _bad(rng, model, max_model_len)
        return Planned(index, kind, path, body, raw, expect_status=status, note=note)
    if kind in ("completion", "completion_stream"):
        stream = kind.endswith("stream")
        body = {"model": model, "prompt": _text(rng, 3, 80), "max_tokens": mt, "temperature": temp,
                "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        return Planned(index, kind, COMPLETIONS, body, stream=stream)
    if kind in ("chat", "chat_stream"):
        stream = kind.endswith("stream")
        body = {"model": model, "messages": _messages(rng), "max_completion_tokens": mt,
                "temperature": temp, "stream": stream}
        return Planned(index, kind, CHAT, body, stream=stream)
    if kind == "completion_n_logprobs":
        n = rng.randint(2, 3)
        stream = rng.random() < 0.5
        body = {"model": model, "prompt": _text(rng, 3, 40), "max_tokens": mt, "temperature": 1.0,
                "n": n, "logprobs": rng.randint(0, 3), "stream": stream, "seed": rng.randint(0, 9999)}
        return Planned(index, kind, COMPLETIONS, body, stream=stream, n=n)
    if kind == "chat_logprobs":
        stream = rng.random() < 0.5
        body = {"model": model, "messages": _messages(rng), "max_tokens": mt, "temperature": temp,
                "logprobs": True, "top_logprobs": rng.randint(0, 5), "stream": stream}
        return Planned(index, kind, CHAT, body, stream=stream)
    if kind == "stop_strings":
        stream = rng.random() < 0.5
        stops = rng.sample(["e", "a ", "\n", "the", ".", "s"], rng.randint(1, 3))
        body = {"model": model, "prompt": _text(rng, 3, 40), "max_tokens": max(mt, 8),
                "temperature": temp, "stop": stops, "stream": stream}
        return Planned(index, kind, COMPLETIONS, body, stream=stream)
    # abort_stream: long enough that the client always hangs up before the end. 400 tokens were not:
    # the tiny model makes them in ~0.2 s, and a server whose loop is busy for that long notices the
    # hang-up after the request finished (counted finished, not aborted: CI saw 35 aborts for 36).
    chat = rng.random() < 0.5
    body = {"model": model, "max_tokens": abort_stream_tokens(max_model_len), "ignore_eos": True, "stream": True,
            "temperature": temp}
    if chat:
        body["messages"] = _messages(rng)
    else:
        body["prompt"] = _text(rng, 3, 40)
    return Planned(index, kind, CHAT if chat else COMPLETIONS, body, stream=True,
                   drop_after_events=rng.randint(0, 4))


def check_full(p: Planned, body: dict) -> str:
    """'' when a non-streamed 200 is a well-formed answer to ``p``, else what is wrong."""
    choices = body.get("choices")
    if not isinstance(choices, list) or len(choices) != p.n:
        return f"expected {p.n} choice(s), got {str(choices)[:200]}"
    for c in choices:
        if c.get("finish_reason") not in ("stop", "length"):
            return f"finish_reason {c.get('finish_reason')!r}"
    usage = body.get("usage") or {}
    if not isinstance(usage.get("completion_tokens"), int):
        return f"no usage: {str(body)[:200]}"
    return ""


def check_stream(p: Planned, finishes: dict[int, str], done: bool) -> str:
    """'' when a stream ended with [DONE] and every choice with a finish reason."""
    if not done:
        return "stream ended without [DONE]"
    if sorted(finishes) != list(range(p.n)):
        return f"finish reasons for choices {sorted(finishes)}, expected {p.n}"
    bad = {i: r for i, r in finishes.items() if r not in ("stop", "length")}
    return f"finish reasons {bad}" if bad else ""
