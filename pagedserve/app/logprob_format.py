"""How logprob tokens are written: their label (the token's text, or vLLM's ``token_id:<id>``
with ``return_tokens_as_token_ids``), their real bytes, and vLLM's ``prompt_logprobs`` shape.

A token that is part of a character (a byte-fallback or byte-level piece such as the first byte
of "€") decodes alone to U+FFFD; its ``bytes`` are the bytes it stands for, so a client can
join a reply's bytes back into the exact text, as OpenAI intends the field.
"""
from __future__ import annotations

from typing import Any

from pagedserve.app.fanout import logprob_value
from pagedserve.engine.client import EngineClient
from pagedserve.engine.outputs import Logprob

_MAX_CACHED = 500_000


class LogprobFormat:
    """Token labels and bytes for the logprobs of every generating route, cached per token id
    (the engine's tokenizer is read when first needed: it is set once the engine has started)."""

    def __init__(self, engine: EngineClient) -> None:
        self.engine = engine
        self._token_text_cache: dict[int, str] = {}
        self._token_bytes_cache: dict[int, list[int]] = {}

    def token_text(self, token_id: int) -> str:
        text = self._token_text_cache.get(token_id)
        if text is None:
            text = self.engine.tokenizer.decode([token_id], skip_special_tokens=False)
            if len(self._token_text_cache) < _MAX_CACHED:
                self._token_text_cache[token_id] = text
        return text

    def token_bytes(self, token_id: int) -> list[int]:
        cache = self._token_bytes_cache
        out = cache.get(token_id)
        if out is None:
            out = list(self.engine.tokenizer.token_bytes(token_id))
            if len(cache) < _MAX_CACHED:
                cache[token_id] = out
        return out

    def logprob_token(self, token_id: int, as_id: bool) -> str:
        return f"token_id:{token_id}" if as_id else self.token_text(token_id)

    def prompt_logprobs_body(self, entries: list | None, prompt_ids: list[int], k: int,
                             as_id: bool = False) -> list[dict[str, Any] | None] | None:
        """vLLM's shape: per prompt position None (the first) or ``{"<id>": {"logprob", "rank",
        "decoded_token"}}`` holding the top ``k`` and the prompt's own token."""
        if entries is None:
            return None
        out: list[dict[str, Any] | None] = []
        for pos, tid in enumerate(prompt_ids):
            entry = entries[pos] if pos < len(entries) else None
            if entry is None:
                out.append(None)
                continue
            ranked = sorted(entry.items(), key=lambda kv: -logprob_value(kv[1]))
            keep = {t for t, _ in ranked[:k]} | {tid}
            out.append({str(t): {"logprob": logprob_value(v), "rank": v.rank if isinstance(v, Logprob) else None,
                                 "decoded_token": self.logprob_token(int(t), as_id)}
                        for t, v in ranked if t in keep})
        return out
