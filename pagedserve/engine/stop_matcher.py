"""Stop strings as one Aho-Corasick automaton, built once per request (issue 22).

The detokenizer used to try every stop string at every token (``window.find(s)`` for each, then
a held-back scan over each): with tens of thousands of stop strings that froze the event loop for
seconds. The automaton is built once, in time linear in the total length of the strings, and
each generated character then costs amortised O(1) whatever their number:

- ``state`` after some text is the node of the longest suffix of that text that is a prefix of a
  stop string (the usual Aho-Corasick invariant; ``scan`` advances it over new text);
- ``match_len[node]``: the length of the longest stop string that is a suffix of the node's
  string (0: none). The match ending at a character that starts earliest is that one;
- ``hold_len[node]``: the length of the longest suffix of the node's string that is a *proper*
  prefix of a stop string (a node with children): the text the detokenizer must hold back;
- ``index[node]``: the position of the stop string the node spells in the request's list (-1:
  none), so that among stop strings starting at the same place the first listed wins, as before.

Compiled matchers are shared: ``StopMatcher.get`` returns the live matcher for an equal list of
strings (the n choices of a request, which the server submits as n engine requests, build one
automaton, not n); it is forgotten once no detokenizer holds it.
"""
from __future__ import annotations

import weakref
from collections.abc import Sequence

_SHIFT = 21  # a transition's key: node << 21 | ord(character) (code points are below 2**21)


class StopMatcher:
    __slots__ = ("stops", "max_len", "goto", "fail", "match_len", "hold_len", "index", "__weakref__")

    _live: "weakref.WeakValueDictionary[tuple[str, ...], StopMatcher]" = weakref.WeakValueDictionary()

    @classmethod
    def get(cls, stops: Sequence[str]) -> "StopMatcher":
        key = tuple(stops)
        m = cls._live.get(key)
        if m is None:
            m = cls(key)
            cls._live[key] = m
        return m

    def __init__(self, stops: tuple[str, ...]):
        self.stops = stops
        self.max_len = max(map(len, stops), default=0)
        # The trie's edges in one dict keyed by int (a dict per node took ~235 bytes a node).
        goto: dict[int, int] = {}
        index = [-1]
        depth = [0]
        parent = [0]
        char = [0]
        has_child = [False]
        for i, s in enumerate(stops):
            node = 0
            for ch in s:
                c = ord(ch)
                key = node << _SHIFT | c
                nxt = goto.get(key)
                if nxt is None:
                    nxt = len(index)
                    goto[key] = nxt
                    index.append(-1)
                    depth.append(depth[node] + 1)
                    parent.append(node)
                    char.append(c)
                    has_child.append(False)
                    has_child[node] = True
                node = nxt
            if index[node] == -1:  # the first listed of equal strings (callers dedup anyway)
                index[node] = i
        n = len(index)
        fail = [0] * n
        match_len = [0] * n
        hold_len = [0] * n
        # Shallower nodes first: a node's failure target is shallower, so its tables are final.
        for node in sorted(range(1, n), key=depth.__getitem__):
            p, c = parent[node], char[node]
            f = 0
            if p:
                f = fail[p]
                while True:
                    nxt = goto.get(f << _SHIFT | c)
                    if nxt is not None:
                        f = nxt
                        break
                    if f == 0:
                        break
                    f = fail[f]
            fail[node] = f
            match_len[node] = depth[node] if index[node] != -1 else match_len[f]
            hold_len[node] = depth[node] if has_child[node] else hold_len[f]
        self.goto = goto
        self.fail = fail
        self.match_len = match_len
        self.hold_len = hold_len
        self.index = index

    def scan(self, state: int, text: str, offset: int) -> tuple[int, int]:
        """Advance ``state`` over ``text``; returns (new state, the earliest position, counted
        from ``offset`` before text[0], at which a stop string ending in ``text`` starts, or -1)."""
        goto, fail, match_len = self.goto, self.fail, self.match_len
        best = -1
        pos = offset
        for ch in text:
            c = ord(ch)
            while True:
                nxt = goto.get(state << _SHIFT | c)
                if nxt is not None:
                    state = nxt
                    break
                if state == 0:
                    break
                state = fail[state]
            pos += 1
            length = match_len[state]
            if length and (best == -1 or pos - length < best):
                best = pos - length
        return state, best

    def first_listed_at(self, text: str, start: int) -> str:
        """The stop string listed first among those that start at ``text[start]`` (one exists)."""
        goto, index = self.goto, self.index
        node = 0
        best = -1
        for ch in text[start:start + self.max_len]:
            node = goto.get(node << _SHIFT | ord(ch))
            if node is None:
                break
            i = index[node]
            if i != -1 and (best == -1 or i < best):
                best = i
        return self.stops[best]
