"""The prompt-lookup proposer (engine/spec_ngram.py): pure numpy, no model."""
import random
import time

from pagedserve.engine.spec_ngram import NgramProposer


def reference(tokens, k, lo, hi, window):
    """The rule in plain Python: the largest n whose suffix occurs earlier (latest occurrence)."""
    L = len(tokens)
    for n in range(min(hi, L - 1), lo - 1, -1):
        pat = tokens[L - n:]
        for i in range(L - n - 1, max(0, L - window) - 1, -1):
            if tokens[i:i + n] == pat:
                return tokens[i + n:i + n + k]
    return []


def test_proposes_what_followed_the_latest_longest_match():
    p = NgramProposer(3, 1, 3)
    toks = [5, 6, 7, 8, 9, 1, 6, 7, 2, 3, 5, 6, 7]
    # suffix [5, 6, 7] occurs at 0 (followed by 8, 9, 1); [6, 7] also at 6 but the longer n wins
    assert p.propose(1, toks, 10) == [8, 9, 1]
    assert p.propose(2, toks, 2) == [8, 9]  # capped by what max_tokens leaves
    assert p.propose(3, [1, 2, 3, 4], 10) == []  # no earlier occurrence
    assert NgramProposer(3, 2, 2).propose(4, [4, 6, 7, 1, 9, 7], 5) == []  # only n=1 would match


def test_matches_the_reference_and_grows_incrementally():
    rng = random.Random(0)
    for trial in range(200):
        k, lo = rng.randint(1, 5), rng.randint(1, 3)
        hi = lo + rng.randint(0, 3)
        window = rng.choice([8, 30, 1000])
        p = NgramProposer(k, lo, hi, window=window)
        toks = [rng.randint(0, 4) for _ in range(rng.randint(1, 10))]
        for _ in range(15):  # the same sequence, growing: the buffer is appended, not rebuilt
            assert p.propose(7, toks, 100) == reference(toks, k, lo, hi, window), (toks, k, lo, hi, window)
            toks = toks + [rng.randint(0, 4) for _ in range(rng.randint(1, 4))]


def test_long_context_is_bounded_by_the_window():
    p = NgramProposer(5, 2, 4, window=4096)
    toks = [random.Random(1).randint(0, 40000) for _ in range(100_000)]
    p.propose(1, toks, 5)  # first call copies the tokens once
    t0 = time.perf_counter()
    for i in range(50):
        toks.append(i)
        p.propose(1, toks, 5)
    per_call = (time.perf_counter() - t0) / 50
    assert per_call < 0.005, per_call  # tens of microseconds, against a context of 100k tokens
    p.forget(1)
    assert not p._tokens
