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
    a word inside text is usually tokenized with the space before it (as vLLM does). Duplicates
    are dropped with a set (linear; a list scan was quadratic, issue 22), first occurrence kept."""
    seqs: list[list[int]] = []
    seen: set[tuple[int, ...]] = set()
    for word in words:
        variants = [word] if word.startswith(" ") else [word, " " + word]
        for text in variants:
            ids = tuple(tokenizer.encode(text, add_special_tokens=False))
            if ids and ids not in seen:
                seen.add(ids)
                seqs.append(list(ids))
    return seqs


class BadWords:
    """A request's bad words, indexed once so that a step's work does not grow with their number.

    A word of tokens ``p + [t]`` bans ``t`` when the tokens generated last are ``p``. Words are
    stored in a trie over their prefixes read backwards (last prefix token first): a step walks it
    from the sequence's last generated token backwards, as far as the generated tokens and the trie
    go (the longest word's length at most), and every node it reaches holds the ids its words ban,
    grouped by bitmask word (``cols[start[node]:end[node]]``: word indices, ``keep``: those words'
    bits with the banned ones cleared), applied with one vectorised AND. The root holds one-token
    words (always banned). Immutable once built: the sequences of a request share one.
    """

    __slots__ = ("children", "start", "end", "cols", "keep")

    def __init__(self, seqs: list[list[int]]):
        children: list[dict[int, int]] = [{}]
        at_node: list[int] = []  # (node, banned id) pairs, flat
        banned: list[int] = []
        for seq in seqs:
            if not seq:
                continue
            node = 0
            for tok in reversed(seq[:-1]):
                nxt = children[node].get(tok)
                if nxt is None:
                    nxt = len(children)
                    children[node][tok] = nxt
                    children.append({})
                node = nxt
            at_node.append(node)
            banned.append(seq[-1])
        self.children = children
        # One vectorised pass: group the pairs by (node, mask word), OR their bits together.
        nodes = np.asarray(at_node, dtype=np.int64)
        ids = np.asarray(banned, dtype=np.int64)
        ok = ids >= 0
        nodes, ids = nodes[ok], ids[ok]
        cols = ids >> 5
        bits = np.left_shift(np.uint32(1), (ids & 31).astype(np.uint32))
        order = np.lexsort((cols, nodes))
        nodes, cols, bits = nodes[order], cols[order], bits[order]
        new_group = np.ones(nodes.shape[0], dtype=bool)
        new_group[1:] = (nodes[1:] != nodes[:-1]) | (cols[1:] != cols[:-1])
        firsts = np.flatnonzero(new_group)
        cleared = np.bitwise_or.reduceat(bits, firsts) if firsts.shape[0] else bits[:0]
        group_node = nodes[firsts]
        self.cols = cols[firsts]  # sorted by node, then column
        self.keep = ~cleared
        every = np.arange(len(children))
        self.start = np.searchsorted(group_node, every, side="left").tolist()
        self.end = np.searchsorted(group_node, every, side="right").tolist()

    def _apply(self, words: np.ndarray, row: int, node: int) -> None:
        a, b = self.start[node], self.end[node]
        if a == b:
            return
        cols, keep = self.cols[a:b], self.keep[a:b]
        if cols[-1] >= words.shape[1]:  # ids past the vocabulary: nothing to ban there
            inside = cols < words.shape[1]
            cols, keep = cols[inside], keep[inside]
        words[row, cols] &= keep

    def apply(self, words: np.ndarray, row: int, token_ids: list[int], num_prompt: int) -> None:
        """Clear the bits this step bans in ``words[row]`` (uint32 view of the step's bitmask)."""
        self._apply(words, row, 0)
        children = self.children
        node = 0
        i = len(token_ids) - 1
        while i >= num_prompt:  # a prefix must have been generated, not be the prompt's end
            node = children[node].get(token_ids[i])
            if node is None:
                return
            self._apply(words, row, node)
            i -= 1


class SeqConstraint:
    """What limits one sequence's next token. The matcher is None until the request's grammar is
    compiled (the sequence is not scheduled before that) or when there is no grammar.

    ``wait_for``: token ids the sequence must generate before the grammar applies (a reasoning
    model's end of thinking, StructuredOutputsParams.start_after); until then only the allowed row
    and bad words bind, and the matcher does not advance."""

    __slots__ = ("matcher", "allowed", "bad_words", "terminated", "wait_for", "_recent")

    def __init__(self, allowed: np.ndarray | None = None, bad_words: list[list[int]] | BadWords | None = None,
                 wait_for: tuple[int, ...] | None = None):
        self.matcher = None
        self.allowed = allowed
        if bad_words is not None and not isinstance(bad_words, BadWords):
            bad_words = BadWords(bad_words) if bad_words else None
        self.bad_words = bad_words
        self.terminated = False
        self.wait_for = wait_for or None
        self._recent: tuple[int, ...] = ()  # the last len(wait_for) tokens, while waiting

    def sibling(self) -> "SeqConstraint":
        """A constraint for another sequence of the same request: the allowed row and the bad-word
        index are shared (read only), the grammar matcher is its own (attached later)."""
        return SeqConstraint(self.allowed, self.bad_words, self.wait_for)

    def accept(self, token_id: int) -> bool:
        """Advance on a sampled token; False when the grammar refuses it."""
        if self.wait_for is not None:
            self._recent = (self._recent + (token_id,))[-len(self.wait_for):]
            if self._recent == self.wait_for:
                self.wait_for, self._recent = None, ()  # the grammar binds from the next token
            return True
        if self.matcher is None:
            return True
        ok = self.matcher.accept(token_id)
        if ok and self.matcher.is_terminated():
            self.terminated = True
        return ok

    def fill(self, mask: np.ndarray, row: int, token_ids: list[int], num_prompt: int) -> None:
        """Write this sequence's row of the step's bitmask (``token_ids``: prompt + generated)."""
        if self.matcher is not None and self.wait_for is None:
            self.matcher.fill(mask, row)
            if self.allowed is not None:
                mask[row] &= self.allowed
        elif self.allowed is not None:
            mask[row] = self.allowed
        else:
            mask[row] = -1
        if self.bad_words is not None:
            self.bad_words.apply(mask.view(np.uint32), row, token_ids, num_prompt)
