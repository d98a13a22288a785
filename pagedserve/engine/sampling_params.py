"""User-facing sampling settings with OpenAI / vLLM semantics, validated on construction.

The engine converts them into ``contracts.messages.SamplingOptions`` (one per sequence) for the
device-side sampler; the stop conditions (EOS, stop strings, max/min tokens) stay here.
"""
from __future__ import annotations

import copy
import json
import math
import secrets
from collections.abc import Iterable
from dataclasses import dataclass, field

from pagedserve.engine.errors import SamplingParamsError
from pagedserve.contracts.messages import SamplingOptions

# logprobs / prompt_logprobs have no fixed bound here: the engine holds a request to its
# max_logprobs (contracts.config.ModelConfig; --max-logprobs, LLM(max_logprobs=...)) in add_request.
MAX_N = 128
SEED_LIMIT = 2**63  # seeds live in [0, 2**63) so they survive msgpack and torch generators
# Every integer setting reaches the workers inside a msgpack-encoded step and the worker's int64
# tensors: one past int64 failed the encode of the whole step (every request in it), so each is
# refused here, naming its field, before the request can reach the engine.
INT64_LIMIT = 2**63


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@dataclass(slots=True)
class StructuredOutputsParams:
    """Constrain the output to a JSON schema, a regex, one of some strings, an EBNF/Lark grammar,
    or any JSON object (vLLM's ``structured_outputs``); exactly one is set. Shapes are checked
    here; whether the grammar engine accepts the schema is checked when the request is added
    (engine/structured_output), with the library's reason in the error."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # The grammar binds only the text after this marker (vLLM's reasoning end: "</think>"): until
    # the sequence has generated its tokens, sampling is free. Not part of the grammar (``key``).
    start_after: str | None = None
    _key: tuple[str, str] | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        set_ = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        if self.json_object:
            set_.append("json_object")
        elif self.json_object is not None and self.json_object is not False:
            raise ValueError(f"json_object must be true or false, got {self.json_object!r}")
        if len(set_) != 1:
            raise ValueError("structured outputs need exactly one of json, regex, choice, grammar or "
                             f"json_object (true); got {', '.join(set_) if set_ else 'none'}")
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    self.json = json.loads(self.json)
                except ValueError as e:
                    raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
            if not isinstance(self.json, dict):
                raise ValueError("the JSON schema must be a JSON object (a dict), got "
                                 f"{type(self.json).__name__}")
        if self.start_after is not None and (not isinstance(self.start_after, str) or not self.start_after):
            raise ValueError(f"start_after must be a non-empty string, got {self.start_after!r}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name} must be a non-empty string, got {value!r}")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice:
                raise ValueError("choice must be a non-empty list of strings")
            if not all(isinstance(c, str) for c in self.choice):
                raise ValueError("choice must be a list of strings")
            self.choice = list(self.choice)

    @property
    def kind(self) -> str:
        for k in ("json", "regex", "choice", "grammar"):
            if getattr(self, k) is not None:
                return k
        return "json_object"

    @property
    def key(self) -> tuple[str, str]:
        """Cache key of the compiled grammar: the kind and its spec as compact JSON (property
        order kept: it is the order the properties are generated in). Serialised once: a large
        schema is looked up several times per request (validation, compile, admission)."""
        if self._key is None:
            value = getattr(self, self.kind)
            self._key = self.kind, value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))
        return self._key


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = off (stored as 0)
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None  # normalised to a list
    stop_token_ids: list[int] | None = None  # normalised to a list
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None = up to the context length
    min_tokens: int = 0
    logprobs: int | None = None  # top-N alternatives of each sampled token (0 = only the sampled one)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    # Only these token ids may be sampled (vLLM's allowed_token_ids).
    allowed_token_ids: list[int] | None = None
    # Words never to generate: a word's last token is banned when the tokens before it were
    # just generated (a one-token word is always banned), as vLLM's bad_words.
    bad_words: list[str] | None = None
    # Filled by __post_init__; not user settings.
    _stop_list: list[str] = field(default_factory=list, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._check_int("n", self.n, 1, MAX_N)
        self._check_float("temperature", self.temperature, lo=0.0, desc=">= 0 (0 = greedy)")
        self._check_float("top_p", self.top_p, lo=0.0, hi=1.0, lo_open=True, desc="in (0, 1]")
        if (not _is_int(self.top_k) or (self.top_k < 1 and self.top_k not in (0, -1))
                or self.top_k >= INT64_LIMIT):
            raise SamplingParamsError(
                "top_k", f"top_k must be -1 or 0 (disabled) or a positive integer below 2**63, "
                f"got {self.top_k!r}")
        if self.top_k == -1:
            self.top_k = 0
        self._check_float("min_p", self.min_p, lo=0.0, hi=1.0, desc="in [0, 1]")
        self._check_float("presence_penalty", self.presence_penalty, lo=-2.0, hi=2.0, desc="in [-2, 2]")
        self._check_float("frequency_penalty", self.frequency_penalty, lo=-2.0, hi=2.0, desc="in [-2, 2]")
        self._check_float("repetition_penalty", self.repetition_penalty, lo=0.0, lo_open=True,
                          desc="> 0 (1 = off)")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise SamplingParamsError(
                    "logit_bias", f"logit_bias must map token ids to biases, got {type(self.logit_bias).__name__}")
            bias: dict[int, float] = {}
            for key, value in self.logit_bias.items():
                tid = self._token_id("logit_bias", key)
                if not _is_number(value) or not -100.0 <= value <= 100.0:
                    raise SamplingParamsError(
                        "logit_bias", f"logit_bias values must be in [-100, 100], got {value!r} for token {tid}")
                bias[tid] = float(value)
            self.logit_bias = bias or None
        if self.seed is not None:
            if not _is_int(self.seed) or not 0 <= self.seed < SEED_LIMIT:
                raise SamplingParamsError("seed", f"seed must be an integer in [0, 2**63 - 1], got {self.seed!r}")
        self._stop_list = self._normalise_stop(self.stop)
        self.stop = list(self._stop_list) if self.stop is not None else None
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        else:
            if isinstance(self.stop_token_ids, (str, bytes)) or not isinstance(self.stop_token_ids, Iterable):
                raise SamplingParamsError("stop_token_ids", "stop_token_ids must be a list of token ids")
            self.stop_token_ids = [self._token_id("stop_token_ids", t) for t in self.stop_token_ids]
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise SamplingParamsError(name, f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.max_tokens is not None:
            self._check_int("max_tokens", self.max_tokens, 1, None)
        self._check_int("min_tokens", self.min_tokens, 0, None)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise SamplingParamsError(
                "min_tokens", f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        if self.logprobs is not None:
            self._check_int("logprobs", self.logprobs, 0, None)
        if self.prompt_logprobs is not None:
            self._check_int("prompt_logprobs", self.prompt_logprobs, 0, None)
        self._check_token_masks()

    def _check_token_masks(self) -> None:
        so = self.structured_outputs
        if isinstance(so, dict):
            try:
                so = self.structured_outputs = StructuredOutputsParams(**so)
            except (TypeError, ValueError) as e:
                raise SamplingParamsError("structured_outputs", str(e)) from None
        if so is not None and not isinstance(so, StructuredOutputsParams):
            raise SamplingParamsError("structured_outputs", "structured_outputs must be a "
                                      f"StructuredOutputsParams, got {type(so).__name__}")
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
                raise SamplingParamsError("allowed_token_ids", "allowed_token_ids must be a list of token ids")
            ids = list(dict.fromkeys(self._token_id("allowed_token_ids", t) for t in ids))
            if not ids:
                raise SamplingParamsError("allowed_token_ids", "allowed_token_ids must hold at least one token id")
            self.allowed_token_ids = ids
        if self.bad_words is not None:
            words = self.bad_words
            if isinstance(words, (str, bytes)) or not isinstance(words, Iterable):
                raise SamplingParamsError("bad_words", "bad_words must be a list of strings")
            words = list(words)
            if not all(isinstance(w, str) and w for w in words):
                raise SamplingParamsError("bad_words", "bad_words must be non-empty strings")
            self.bad_words = list(dict.fromkeys(words))

    @property
    def has_token_constraint(self) -> bool:
        """The engine sends a per-step token mask for this request's sequences."""
        return bool(self.structured_outputs is not None or self.allowed_token_ids or self.bad_words)

    # ---- validation helpers -----------------------------------------------------------------

    def sibling(self, **changes) -> "SamplingParams":
        """A copy with some of ``max_tokens``, ``seed`` and ``prompt_logprobs`` changed, checking
        only those: the choices of one request (prompts x n) share its validated lists (stop,
        allowed_token_ids, bad_words, logit_bias), which are read-only from here on, instead of
        validating them again per choice on the event loop (issue 22)."""
        unknown = set(changes) - {"max_tokens", "seed", "prompt_logprobs"}
        if unknown:
            raise TypeError(f"sibling() cannot change {sorted(unknown)}")
        p = copy.copy(self)
        for name, value in changes.items():
            setattr(p, name, value)
        if "seed" in changes and p.seed is not None:
            if not _is_int(p.seed) or not 0 <= p.seed < SEED_LIMIT:
                raise SamplingParamsError("seed", f"seed must be an integer in [0, 2**63 - 1], got {p.seed!r}")
        if "max_tokens" in changes and p.max_tokens is not None:
            self._check_int("max_tokens", p.max_tokens, 1, None)
            if p.min_tokens > p.max_tokens:
                raise SamplingParamsError(
                    "min_tokens", f"min_tokens must be <= max_tokens ({p.max_tokens}), got {p.min_tokens}")
        if "prompt_logprobs" in changes and p.prompt_logprobs is not None:
            self._check_int("prompt_logprobs", p.prompt_logprobs, 0, None)
        return p

    def check_max_logprobs(self, max_logprobs: int) -> None:
        """``logprobs`` / ``prompt_logprobs`` within the engine's ``max_logprobs`` (-1: no cap),
        as vLLM checks them against its model config."""
        if max_logprobs < 0:
            return
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value > max_logprobs:
                raise SamplingParamsError(
                    name, f"Requested {name} of {value}, which is greater than max allowed: {max_logprobs} "
                          "(max_logprobs, --max-logprobs)")

    @staticmethod
    def _check_int(name: str, value, lo: int, hi: int | None) -> None:
        if not _is_int(value) or value < lo or value > (INT64_LIMIT - 1 if hi is None else hi):
            allowed = f"an integer in [{lo}, {hi}]" if hi is not None else f"an integer >= {lo} and below 2**63"
            raise SamplingParamsError(name, f"{name} must be {allowed}, got {value!r}")

    @staticmethod
    def _check_float(name: str, value, lo: float | None = None, hi: float | None = None,
                     lo_open: bool = False, desc: str = "") -> None:
        ok = _is_number(value)
        if ok and lo is not None:
            ok = value > lo if lo_open else value >= lo
        if ok and hi is not None:
            ok = value <= hi
        if not ok:
            raise SamplingParamsError(name, f"{name} must be a finite number {desc}, got {value!r}")

    @staticmethod
    def _token_id(name: str, value) -> int:
        if isinstance(value, str):  # JSON object keys arrive as strings
            try:
                value = int(value)
            except ValueError:
                raise SamplingParamsError(name, f"{name} token ids must be integers, got {value!r}") from None
        if not _is_int(value) or value < 0 or value >= INT64_LIMIT:
            raise SamplingParamsError(
                name, f"{name} token ids must be integers >= 0 and below 2**63, got {value!r}")
        return value

    @staticmethod
    def _normalise_stop(stop) -> list[str]:
        if stop is None:
            return []
        items = [stop] if isinstance(stop, str) else stop
        if not isinstance(items, (list, tuple)):
            raise SamplingParamsError("stop", f"stop must be a string or a list of strings, got {stop!r}")
        for s in items:
            if not isinstance(s, str) or not s:
                raise SamplingParamsError("stop", f"stop strings must be non-empty strings, got {s!r}")
        return list(dict.fromkeys(items))  # first occurrences, in order; linear (issue 22)

    # ---- derived views ----------------------------------------------------------------------

    @property
    def stop_strings(self) -> list[str]:
        return self._stop_list

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def to_sampling_options(self, index: int, eos_token_ids: Iterable[int] = ()) -> SamplingOptions:
        """The device-side settings of sequence ``index`` of a request.

        A seeded request gives sequence i the seed ``seed + i`` (mod 2**63); an unseeded one a
        random 63-bit seed, drawn once per sequence so it survives preemption.
        """
        seed = (self.seed + index) % SEED_LIMIT if self.seed is not None else secrets.randbits(63)
        blocked: list[int] = []
        if self.min_tokens > 0:
            if not self.ignore_eos:
                blocked.extend(eos_token_ids)
            blocked.extend(self.stop_token_ids)
        return SamplingOptions(
            temperature=float(self.temperature),
            top_p=float(self.top_p),
            top_k=int(self.top_k),
            min_p=float(self.min_p),
            presence_penalty=float(self.presence_penalty),
            frequency_penalty=float(self.frequency_penalty),
            repetition_penalty=float(self.repetition_penalty),
            logit_bias=dict(self.logit_bias) if self.logit_bias else None,
            seed=seed,
            logprobs=self.logprobs,
            prompt_logprobs=self.prompt_logprobs if index == 0 else None,
            min_tokens=self.min_tokens,
            min_tokens_blocked_ids=tuple(dict.fromkeys(blocked)),
        )


# Beam search's parameters, here as vLLM keeps them (engine/beam_search.py holds the rule).
MAX_BEAM_WIDTH = 64


@dataclass(slots=True)
class BeamSearchParams:
    """vLLM's BeamSearchParams. ``n``: how many beams to return (best first); None = all
    ``beam_width``. ``stop_token_ids`` end a beam like EOS does."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    n: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not _is_int(self.beam_width) or not 1 <= self.beam_width <= MAX_BEAM_WIDTH:
            raise SamplingParamsError("beam_width", f"beam_width must be an integer in [1, {MAX_BEAM_WIDTH}], "
                                      f"got {self.beam_width!r}")
        if not _is_int(self.max_tokens) or not 1 <= self.max_tokens < 2**63:
            raise SamplingParamsError("max_tokens", f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.ignore_eos, bool):
            raise SamplingParamsError("ignore_eos", f"ignore_eos must be true or false, got {self.ignore_eos!r}")
        for name in ("temperature", "length_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise SamplingParamsError(name, f"{name} must be a finite number, got {v!r}")
        if self.temperature < 0:
            raise SamplingParamsError("temperature", f"temperature must be >= 0, got {self.temperature!r}")
        if self.n is not None and (not _is_int(self.n) or not 1 <= self.n <= self.beam_width):
            raise SamplingParamsError("n", f"n (beams returned) must be an integer in [1, beam_width = "
                                      f"{self.beam_width}], got {self.n!r}")
        ids = self.stop_token_ids or []
        if isinstance(ids, (str, bytes)) or not all(_is_int(t) and 0 <= t < 2**63 for t in ids):
            raise SamplingParamsError("stop_token_ids", "stop_token_ids must be a list of token ids")
        self.stop_token_ids = list(dict.fromkeys(ids))

    @property
    def num_returned(self) -> int:
        return self.n if self.n is not None else self.beam_width

    @property
    def has_token_constraint(self) -> bool:  # read by the callers of SamplingParams
        return False

    def candidates_per_beam(self, num_stop_ids: int, vocab_size: int | None = None) -> int:
        """K: enough candidates that k live beams remain after the ones that end are removed.
        ``num_stop_ids`` counts only ids that can occur (in the vocabulary); K never exceeds
        ``vocab_size`` (there are no more candidates than tokens)."""
        k = max(2, 1 + num_stop_ids) * self.beam_width
        return min(k, vocab_size) if vocab_size else k
