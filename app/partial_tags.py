"""Text that may be the start of a tag: what a streaming parser (tool calls, reasoning) holds back
until the next piece says whether the tag is there."""
from __future__ import annotations


def held_prefix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
