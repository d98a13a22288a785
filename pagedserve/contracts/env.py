"""Every ``PAGEDSERVE_*`` environment switch, declared once: name, type, default, one line of doc.

This module is the only reader of those variables (tests/contracts/test_env.py holds it). A switch is
read when asked, never frozen at import, so a test or a worker sees the environment it runs in.
One spelling rule for on/off switches everywhere; a value that does not parse is a ConfigError
naming the variable, not a silent default. ``pagedserve env`` prints this table.

Switches are for overrides and diagnostics; a real choice a user makes belongs on a config field
and a CLI flag (contracts/config.py), and rooms pass it as a parameter, never through here.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from pagedserve.contracts.config import ConfigError

T = TypeVar("T")

_ON = ("1", "true", "yes", "on")
_OFF = ("0", "false", "no", "off")


def flag(raw: str) -> bool:
    value = raw.lower()
    if value in _ON:
        return True
    if value in _OFF:
        return False
    raise ValueError(f"use one of {', '.join(_ON + _OFF)}")


def flag_or(*words: str) -> Callable[[str], str]:
    """A tri-state: "on" / "off" in flag()'s spellings, or one of ``words`` as given."""
    def parse(raw: str) -> str:
        value = raw.lower()
        if value in words:
            return value
        try:
            return "on" if flag(value) else "off"
        except ValueError:
            raise ValueError(f"use one of {', '.join(_ON + _OFF + words)}") from None
    parse.options = ("0", "1") + words  # type: ignore[attr-defined]
    return parse


def choice(*options: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        value = raw.lower()
        if value not in options:
            raise ValueError(f"use one of {', '.join(options)} (or leave it unset)")
        return value
    parse.options = options  # type: ignore[attr-defined]
    return parse


def positive_int(raw: str) -> int:
    value = int(raw)
    if value < 1:
        raise ValueError("must be >= 1")
    return value


def positive_float(raw: str) -> float:
    value = float(raw)
    if not value > 0:
        raise ValueError("must be > 0")
    return value


def text(raw: str) -> str:
    return raw


@dataclass(frozen=True)
class Switch(Generic[T]):
    name: str
    parse: Callable[[str], T]
    default: T
    doc: str

    def get(self) -> T:
        """The parsed value, or the default when the variable is unset or empty."""
        raw = os.environ.get(self.name, "").strip()
        if not raw:
            return self.default
        try:
            return self.parse(raw)
        except ValueError as e:
            raise ConfigError(f"{self.name}={raw!r}: {e}") from None

    def is_set(self) -> bool:
        return bool(os.environ.get(self.name, "").strip())

    def put(self, value: str | None) -> None:
        """Set (None: unset) the variable for this process and its children: the in-process
        benchmarks that compare a switch's two sides (loadtest/micro) write it only through here."""
        if value is None:
            os.environ.pop(self.name, None)
        else:
            self.parse(value)  # a value that would not parse is refused here, not at the next read
            os.environ[self.name] = value

    def raw(self) -> str:
        """The value as written (stripped; "" when unset), for ``pagedserve env --set``."""
        return os.environ.get(self.name, "").strip()

    @property
    def values(self) -> str:
        options = getattr(self.parse, "options", None)  # choice() parsers carry their options
        if options:
            return "|".join(options)
        return {flag: "0|1", positive_int: "int >= 1", positive_float: "seconds > 0"}.get(
            self.parse, "text")


SWITCHES: dict[str, Switch[Any]] = {}


def _declare(name: str, parse: Callable[[str], T], default: T, doc: str) -> Switch[T]:
    switch = Switch("PAGEDSERVE_" + name, parse, default, doc)
    assert switch.name not in SWITCHES, switch.name
    SWITCHES[switch.name] = switch
    return switch


API_KEY = _declare("API_KEY", text, None, "default of --api-key: the bearer token /v1/* requires")
KERNEL_CACHE = _declare("KERNEL_CACHE", text, None,
                        "where built C kernels are cached (default ~/.cache/pagedserve/kernels)")
FUSED = _declare("FUSED", flag, True, "0: no fused C CPU ops (RMSNorm, rotary, SiLU-mul, decode layer)")
FAST_DECODE = _declare("FAST_DECODE", flag_or("layer"), "on",
                       "off/0: no C decode layers; layer: one C call per layer half, not per stack")
SAMPLE_C = _declare("SAMPLE_C", flag, True, "0: every row samples on the torch path, not the C pass")
CPU_ATTENTION = _declare("CPU_ATTENTION", choice("c", "torch"), "c",
                         "torch: CPU decode attention on the torch path instead of the C kernel")
PACKED_LINEAR = _declare("PACKED_LINEAR", flag, True,
                         "0: no oneDNN-packed weights for CPU linears (plain F.linear)")
PACKED_SMALL_ROWS = _declare("PACKED_SMALL_ROWS", flag, True,
                             "0: small batches use the packed copy too (one copy of each weight)")
ISA = _declare("ISA", choice("scalar", "avx2", "avx512", "vnni", "avx512bf16", "amx"), None,
               "cap every C kernel at this vector level (kernels/isa.py); default: the best this CPU runs")
STEP_TRANSPORT = _declare("STEP_TRANSPORT", choice("shm", "pipe"), None,
                          "default of --step-transport; unset: the shm ring where it is safe (x86)")
RAY_TRANSPORT = _declare("RAY_TRANSPORT", choice("shm", "ray"), None,
                         "Ray executor step transport; default: the ring on one node, Ray calls across")
RAY_OBJECT_STORE_BYTES = _declare("RAY_OBJECT_STORE_BYTES", positive_int, 128 << 20,
                                  "object store of a Ray instance started locally")
RAY_PLACEMENT_TIMEOUT = _declare("RAY_PLACEMENT_TIMEOUT", positive_float, 120.0,
                                 "seconds serve waits for Ray to place the workers")
WORKER_STARTUP_TIMEOUT = _declare("WORKER_STARTUP_TIMEOUT", positive_float, 600.0,
                                  "seconds a worker may take to load the model and report ready")
WORKER_THREADS = _declare("WORKER_THREADS", positive_int, None,
                          "default of --worker-threads; unset: the CPUs this process may use / world")


def forwarded() -> dict[str, str]:
    """The switches set here, for a process started elsewhere (a Ray actor) to see the same."""
    return {name: os.environ[name] for name in SWITCHES if name in os.environ}


def table() -> list[tuple[str, str, str, str]]:
    """(name, values, default, doc) rows, for ``pagedserve env`` and the docs."""
    return [(s.name, s.values, _shown(s.default), s.doc) for s in SWITCHES.values()]


def _shown(default: Any) -> str:
    if default is None:
        return ""
    if isinstance(default, bool):  # as the variable is written: 0 | 1
        return str(int(default))
    return str(default)
