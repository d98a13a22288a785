"""Prompt-lookup (ngram) drafts for speculative decoding, proposed on the engine side.

The draft for a sequence is what followed the latest earlier occurrence of its last n tokens,
for the largest n in [prompt_lookup_min, prompt_lookup_max] that occurs (vLLM's ngram method).
It costs no model call, and pays off where the answer quotes the prompt (repeat this text, edit
this code).

Cost: each sequence keeps its tokens in a growing numpy buffer (appended by the tokens new since
the last call, so a step costs O(new tokens), not O(context)); the search is a few vectorised
compares over at most ``window`` trailing tokens, so a long prompt cannot make the event loop
slow.
"""
from __future__ import annotations

import numpy as np

# Tokens searched backwards from the end of a sequence; older ones are never proposed from.
DEFAULT_WINDOW = 8192


class _Tokens:
    __slots__ = ("buf", "n")

    def __init__(self) -> None:
        self.buf = np.empty(256, dtype=np.int64)
        self.n = 0

    def sync(self, token_ids: list[int]) -> np.ndarray:
        total = len(token_ids)
        if total < self.n:  # cannot happen (a sequence's tokens only grow); start over if it does
            self.n = 0
        if total > self.buf.shape[0]:
            grown = np.empty(max(total, 2 * self.buf.shape[0]), dtype=np.int64)
            grown[:self.n] = self.buf[:self.n]
            self.buf = grown
        if total > self.n:
            self.buf[self.n:total] = token_ids[self.n:total]
            self.n = total
        return self.buf[:total]


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int,
                 window: int = DEFAULT_WINDOW) -> None:
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max
        self.window = window
        self._tokens: dict[int, _Tokens] = {}

    def propose(self, seq_id: int, token_ids: list[int], max_tokens: int) -> list[int]:
        """Up to ``min(k, max_tokens)`` draft tokens to follow ``token_ids`` ([] if no match)."""
        k = min(self.k, max_tokens)
        if k <= 0 or len(token_ids) <= self.min_n:
            return []
        state = self._tokens.get(seq_id)
        if state is None:
            state = self._tokens[seq_id] = _Tokens()
        a = state.sync(token_ids)
        L = a.shape[0]
        lo = max(0, L - self.window)
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            pattern = a[L - n:]
            # Start positions i of earlier occurrences: a[i:i+n] == pattern with i + n < L (at least
            # one token follows), i.e. i < L - n.
            cand = np.flatnonzero(a[lo:L - n] == pattern[0]) + lo
            for j in range(1, n):
                if cand.size == 0:
                    break
                cand = cand[a[cand + j] == pattern[j]]
            if cand.size:
                start = int(cand[-1]) + n
                return a[start:start + k].tolist()
        return []

    def forget(self, seq_id: int) -> None:
        self._tokens.pop(seq_id, None)
