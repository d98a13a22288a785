"""Text that may be the start of a tag: what a streaming parser (tool calls, reasoning) holds back
until the next piece says whether the tag is there; and the reply's text kept as its pieces.

A streaming parser sees a reply a few characters at a time and must stay linear in its length
(issue 37): it never re-copies or re-scans what it already holds. ``Pieces`` keeps text as the
pieces it came in (appending copies nothing held) and reads it by absolute offsets;
``find_split`` looks for a tag in a short held-back prefix followed by the rest of a piece
without joining the two."""
from __future__ import annotations

from bisect import bisect_right


def held_prefix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def find_split(prefix: str, text: str, start: int, tag: str) -> int:
    """The first position of ``tag`` in ``prefix + text[start:]`` (-1: none), found without
    copying ``text``: an occurrence that begins in ``prefix`` ends within ``len(tag) - 1``
    characters of ``text``."""
    if prefix:
        at = (prefix + text[start:start + len(tag) - 1]).find(tag)
        if at >= 0:
            return at
    at = text.find(tag, start)
    return -1 if at < 0 else at - start + len(prefix)


def last(prefix: str, text: str, i: int, size: int) -> str:
    """The last ``size`` characters (or fewer) of ``prefix + text[i:]``."""
    if len(text) - i >= size:
        return text[len(text) - size:]
    return (prefix + text[i:])[-size:] if size else ""


def joined(prefix: str, text: str, i: int, size: int) -> str:
    """The first ``size`` characters of ``prefix + text[i:]``."""
    if size <= len(prefix):
        return prefix[:size]
    return prefix + text[i:i + size - len(prefix)] if prefix else text[i:i + size]


class Pieces:
    """Text that arrives in pieces, read by absolute offsets: ``append`` keeps a reference to the
    piece (or to a range of a string: no copy of it either), ``[a:b]`` joins only the pieces it
    spans, ``[i]`` reads one character."""

    __slots__ = ("_parts", "_offs", "_starts", "_len")

    def __init__(self) -> None:
        self._parts: list[str] = []  # the strings the pieces are in
        self._offs: list[int] = []  # where each piece starts in its string
        self._starts: list[int] = []  # where each piece starts in the text
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def append(self, text: str, start: int = 0) -> None:
        """Add ``text[start:]``."""
        if start < len(text):
            self._parts.append(text)
            self._offs.append(start)
            self._starts.append(self._len)
            self._len += len(text) - start

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` characters."""
        while self._starts and self._starts[-1] >= n:
            self._parts.pop()
            self._offs.pop()
            self._starts.pop()
        self._len = min(self._len, n)

    def _end(self, k: int) -> int:
        return self._starts[k + 1] if k + 1 < len(self._starts) else self._len

    def __getitem__(self, key: int | slice) -> str:
        if isinstance(key, int):
            if key < 0:
                key += self._len
            if not 0 <= key < self._len:
                raise IndexError("Pieces index out of range")
            k = bisect_right(self._starts, key) - 1
            return self._parts[k][self._offs[k] + key - self._starts[k]]
        a, b, step = key.indices(self._len)
        if step != 1:
            raise ValueError("Pieces slices take no step")
        if a >= b:
            return ""
        k = bisect_right(self._starts, a) - 1
        out = []
        while k < len(self._parts) and self._starts[k] < b:
            s, off = self._starts[k], self._offs[k]
            lo, hi = off + max(a, s) - s, off + min(b, self._end(k)) - s
            part = self._parts[k]
            out.append(part if lo == 0 and hi == len(part) else part[lo:hi])
            k += 1
        return out[0] if len(out) == 1 else "".join(out)

    def __str__(self) -> str:
        return self[0:self._len]
