"""One sequence's bitmask row: allowed_token_ids, bad_words (vLLM semantics) and a grammar's row
combined; no model needed."""
from __future__ import annotations

import numpy as np

from engine.structured_output.constraint import SeqConstraint, bad_word_token_seqs, ids_to_row

V = 100


def allowed(mask: np.ndarray, row: int = 0) -> list[int]:
    bits = np.unpackbits(mask[row].view(np.uint8), bitorder="little")[:V]
    return bits.nonzero()[0].tolist()


def fill(c: SeqConstraint, generated: list[int]) -> np.ndarray:
    mask = np.empty((1, (V + 31) // 32), dtype=np.int32)
    prompt = [1, 2, 3]
    c.fill(mask, 0, prompt + generated, len(prompt))
    return mask


def test_allowed_ids_row():
    assert allowed(fill(SeqConstraint(ids_to_row([0, 31, 32, 99], V)), [])) == [0, 31, 32, 99]


def test_single_token_bad_word_always_banned_and_multi_token_only_after_its_prefix():
    c = SeqConstraint(bad_words=[[7], [40, 41, 42]])
    assert 7 not in allowed(fill(c, [])) and 42 in allowed(fill(c, []))
    assert 42 in allowed(fill(c, [40]))  # only part of the prefix
    assert 42 not in allowed(fill(c, [5, 40, 41]))
    assert 42 in allowed(fill(c, [40, 41, 5]))
    # The prefix must have been generated, not be the end of the prompt.
    mask = np.empty((1, 4), dtype=np.int32)
    c.fill(mask, 0, [40, 41], 2)
    assert 42 in allowed(mask)
    assert len(allowed(fill(c, [40, 41]))) == V - 2  # 7 and 42; bit 31 of a word is handled


def test_bit_31_and_combination_with_allowed():
    c = SeqConstraint(ids_to_row([31, 63, 64], V), bad_words=[[63]])
    assert allowed(fill(c, [])) == [31, 64]


class FakeMatcher:
    def __init__(self, ids):
        self.ids = ids

    def fill(self, mask, row):
        mask[row] = ids_to_row(self.ids, V)


def test_grammar_row_intersects_allowed_ids():
    c = SeqConstraint(ids_to_row([1, 2, 3], V))
    c.matcher = FakeMatcher([2, 3, 4])
    assert allowed(fill(c, [])) == [2, 3]


class FakeTokenizer:
    def encode(self, text, add_special_tokens=False):
        return {"hi": [5], " hi": [6], "a b": [7, 8], " a b": [9, 7, 8], " x": [11]}[text]


def test_bad_words_tokenized_with_and_without_a_leading_space():
    assert bad_word_token_seqs(FakeTokenizer(), ["hi", "a b", " x"]) == [[5], [6], [7, 8], [9, 7, 8], [11]]
