"""The detokenizer as it was before issue 9 (two Python decodes per token, text grown with +=),
kept verbatim as the oracle: engine/detokenizer.py must produce exactly its output, token by
token, whatever path it takes (tests/engine/test_detokenizer_stream.py)."""
from __future__ import annotations

PROMPT_CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"


class ReferenceDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: list[str] | None = None,
                 include_stop_str_in_output: bool = False, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = list(stop or [])
        self.include_stop = include_stop_str_in_output
        self._max_stop_len = max((len(s) for s in self.stop), default=0)
        self._ids: list[int] = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._prefix_text: str | None = None
        self.text = ""  # decoded output text (cut at a matched stop string)
        self._releasable = 0  # text[:_releasable] may be handed out
        self._taken = 0  # text[:_taken] was handed out
        self.stopped = False  # a stop string matched: no more text, ever

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add_token(self, token_id: int, check_stop: bool = True) -> str | None:
        """Feed one generated token. Returns the stop string it completed, if any."""
        if self.stopped:
            return None
        self._ids.append(token_id)
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full = self._decode(self._ids[self._prefix_offset:])
        if len(full) <= len(self._prefix_text) or full.endswith(REPLACEMENT_CHAR):
            return None  # nothing new yet (an incomplete character or a skipped special token)
        piece = full[len(self._prefix_text):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._prefix_text = None
        return self._append_text(piece, check_stop)

    def _append_text(self, piece: str, check_stop: bool) -> str | None:
        old_len = len(self.text)
        self.text += piece
        if not self.stop:
            self._releasable = len(self.text)
            return None
        if check_stop:
            # A new match must end in the new piece: start far enough back to catch one that
            # began in earlier text.
            start = max(0, old_len - self._max_stop_len + 1)
            best: tuple[int, str] | None = None
            for s in self.stop:
                idx = self.text.find(s, start)
                if idx != -1 and (best is None or idx < best[0]):
                    best = (idx, s)
            if best is not None:
                idx, s = best
                self.text = self.text[:idx + len(s) if self.include_stop else idx]
                self._releasable = len(self.text)
                self.stopped = True
                return s
        self._releasable = len(self.text) - self._held_back()
        return None

    def _held_back(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop string."""
        if self.include_stop:
            return 0  # the stop string itself is output, so nothing needs hiding
        text = self.text
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best

    def flush(self) -> None:
        """The sequence ended without a stop string: release everything, including an
        incomplete trailing character (as the tokenizer's own decode would show it)."""
        if self.stopped:
            return
        if self._read_offset < len(self._ids):
            if self._prefix_text is None:
                self._prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
            full = self._decode(self._ids[self._prefix_offset:])
            if len(full) > len(self._prefix_text):
                self.text += full[len(self._prefix_text):]
            self._prefix_offset = self._read_offset = len(self._ids)
            self._prefix_text = None
        self._releasable = len(self.text)

    def take_delta(self) -> str:
        """Text released since the previous call."""
        if self._taken >= self._releasable:
            return ""
        out = self.text[self._taken:self._releasable]
        self._taken = self._releasable
        return out
