"""User-facing sampling settings with OpenAI / vLLM semantics, validated on construction.

The engine converts them into ``gpu.messages.SamplingOptions`` (one per sequence) for the
device-side sampler; the stop conditions (EOS, stop strings, max/min tokens) stay here.
"""
from __future__ import annotations

import math
import secrets
from collections.abc import Iterable
from dataclasses import dataclass, field

from engine.errors import SamplingParamsError
from gpu.messages import SamplingOptions

MAX_LOGPROBS = 20
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
            self._check_int("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            self._check_int("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS)

    # ---- validation helpers -----------------------------------------------------------------

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
        out: list[str] = []
        for s in items:
            if not isinstance(s, str) or not s:
                raise SamplingParamsError("stop", f"stop strings must be non-empty strings, got {s!r}")
            if s not in out:
                out.append(s)
        return out

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
