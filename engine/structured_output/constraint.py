"""One sequence's token constraint: its grammar matcher (structured outputs), its allowed token
ids and its bad words, combined into one row of the step's token bitmask.

Bit t of a row (int32 word t // 32, bit t % 32) set = token t may be sampled. Rows are numpy
int32 (numpy, not torch: the engine imports no torch); the worker applies them in the sampler.
"""
from __future__ import annotations

import numpy as np


def words_for(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def ids_to_row(token_ids: list[int], vocab_size: int) -> np.ndarray:
    """A bitmask row with exactly these tokens allowed."""
    bits = np.zeros(words_for(vocab_size) * 32, dtype=np.uint8)
    bits[np.asarray(token_ids, dtype=np.int64)] = 1
    return np.packbits(bits, bitorder="little").view(np.int32)


def bad_word_token_seqs(tokenizer, words: list[str]) -> list[list[int]]:
    """Each word as tokens, as written and (when it has no leading space) after a space, since
    a word inside text is usually tokenized with the space before it (as vLLM does)."""
    seqs: list[list[int]] = []
    for word in words:
        variants = [word] if word.startswith(" ") else [word, " " + word]
        for text in variants:
            ids = list(tokenizer.encode(text, add_special_tokens=False))
            if ids and ids not in seqs:
                seqs.append(ids)
    return seqs


class SeqConstraint:
    """What limits one sequence's next token. The matcher is None until the request's grammar is
    compiled (the sequence is not scheduled before that) or when there is no grammar."""

    __slots__ = ("matcher", "allowed", "bad_words", "terminated")

    def __init__(self, allowed: np.ndarray | None = None, bad_words: list[list[int]] | None = None):
        self.matcher = None
        self.allowed = allowed
        self.bad_words = bad_words or []
        self.terminated = False

    def accept(self, token_id: int) -> bool:
        """Advance on a sampled token; False when the grammar refuses it."""
        if self.matcher is None:
            return True
        ok = self.matcher.accept(token_id)
        if ok and self.matcher.is_terminated():
            self.terminated = True
        return ok

    def fill(self, mask: np.ndarray, row: int, token_ids: list[int], num_prompt: int) -> None:
        """Write this sequence's row of the step's bitmask (``token_ids``: prompt + generated)."""
        if self.matcher is not None:
            self.matcher.fill(mask, row)
            if self.allowed is not None:
                mask[row] &= self.allowed
        elif self.allowed is not None:
            mask[row] = self.allowed
        else:
            mask[row] = -1
        if self.bad_words:
            words = mask.view(np.uint32)
            for seq in self.bad_words:
                prefix = len(seq) - 1
                if prefix == 0 or (len(token_ids) - num_prompt >= prefix
                                   and token_ids[-prefix:] == seq[:-1]):
                    t = seq[-1]
                    if t < words.shape[1] * 32:
                        words[row, t >> 5] &= np.uint32(0xFFFFFFFF ^ (1 << (t & 31)))
