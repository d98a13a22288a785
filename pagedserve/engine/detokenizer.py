"""Incremental detokenization with stop strings.

Decoding token by token is wrong for byte-level and SentencePiece tokenizers (a character can
span tokens, a leading space depends on the previous token), so, like vLLM, we decode a small
window twice: ``ids[prefix_offset:read_offset]`` (already emitted) and ``ids[prefix_offset:]``;
the difference is the new text. If the new text ends in U+FFFD the last token(s) are an
incomplete UTF-8 sequence: nothing is emitted until a later token completes it.

Where the tokenizer offers one (``Tokenizer.decode_stream``), tokenizers' ``DecodeStream`` runs
exactly this window algorithm in Rust, one call per token instead of two decodes through Python;
the window offsets are still kept here (integers only) so ``flush`` and a fall-back stay exact.
DecodeStream refuses a decode that does not extend the previous text ("Invalid prefix", seen
with some byte-fallback tokenizers): that request then continues on the Python path, which
answers such a token as it always did. Text is the same either way
(tests/engine/test_detokenizer_stream.py compares both over random token sequences).

Stop strings: the decoded text is searched (across token boundaries) after each token. Text that
could still turn into a stop string (a suffix that is a proper prefix of one) is held back until
decided; once a stop string matched, the text is cut before it (or after it with
``include_stop_str_in_output``) and nothing after it is ever released. The search runs one
Aho-Corasick automaton (engine/stop_matcher.py, built once per list of stop strings and shared by
the choices of a request) over the new characters only: a token costs the same with one stop
string or forty thousand (issue 22). After tokens fed with ``check_stop=False`` (min_tokens) the
first checked token searches its whole window (the last max_stop_len - 1 characters and the new
piece), as the per-string search did.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence

from pagedserve.engine.stop_matcher import StopMatcher

logger = logging.getLogger(__name__)

# Prompt tokens kept as decoding context (leading-space handling of SentencePiece tokenizers).
PROMPT_CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: Sequence[str] | StopMatcher | None = None,
                 include_stop_str_in_output: bool = False, skip_special_tokens: bool = True,
                 use_decode_stream: bool = True):
        """``stop``: the stop strings, or their compiled StopMatcher (built once per request)."""
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        if stop and not isinstance(stop, StopMatcher):
            stop = StopMatcher.get(stop)
        self._matcher: StopMatcher | None = stop or None
        self.stop: tuple[str, ...] = self._matcher.stops if self._matcher is not None else ()
        self.include_stop = include_stop_str_in_output
        self._max_stop_len = self._matcher.max_len if self._matcher is not None else 0
        self._state = 0  # the matcher's state after the whole text
        self._unchecked = False  # text was added with check_stop=False since the last check
        self._ids: list[int] = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._prefix_text: str | None = None
        # The output text in pieces (``text`` joins them): ``+=`` on an attribute copies the
        # whole text at every token, quadratic in the output length.
        self._pieces: list[str] = []
        self._length = 0
        self._tail = ""  # the text's last max_stop_len - 1 characters (where a stop match starts)
        self._unreleased = ""  # text held back: it could still begin a stop string
        self._delta: list[str] = []  # released, not yet taken
        self.stopped = False  # a stop string matched: no more text, ever
        # optional: only the Rust-backed Tokenizer streams; other tokenizers (test doubles) decode in Python
        opener = getattr(tokenizer, "decode_stream", None) if use_decode_stream else None
        # step(token_id) -> new text or None (Rust), or None: decode on the Python path.
        self._stream = opener(self._ids, skip_special_tokens) if opener is not None else None

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add_token(self, token_id: int, check_stop: bool = True) -> str | None:
        """Feed one generated token. Returns the stop string it completed, if any."""
        if self.stopped:
            return None
        self._ids.append(token_id)
        piece = None
        if self._stream is not None:
            try:
                piece = self._stream(token_id)
            except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception
                logger.debug("DecodeStream refused token %d (%s); this request decodes in Python "
                             "from here on", token_id, e)
                self._stream = None
            else:
                if piece is None:
                    return None  # nothing new yet (an incomplete character or a skipped special token)
        if self._stream is None:
            piece = self._python_step()
            if piece is None:
                return None
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._prefix_text = None
        return self._append_text(piece, check_stop)

    def _python_step(self) -> str | None:
        """The new text of the window ids[prefix_offset:] past ids[prefix_offset:read_offset]."""
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full = self._decode(self._ids[self._prefix_offset:])
        if len(full) <= len(self._prefix_text) or full.endswith(REPLACEMENT_CHAR):
            return None
        return full[len(self._prefix_text):]

    def _append_text(self, piece: str, check_stop: bool) -> str | None:
        old_len = self._length
        self._pieces.append(piece)
        self._length += len(piece)
        if not self.stop:
            self._delta.append(piece)
            return None
        # Only the end of the text matters for stop strings: a new match ends in the new piece,
        # so it starts at most max_stop_len - 1 characters before it.
        back = self._tail
        window = back + piece
        base = old_len - len(back)  # text position of window[0]
        self._tail = window[-(self._max_stop_len - 1):] if self._max_stop_len > 1 else ""
        unreleased = self._unreleased + piece  # text[releasable:], where a stop match must start
        m = self._matcher
        if check_stop:
            if self._unchecked:  # matches may lie anywhere in the window: search all of it
                self._state, start = m.scan(0, window, 0)
                self._unchecked = False
            else:  # the text before the piece was searched: a new match ends in the piece
                self._state, start = m.scan(self._state, piece, len(back))
            if start != -1:
                s = m.first_listed_at(window, start)
                self._cut_to(base + start + (len(s) if self.include_stop else 0), unreleased)
                self.stopped = True
                return s
        else:
            self._state = m.scan(self._state, piece, 0)[0]
            self._unchecked = True
        # Hold back the longest suffix of the text that is a proper prefix of a stop string.
        held = 0 if self.include_stop else m.hold_len[self._state]
        self._delta.append(unreleased[:len(unreleased) - held])
        self._unreleased = unreleased[len(unreleased) - held:]
        return None

    def _cut_to(self, cut: int, unreleased: str) -> None:
        """End the text at ``cut`` and release it all. The cut is normally in the unreleased
        text; it is earlier only when stop checks were off (min_tokens) while a stop string was
        released: then text already released but not taken is cut too, as before."""
        released = self._length - len(unreleased)
        if cut >= released:
            self._delta.append(unreleased[:cut - released])
        else:
            pending = "".join(self._delta)
            taken = released - len(pending)
            self._delta = [pending[:max(0, cut - taken)]]
        self._pieces = ["".join(self._pieces)[:cut]]
        self._length = cut
        self._unreleased = ""

    @property
    def text(self) -> str:
        """The output text so far (cut at a matched stop string), released or not."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    def flush(self) -> None:
        """The sequence ended without a stop string: release everything, including an
        incomplete trailing character (as the tokenizer's own decode would show it)."""
        if self.stopped:
            return
        rest = ""
        if self._read_offset < len(self._ids):
            if self._prefix_text is None:
                self._prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
            full = self._decode(self._ids[self._prefix_offset:])
            if len(full) > len(self._prefix_text):
                rest = full[len(self._prefix_text):]
            self._prefix_offset = self._read_offset = len(self._ids)
            self._prefix_text = None
        if rest:
            self._pieces.append(rest)
            self._length += len(rest)
        self._delta.append(self._unreleased + rest)
        self._unreleased = ""

    def take_delta(self) -> str:
        """Text released since the previous call."""
        if not self._delta:
            return ""
        out = "".join(self._delta) if len(self._delta) > 1 else self._delta[0]
        self._delta = []
        return out
