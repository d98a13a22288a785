"""Which build of each C kernel runs on this CPU: one table, one override, one function.

Every kernel in csrc/ is compiled for one vector ISA with explicit ``-m`` flags, never
``-march=native``, so a cached build (kernels/cbuild.py) stays valid on any CPU with the same
extensions. ``KERNELS`` lists, per kernel, its builds best first: the level, the /proc/cpuinfo
flags it needs, the compiler flags it is built with. The order is the measured preference (the
comments say where it was measured). ``choose(kernel)`` answers "which build of this kernel here";
every loader asks it, and ``python -m pagedserve.kernels.build_all`` builds each answer at install.

``PAGEDSERVE_ISA=<level>`` caps every kernel at that level (tests, benchmarks, comparisons): each
takes its best build at or below it that this CPU runs, and a kernel with none is off (its torch
path runs). The levels, in the order the CPUs gained them: scalar < avx2 < avx512 (Skylake-SP) <
vnni (Cascade Lake) < avx512bf16 (Cooper Lake) < amx (Sapphire Rapids). A build marked ``opt_in``
(the quantized row kernel's AVX-512 one, measured no faster) runs only where the override names it.
"""
from __future__ import annotations

import functools
from collections.abc import Set
from dataclasses import dataclass

from pagedserve.contracts import env

LEVELS = ("scalar", "avx2", "avx512", "vnni", "avx512bf16", "amx")

_AVX2 = frozenset({"avx2", "fma", "f16c"})  # f16c: fp16 scales and fp8 KV (csrc/fp8.h) in one instruction
_AVX512 = _AVX2 | {"avx512f", "avx512bw"}
_VNNI = _AVX512 | {"avx512_vnni"}
_AMX = frozenset({"avx512_bf16", "amx_tile", "amx_bf16"})


@dataclass(frozen=True)
class Build:
    level: str
    needs: frozenset[str]  # /proc/cpuinfo flags
    cflags: tuple[str, ...]
    opt_in: bool = False  # only where PAGEDSERVE_ISA names this level
    source: str | None = None  # this build's own source in kernels/csrc (else the kernel's)


@dataclass(frozen=True)
class Kernel:
    source: str  # in kernels/csrc
    builds: tuple[Build, ...]  # best first
    common_flags: tuple[str, ...] = ()  # every build's, before its ISA flags

    def flags(self, build: Build) -> list[str]:
        return [*self.common_flags, *build.cflags]

    def source_of(self, build: Build) -> str:
        """The file a build compiles: one ISA's code can live in its own source (same exports)."""
        return build.source or self.source


_M_AVX2 = ("-mavx2", "-mfma", "-mf16c")
_M_AVX512 = (*_M_AVX2, "-mavx512f", "-mavx512bw")
_M_VNNI = (*_M_AVX512, "-mavx512vnni")

KERNELS: dict[str, Kernel] = {
    # The quantized row-layout matmul (kernels/qgemm.py). AVX-512 is opt-in: on an AVX-512/AMX box it
    # was no faster for q8_0 and ~20 % slower for q4_1 than AVX2 (loadtest/PERF.md), decode being
    # bound by the weight stream.
    "qgemm": Kernel("qgemm.c", (
        Build("avx512", _AVX512, _M_AVX512, opt_in=True),
        Build("avx2", _AVX2, _M_AVX2),
        Build("scalar", frozenset(), ()),
    )),
    # q8_0 / q4_1 on 16 channels side by side (kernels/qgemm_n16.py): 2x the row kernel for one row of
    # q4_1, 3.8x for 16 rows (loadtest/PERF.md); where it builds it replaces the row kernel for those.
    # The AVX2 build (its own source) replaces the AVX2 row kernel the same way (PERF.md, twelfth session).
    "qgemm_n16": Kernel("qgemm_n16.c", (
        Build("vnni", _VNNI, _M_VNNI),
        Build("avx2", _AVX2, _M_AVX2, source="qgemm_n16_avx2.c"),
    )),
    # AMX bf16 tiles on the n16 layout for bf16 batches: 6.8x the row kernel at 16 rows (PERF.md).
    "qgemm_amx": Kernel("qgemm_amx.c", (
        Build("amx", _VNNI | _AMX, (*_M_VNNI, "-mavx512bf16", "-mamx-tile", "-mamx-bf16")),)),
    # Decode attention (kernels/cpu_attention.py): the widest build the CPU runs.
    "paged_attn": Kernel("paged_attn.c", (
        Build("avx512bf16", _AVX512 | {"avx512_bf16"}, (*_M_AVX512, "-mavx512bf16")),
        Build("avx512", _AVX512, _M_AVX512),
        Build("avx2", _AVX2, _M_AVX2),
        Build("scalar", frozenset(), ()),
    )),
    # AMX decode attention for bf16 caches (kernels/attn_amx.py): 1.2-2.2x the AVX-512 kernel at
    # batch 1-16, contexts 128-1024 (loadtest/PERF.md, "AMX decode attention").
    "paged_attn_amx": Kernel("paged_attn_amx.c", (
        Build("amx", frozenset({"avx2", "fma", "avx512f", "avx512bw"}) | _AMX,
              ("-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512bf16", "-mamx-tile", "-mamx-bf16")),)),
    # Fused decode ops (kernels/fused.py): the bf16 GEMV needs AVX512-BF16 (about 2x torch's bf16
    # GEMV there, PERF.md); elsewhere AVX2 auto-vectorisation. -ffp-contract=off: a*b - c*d rounds as
    # the eager torch ops it replaces.
    "fused_cpu": Kernel("fused_cpu.c", (
        Build("avx512bf16", frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_bf16"}),
              ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mfma")),
        Build("avx2", frozenset({"avx2", "fma"}), ("-mavx2", "-mfma")),
        Build("scalar", frozenset(), ()),
    ), common_flags=("-ffp-contract=off",)),
    # A MoE block's decode step in one call (kernels/moe_cpu.py): routing and SiLU here, the linears in
    # the kernels above by address. -ffp-contract=off: out += y * w rounds as the eager index_add_.
    "moe_cpu": Kernel("moe_cpu.c", (
        Build("avx512", _AVX512, _M_AVX512),
        Build("avx2", _AVX2, _M_AVX2),
        Build("scalar", frozenset(), ()),
    ), common_flags=("-ffp-contract=off",)),
    # Greedy / temperature sampling of plain rows (kernels/sample_cpu.py): 16 or 8 lanes; no scalar
    # build (torch's sampling runs instead).
    "sample_cpu": Kernel("sample_cpu.c", (
        Build("avx512", frozenset({"avx512f", "avx512bw", "avx512vl", "fma"}),
              ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mfma")),
        Build("avx2", frozenset({"avx2", "fma"}), ("-mavx2", "-mfma")),
    )),
}

_UNSET = object()


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags (from /proc/cpuinfo; from torch's dispatch level where that is absent)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    import torch

    cap = torch.backends.cpu.get_cpu_capability()
    if cap == "AVX512":  # (no way to tell bf16 support from torch's level)
        return frozenset({"avx2", "fma", "avx512f", "avx512bw"})
    return frozenset({"avx2", "fma"}) if cap == "AVX2" else frozenset()


def choose(kernel: str, cpu: Set[str] | None = None, cap=_UNSET) -> Build | None:
    """The build of ``kernel`` to run on a CPU with flags ``cpu`` (default: this one) under the level
    cap ``cap`` (default: PAGEDSERVE_ISA; None: no cap), or None where no build fits."""
    if cpu is None:
        cpu = cpu_flags()
    if cap is _UNSET:
        cap = env.ISA.get()
    top = LEVELS.index(cap) if cap else len(LEVELS) - 1
    for build in KERNELS[kernel].builds:
        if build.opt_in and build.level != cap:
            continue
        if LEVELS.index(build.level) <= top and build.needs <= cpu:
            return build
    return None


def levels_here(kernel: str) -> list[str]:
    """Every level of ``kernel`` this CPU runs, best first (each one a test may force)."""
    cpu = cpu_flags()
    return list(dict.fromkeys(b.level for b in KERNELS[kernel].builds if b.needs <= cpu))



def level_missing(level: str, cpu: Set[str] | None = None) -> list[str]:
    """The /proc/cpuinfo flags a CPU (default: this one) lacks for the builds at ``level``, every
    kernel's together: empty where it runs them all."""
    if cpu is None:
        cpu = cpu_flags()
    needs = frozenset().union(*(b.needs for k in KERNELS.values() for b in k.builds if b.level == level))
    return sorted(needs - cpu)
