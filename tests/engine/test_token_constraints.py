"""One sequence's bitmask row: allowed_token_ids, bad_words (vLLM semantics) and a grammar's row
combined; no model needed."""
from __future__ import annotations

import numpy as np

from pagedserve.engine.structured_output.constraint import SeqConstraint, bad_word_token_seqs, ids_to_row

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


# ---------------------------------------------------------------- many bad words (issue 22)

import random  # noqa: E402


def reference_fill(bad_words, mask, row, token_ids, num_prompt):
    """The per-word loop as it was: every word checked for every row at every step."""
    words = mask.view(np.uint32)
    for seq in bad_words:
        prefix = len(seq) - 1
        if prefix == 0 or (len(token_ids) - num_prompt >= prefix and token_ids[-prefix:] == seq[:-1]):
            t = seq[-1]
            if t < words.shape[1] * 32:
                words[row, t >> 5] &= np.uint32(0xFFFFFFFF ^ (1 << (t & 31)))


def test_bad_word_index_equals_the_per_word_loop():
    rng = random.Random(22)
    for case in range(400):
        seqs = [[rng.randrange(8) if rng.random() < 0.8 else rng.randrange(V + 40)
                 for _ in range(rng.randint(1, 4))] for _ in range(rng.randint(1, 30))]
        c = SeqConstraint(bad_words=seqs)
        prompt = [rng.randrange(8) for _ in range(rng.randint(0, 4))]
        gen = [rng.randrange(8) for _ in range(rng.randint(0, 6))]
        want = np.full((2, (V + 31) // 32), -1, dtype=np.int32)
        reference_fill(seqs, want, 1, prompt + gen, len(prompt))
        got = np.zeros((2, (V + 31) // 32), dtype=np.int32)
        c.fill(got, 1, prompt + gen, len(prompt))
        assert allowed(got, 1) == allowed(want, 1), f"case {case}: {seqs} {prompt} {gen}"


class _CountedSeq(list):
    """A bad word's tokens that count every time Python code looks at them."""
    looks = 0

    def _count(name):
        def f(self, *a):
            _CountedSeq.looks += 1
            return getattr(list, name)(self, *a)
        return f

    for _name in ("__len__", "__getitem__", "__iter__", "__eq__", "__reversed__"):
        locals()[_name] = _count(_name)
    del _name


def test_a_step_reads_no_bad_word_once_they_are_indexed():
    """Issue 22: every bad word was checked for every row at every step inside schedule(). They
    are indexed once; a step then reads none of them, and bans the same tokens."""
    words = [_CountedSeq([10 + i % 50, 60 + i % 7, i % V]) for i in range(3000)] + [_CountedSeq([7])]
    c = SeqConstraint(bad_words=words)
    plain = [list(w) for w in words]
    _CountedSeq.looks = 0
    got = [allowed(fill(c, gen)) for gen in ([], [10], [10, 60], [5, 11, 61], [59, 66])]
    assert _CountedSeq.looks == 0
    assert got[2] == [t for t in range(V) if t not in (0, 7, 50)]  # (10, 60) then i % V, i = 350 k
    for gen, row in zip(([], [10], [10, 60], [5, 11, 61], [59, 66]), got):
        want = np.full((1, (V + 31) // 32), -1, dtype=np.int32)
        reference_fill(plain, want, 0, [1, 2, 3] + gen, 3)
        assert row == allowed(want)


class _EqInt(int):
    compares = 0

    def __eq__(self, other):
        _EqInt.compares += 1
        return int.__eq__(self, other)

    __hash__ = int.__hash__


class CountingTokenizer:
    def encode(self, text, add_special_tokens=False):
        return [_EqInt(ord(ch)) for ch in text]


def test_bad_words_are_prepared_in_linear_time():
    """Issue 22: ``ids not in seqs`` compared each word's tokens with every kept word's."""
    _EqInt.compares = 0
    seqs = bad_word_token_seqs(CountingTokenizer(), [f"w{i}" for i in range(2000)] + ["w5"])
    n = _EqInt.compares
    assert len(seqs) == 4000 and seqs[:2] == [[ord("w"), ord("0")], [ord(" "), ord("w"), ord("0")]]
    assert n < 100


def test_the_sequences_of_a_request_share_one_bad_word_index():
    from pagedserve.engine.sampling_params import SamplingParams
    from tests.engine.fakes import make_core

    core, _ = make_core()
    core.add_request("r", None, [5, 6], SamplingParams(n=3, bad_words=["ab", "cd"], max_tokens=4))
    seqs = core.requests["r"].seqs
    assert seqs[0].constraint.bad_words is not None
    assert len({id(s.constraint.bad_words) for s in seqs}) == 1
    assert len({id(s.constraint) for s in seqs}) == 3


def test_bad_words_are_tokenized_by_the_check_off_the_loop_not_again_for_the_sequences():
    """Issue 37: a request's bad words were tokenized on the event loop when its sequences got
    their constraints (twice per word: as written and after a space). check() runs in the grammar
    pool (AsyncEngine.check_constraint); the sequences on the loop now find the work done."""
    from pagedserve.engine.sampling_params import SamplingParams
    from pagedserve.engine.structured_output.manager import StructuredOutputManager
    from tests.engine.fakes import VOCAB, FakeTokenizer

    class Counting(FakeTokenizer):
        encoded: list[str] = []

        def encode(self, text, add_special_tokens=True):
            self.encoded.append(text)
            return super().encode(text, add_special_tokens=add_special_tokens)

    tok = Counting()
    manager = StructuredOutputManager(tok, VOCAB, backend=object())
    params = SamplingParams(bad_words=["hello", "world"])
    manager.check(params)  # in the grammar pool
    assert sorted(tok.encoded) == [" hello", " world", "hello", "world"]
    on_loop = len(tok.encoded)
    first = manager.new_constraint(params)  # on the event loop, as the request is added
    again = manager.new_constraint(SamplingParams(bad_words=["hello", "world"]))  # an equal list
    assert len(tok.encoded) == on_loop
    assert first.bad_words is not None and again.bad_words is first.bad_words
    manager.shutdown()
