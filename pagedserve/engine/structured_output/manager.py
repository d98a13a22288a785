"""Grammars for the engine core: validated at request time, compiled in a thread, cached by spec,
and each step's token bitmask built for the constrained rows that sample.

Compiling a grammar for the vocabulary takes from a few ms to about a second (xgrammar, JSON
schemas with string formats); it runs in a small pool of its own (engine/prep_pools.py; the
library releases the GIL), so the event loop and the other requests' steps never wait for it. A
request whose grammar is still compiling is held by EngineCore outside the scheduler until its
future is done, or until ``compile_timeout_s`` (--grammar-compile-timeout) passes: then it fails
with a 400 naming the limit. xgrammar cannot cancel a compile: one past its deadline runs on in
its thread, which the pool replaces (so it starves no other compile), and identical specs share
that one compile (``compiled`` is keyed by spec) instead of starting more.
"""
from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections import OrderedDict

import numpy as np

from pagedserve.engine.sampling_params import SamplingParams, StructuredOutputsParams
from pagedserve.engine.structured_output.constraint import BadWords, SeqConstraint, bad_word_token_seqs, ids_to_row, words_for
from pagedserve.engine.prep_pools import DeadlinePool
from pagedserve.engine.structured_output.xgrammar_backend import GrammarError, XGrammarBackend

logger = logging.getLogger(__name__)

CACHE_SIZE = 256  # distinct grammars kept (compiled and validated)
BAD_WORDS_CACHE = 256  # distinct bad-word lists kept, tokenized and indexed
COMPILE_THREADS = 2  # grammars compiled at once (each compile is single-threaded in xgrammar)
DEFAULT_COMPILE_TIMEOUT_S = 10.0  # contracts/config.py PrepConfig.grammar_compile_timeout


class StructuredOutputManager:
    def __init__(self, tokenizer, vocab_size: int, backend=None,
                 compile_timeout_s: float | None = DEFAULT_COMPILE_TIMEOUT_S):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.words = words_for(vocab_size)
        self.backend = backend or XGrammarBackend(tokenizer, vocab_size)
        self._validated: OrderedDict[tuple, object] = OrderedDict()  # key -> Grammar | GrammarError
        self._compiled: OrderedDict[tuple, concurrent.futures.Future] = OrderedDict()
        self._lock = threading.Lock()  # validate() may run in the app's pool and on the loop
        # Bad words, tokenized and indexed by check() in the grammar pool, found again by
        # new_constraint() on the event loop (issue 37: they were tokenized on the loop).
        self._bad_words: OrderedDict[tuple[str, ...], BadWords | None] = OrderedDict()
        self.compile_timeout_s = compile_timeout_s or None
        # Validation (parsing the spec) and compiles: bounded, with the deadline, apart from the
        # tokenizer and the chat template's pools.
        self.pool = DeadlinePool("grammar", COMPILE_THREADS, self.compile_timeout_s,
                                 what="compiling the structured-output grammar",
                                 flag="--grammar-compile-timeout", max_queued=1024)
        self._tasks: dict[tuple, object] = {}  # key -> the pool task of a compile in progress
        self.num_compiles = 0

    # ---- request time -----------------------------------------------------------------------

    def validate(self, spec: StructuredOutputsParams):
        """The spec's grammar (cached); raises GrammarError with the library's reason."""
        key = spec.key
        with self._lock:
            hit = self._validated.get(key)
            if hit is not None:
                self._validated.move_to_end(key)
        if hit is None:
            try:
                hit = self.backend.validate(spec)
            except GrammarError as e:
                hit = e
            with self._lock:
                self._validated[key] = hit
                if len(self._validated) > CACHE_SIZE:
                    self._validated.popitem(last=False)
        if isinstance(hit, GrammarError):
            raise GrammarError(str(hit))
        return hit

    def bad_words(self, words: list[str]) -> BadWords | None:
        """``words`` tokenized (as written and after a space) and indexed, once per distinct list
        while it is among the last BAD_WORDS_CACHE: the first call, in check() off the loop, does
        the work; the request's own sequences on the loop find it done."""
        key = tuple(words)
        with self._lock:
            if key in self._bad_words:
                self._bad_words.move_to_end(key)
                return self._bad_words[key]
        seqs = bad_word_token_seqs(self.tokenizer, words)
        built = BadWords(seqs) if seqs else None
        with self._lock:
            self._bad_words[key] = built
            if len(self._bad_words) > BAD_WORDS_CACHE:
                self._bad_words.popitem(last=False)
        return built

    def check(self, params: SamplingParams) -> None:
        """Everything about a request's token constraint that can be refused (HTTP 400); its bad
        words are tokenized here (AsyncEngine.check_constraint runs this off the loop)."""
        if params.bad_words:
            self.bad_words(params.bad_words)
        if params.allowed_token_ids:
            bad = [t for t in params.allowed_token_ids if t >= self.vocab_size]
            if bad:
                raise GrammarError(f"allowed_token_ids holds token id {bad[0]}, past the vocabulary "
                                   f"(ids 0..{self.vocab_size - 1})")
        if params.structured_outputs is not None:
            self.validate(params.structured_outputs)

    def compiled(self, spec: StructuredOutputsParams) -> concurrent.futures.Future:
        """A future of the compiled grammar: done at once on a cache hit, else compiled in the
        background thread (one compile per distinct spec, however many requests ask)."""
        key = spec.key
        with self._lock:
            fut = self._compiled.get(key)
            if fut is not None and not (fut.done() and fut.exception() is not None):
                self._compiled.move_to_end(key)
                return fut
            task = self.pool.submit(self._compile, spec)  # PrepBusyError when 1024 wait
            fut = task.future
            self._compiled[key] = fut
            self._tasks[key] = task
            fut.add_done_callback(lambda _f, key=key: self._tasks.pop(key, None))
            if len(self._compiled) > CACHE_SIZE:
                self._compiled.popitem(last=False)
            return fut

    def release_overdue(self) -> None:
        """Compiles running past the deadline stop counting against the pool (their threads run
        on; xgrammar cannot be interrupted), so later compiles get threads."""
        if not self.compile_timeout_s:
            return
        now = time.monotonic()
        for task in list(self._tasks.values()):
            if task.started is not None and not task.future.done() and now - task.started > self.compile_timeout_s:
                self.pool.abandon(task)

    def deadline_error(self, param: str | None = None):
        return self.pool.deadline_error(self.compile_timeout_s, param)

    def _compile(self, spec: StructuredOutputsParams):
        grammar = self.validate(spec)
        self.num_compiles += 1
        return self.backend.compile(grammar)

    def new_constraint(self, params: SamplingParams) -> SeqConstraint:
        allowed = ids_to_row(params.allowed_token_ids, self.vocab_size) if params.allowed_token_ids else None
        bad = self.bad_words(params.bad_words) if params.bad_words else None
        spec = params.structured_outputs
        wait = None
        if spec is not None and spec.start_after:
            wait = tuple(self.tokenizer.encode(spec.start_after, add_special_tokens=False))
        return SeqConstraint(allowed, bad, wait)

    def attach_matcher(self, constraint: SeqConstraint, compiled) -> None:
        constraint.matcher = self.backend.new_matcher(compiled)

    # ---- each step --------------------------------------------------------------------------

    def step_masks(self, constraints: list[SeqConstraint], seqs: list) -> bytes:
        """The packed int32 bitmask of constrained sampling sequences (one row each)."""
        mask = np.empty((len(constraints), self.words), dtype=np.int32)
        for r, (c, seq) in enumerate(zip(constraints, seqs)):
            c.fill(mask, r, seq.token_ids, seq.num_prompt_tokens)
        return mask.tobytes()

    def shutdown(self) -> None:
        self.pool.shutdown()


