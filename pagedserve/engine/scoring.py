"""Pair scoring by embedding cosine (vLLM's ``score`` for embedding models): which pairs a
request with ``text_1`` and ``text_2`` compares."""
from __future__ import annotations


def score_pairs(n1: int, n2: int) -> list[tuple[int, int]]:
    """Indexes (i into text_1, j into text_2) of the pairs to score, as vLLM: one text against
    one, one against many (either side), or two lists of equal length element by element."""
    if n1 < 1 or n2 < 1:
        raise ValueError("text_1 and text_2 must each hold at least one text")
    if n1 == 1:
        return [(0, j) for j in range(n2)]
    if n2 == 1:
        return [(i, 0) for i in range(n1)]
    if n1 != n2:
        raise ValueError(f"text_1 has {n1} texts and text_2 has {n2}: give one text on a side, "
                         "or lists of the same length")
    return [(i, i) for i in range(n1)]
