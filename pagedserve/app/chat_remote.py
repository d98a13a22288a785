"""`pagedserve chat --url URL`: the chat loop against a running OpenAI-compatible server (this one,
vLLM, llama-server, OpenAI) instead of a model loaded here. Each turn streams
POST {URL}/v1/chat/completions; vLLM's extra sampling fields are sent only when set, so a server
that does not know them is not asked."""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, TextIO

import httpx


class RemoteError(Exception):
    """The server could not be reached or refused; the message says which and why."""


def api_base(url: str) -> str:
    """``http://host:8000``, ``http://host:8000/`` and ``http://host:8000/v1`` all mean ``.../v1``."""
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    return url if url.endswith("/v1") else url + "/v1"


def request_body(args: argparse.Namespace, model: str, messages: list[dict]) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "messages": messages, "stream": True,
                            "max_tokens": args.max_tokens, "temperature": args.temperature}
    if args.top_p != 1.0:
        body["top_p"] = args.top_p
    if args.sampling_seed is not None:
        body["seed"] = args.sampling_seed
    if args.stop:
        body["stop"] = args.stop
    # vLLM's extras (this server's too): only when asked for
    for field, value, default in (("top_k", args.top_k, 0), ("min_p", args.min_p, 0.0),
                                  ("repetition_penalty", args.repetition_penalty, 1.0),
                                  ("ignore_eos", args.ignore_eos, False)):
        if value != default:
            body[field] = value
    return body


def _error_text(r: httpx.Response) -> str:
    try:
        err = r.json().get("error")
        message = err.get("message") if isinstance(err, dict) else err
    except (ValueError, AttributeError):
        message = None
    return f"{r.status_code} {r.reason_phrase}" + (f": {message}" if message else "")


class RemoteChat:
    """One conversation with the server at ``base`` (an OpenAI-style ``.../v1`` URL)."""

    def __init__(self, base: str, api_key: str | None, client: httpx.Client | None = None) -> None:
        self.base = base
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = client or httpx.Client(headers=headers, timeout=httpx.Timeout(30.0, read=None))
        if client is not None:
            self.client.headers.update(headers)

    def first_model(self) -> str:
        try:
            r = self.client.get(self.base + "/models")
        except httpx.HTTPError as e:
            raise RemoteError(f"cannot reach {self.base}: {e}") from None
        if r.status_code != 200:
            raise RemoteError(f"GET {self.base}/models: {_error_text(r)}")
        data = r.json().get("data") or []
        if not data:
            raise RemoteError(f"{self.base}/models lists no model; name one with --model")
        return data[0]["id"]

    def stream(self, body: dict[str, Any], out: TextIO, thinking: TextIO) -> str:
        """Write the answer's deltas to ``out`` (reasoning to ``thinking``) as they come; the answer."""
        answer: list[str] = []
        try:
            with self.client.stream("POST", self.base + "/chat/completions", json=body) as r:
                if r.status_code != 200:
                    r.read()
                    raise RemoteError(_error_text(r))
                done = False
                for line in r.iter_lines():
                    if not line.startswith("data:"):
                        continue  # blank lines, ": ping" comments, other SSE fields
                    data = line[5:].strip()
                    if data == "[DONE]":
                        done = True
                        break
                    try:
                        event = json.loads(data)
                    except json.JSONDecodeError:
                        raise RemoteError(f"not an SSE stream of JSON events: {data[:200]!r}") from None
                    if not isinstance(event, dict):
                        raise RemoteError(f"not a chat completion chunk: {data[:200]!r}")
                    if "error" in event:
                        raise RemoteError(f"the stream failed: {json.dumps(event['error'])[:500]}")
                    for choice in event.get("choices") or ():
                        delta = choice.get("delta") or {}
                        if delta.get("reasoning_content"):
                            thinking.write(delta["reasoning_content"])
                            thinking.flush()
                        if delta.get("content"):
                            answer.append(delta["content"])
                            out.write(delta["content"])
                            out.flush()
                if not done:
                    raise RemoteError("the stream ended without [DONE]")
        except httpx.HTTPError as e:
            raise RemoteError(f"{self.base}/chat/completions: {e}") from None
        return "".join(answer)


def run_remote(args: argparse.Namespace, model: str | None) -> int:
    """The loop of `chat --url`; ``model`` None = the first one the server lists."""
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY") or None
    chat = RemoteChat(api_base(args.url), api_key)
    try:
        model = model or chat.first_model()
    except RemoteError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    messages: list[dict] = [{"role": "system", "content": args.system}] if args.system else []
    print(f"{model} at {chat.base}. Type a message; an empty line or Ctrl-D quits.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        messages.append({"role": "user", "content": line})
        try:
            reply = chat.stream(request_body(args, model, messages), sys.stdout, sys.stderr)
        except RemoteError as e:
            messages.pop()
            print(f"\nerror: {e}", file=sys.stderr)
            continue
        sys.stdout.write("\n")
        messages.append({"role": "assistant", "content": reply})
    return 0
