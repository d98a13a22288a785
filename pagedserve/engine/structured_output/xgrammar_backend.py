"""xgrammar behind the engine's grammar interface: validate a spec, compile it for the model's
vocabulary, and one matcher per sequence (accept a token, fill its row of the token bitmask).

Chosen over llguidance by measurement (loadtest/PERF.md, ``python -m pagedserve.loadtest.micro.bench_grammar``).
xgrammar imports torch, so it is imported on first use, off the event loop (the compile pool).
Its compile and mask calls release the GIL: a compile in the pool never stalls the loop.

JSON is generated compact (``any_whitespace=False``): a small model left free to add whitespace
can spend its whole token budget on it. vLLM allows any whitespace by default.
"""
from __future__ import annotations

import json
import logging
import threading
from typing import Any

from pagedserve.engine.sampling_params import StructuredOutputsParams
from pagedserve.engine.structured_output.schema_check import unsupported_keyword

logger = logging.getLogger(__name__)


class GrammarError(ValueError):
    """The spec cannot be turned into a grammar (bad schema, unsupported keyword, bad regex or
    EBNF); the message carries the library's reason (HTTP 400)."""


def _reason(e: BaseException) -> str:
    # xgrammar prefixes "[hh:mm:ss] /project/cpp/file.cc:123: "; keep the reason only.
    text = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
        head, sep, rest = text.partition(": ")
        if sep and (".cc:" in head or ".h:" in head):
            text = rest
    return text


def preload() -> None:
    """Import xgrammar (and with it torch: seconds of GIL-holding work). A server calls this
    while its workers load the model, so the first structured request does not stall the loop."""
    try:
        import xgrammar  # noqa: F401
    except Exception as e:  # noqa: BLE001 - structured outputs then fail per request, with the reason
        logger.warning("xgrammar cannot be imported (structured outputs will fail): %s", e)


def build_tokenizer_info(tokenizer, vocab_size: int):
    """xgrammar's view of our tokenizer (engine/tokenizer.py wraps a ``tokenizers.Tokenizer``);
    ``vocab_size`` is the model's logits width (may exceed the tokenizer's)."""
    import xgrammar as xgr

    backend = tokenizer._tok
    vocab = backend.get_vocab(with_added_tokens=True)
    encoded = [""] * vocab_size
    for token, idx in vocab.items():
        if idx < vocab_size:
            encoded[idx] = token
    try:
        meta = xgr.TokenizerInfo._detect_metadata_from_hf(backend.to_str())
    except Exception:  # noqa: BLE001 - fall back to what the vocabulary says
        vtype = xgr.TokenizerInfo._detect_vocab_type_from_vocab(vocab) or xgr.VocabType.RAW
        meta = {"vocab_type": vtype, "add_prefix_space": False}
    stop = list(tokenizer.eos_token_ids) or None
    return xgr.TokenizerInfo(encoded, meta["vocab_type"], vocab_size=vocab_size, stop_token_ids=stop,
                             add_prefix_space=meta["add_prefix_space"])


def choice_ebnf(choices: list[str]) -> str:
    # JSON string literals are valid EBNF string literals for xgrammar (same escapes).
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class XGrammarMatcher:
    """One sequence's position in its grammar."""

    __slots__ = ("_m",)

    def __init__(self, matcher) -> None:
        self._m = matcher

    def accept(self, token_id: int) -> bool:
        return self._m.accept_token(token_id)

    def fill(self, bitmask, row: int) -> None:
        """Write row ``row`` of ``bitmask`` (numpy int32 [rows, words]): bit t set = token t allowed."""
        self._m.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return self._m.is_terminated()


class XGrammarBackend:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int, compile_threads: int = 1):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.compile_threads = compile_threads
        self._compiler = None
        self._lock = threading.Lock()

    def _xgr(self):
        import xgrammar as xgr

        return xgr

    def validate(self, spec: StructuredOutputsParams) -> Any:
        """The spec as an (uncompiled) xgrammar Grammar; GrammarError with the reason if it has none."""
        xgr = self._xgr()
        kind = spec.kind
        try:
            if kind == "json":
                bad = unsupported_keyword(spec.json)
                if bad is not None:
                    raise GrammarError(f"unsupported JSON schema: {bad}")
                return xgr.Grammar.from_json_schema(json.dumps(spec.json), any_whitespace=False)
            if kind == "json_object":
                return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False)
            if kind == "regex":
                return xgr.Grammar.from_regex(spec.regex)
            if kind == "choice":
                return xgr.Grammar.from_ebnf(choice_ebnf(spec.choice))
            if "::=" in spec.grammar:
                return xgr.Grammar.from_ebnf(spec.grammar)
            return xgr.Grammar.from_lark(spec.grammar)  # Lark syntax ("start: ...")
        except GrammarError:
            raise
        except Exception as e:  # noqa: BLE001 - the library's own error types vary by version
            what = {"json": "JSON schema", "json_object": "JSON schema", "regex": "regex",
                    "choice": "choice", "grammar": "grammar"}[kind]
            raise GrammarError(f"invalid {what}: {_reason(e)}") from None

    def compile(self, grammar) -> Any:
        """Token-level compile for this model's vocabulary (the slow part: run it off the loop)."""
        with self._lock:
            if self._compiler is None:
                xgr = self._xgr()
                info = build_tokenizer_info(self.tokenizer, self.vocab_size)
                # The engine keeps its own cache of compiled grammars (manager.py).
                self._compiler = xgr.GrammarCompiler(info, max_threads=self.compile_threads,
                                                     cache_enabled=False)
        try:
            return self._compiler.compile_grammar(grammar)
        except Exception as e:  # noqa: BLE001
            raise GrammarError(f"the grammar cannot be compiled: {_reason(e)}") from None

    def new_matcher(self, compiled) -> XGrammarMatcher:
        return XGrammarMatcher(self._xgr().GrammarMatcher(compiled))
