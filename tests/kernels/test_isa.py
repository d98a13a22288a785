"""kernels/isa.py, the one table of kernel builds: for fake CPUs from AVX2-only to AMX, every kernel
gets the build (level and compiler flags) the six separate choices made before the table existed
(cbuild.pick_isa, qgemm.build_flags, fused._isa_flags, qgemm_n16.wanted, the NEEDS sets of
attn_amx and sample_cpu; read off commit b121f04), and PAGEDSERVE_ISA caps them as the per-kernel
variables it replaced forced them.

One choice changed on purpose: an AVX2 CPU without F16C (none is known) got a quantized row kernel
built with -mavx2 -mfma and no -mf16c, which does not compile (csrc/qgemm_avx2.h converts fp16
scales with F16C); it now gets the scalar build, as a CPU without AVX2 does."""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from pagedserve.contracts import env
from pagedserve.kernels import cbuild, isa

_AVX2 = {"sse4_2", "avx", "avx2", "fma", "f16c"}
CPUS = {
    "none": {"sse4_2"},
    "avx2_no_f16c": {"sse4_2", "avx", "avx2", "fma"},
    "avx2": _AVX2,  # this project's AMD EPYC box
    "avx512": _AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512cd", "avx512dq"},  # Skylake-SP
    "vnni": _AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"},
    "bf16": _AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16"},
    "amx": _AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16",
                    "amx_int8"},
}
KERNELS = ("qgemm", "qgemm_n16", "qgemm_amx", "paged_attn", "paged_attn_amx", "fused_cpu", "sample_cpu")
# The build level each kernel ran on each CPU (None: off, its torch path runs), one column per kernel.
# Changed on purpose since: qgemm_n16 on AVX2 (+F16C) CPUs without VNNI, its AVX2 build (it was off).
TODAY = {
    "none": ("scalar", None, None, "scalar", None, "scalar", None),
    "avx2_no_f16c": ("scalar", None, None, "scalar", None, "avx2", "avx2"),  # qgemm: was an avx2 build that failed
    "avx2": ("avx2", "avx2", None, "avx2", None, "avx2", "avx2"),
    "avx512": ("avx2", "avx2", None, "avx512", None, "avx2", "avx512"),
    "vnni": ("avx2", "vnni", None, "avx512", None, "avx2", "avx512"),
    "bf16": ("avx2", "vnni", None, "avx512bf16", None, "avx512bf16", "avx512"),
    "amx": ("avx2", "vnni", "amx", "avx512bf16", "amx", "avx512bf16", "avx512"),
}
# The full compiler flags of each (kernel, level), as the loaders passed them to the compiler (the
# cache key: the same flags load the same cached libraries).
FLAGS = {
    ("qgemm", "scalar"): [],
    ("qgemm", "avx2"): ["-mavx2", "-mfma", "-mf16c"],
    ("qgemm", "avx512"): ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw"],
    ("qgemm_n16", "avx2"): ["-mavx2", "-mfma", "-mf16c"],
    ("qgemm_n16", "vnni"): ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vnni"],
    ("qgemm_amx", "amx"): ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vnni", "-mavx512bf16",
                           "-mamx-tile", "-mamx-bf16"],
    ("paged_attn", "scalar"): [],
    ("paged_attn", "avx2"): ["-mavx2", "-mfma", "-mf16c"],
    ("paged_attn", "avx512"): ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw"],
    ("paged_attn", "avx512bf16"): ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512bf16"],
    ("paged_attn_amx", "amx"): ["-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512bf16", "-mamx-tile",
                                "-mamx-bf16"],
    ("fused_cpu", "scalar"): ["-ffp-contract=off"],
    ("fused_cpu", "avx2"): ["-ffp-contract=off", "-mavx2", "-mfma"],
    ("fused_cpu", "avx512bf16"): ["-ffp-contract=off", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16",
                                  "-mfma"],
    ("sample_cpu", "avx2"): ["-mavx2", "-mfma"],
    ("sample_cpu", "avx512"): ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mfma"],
}


def _flags(kernel: str, build: isa.Build | None) -> list[str] | None:
    return None if build is None else isa.KERNELS[kernel].flags(build)


@pytest.mark.parametrize("cpu", CPUS)
def test_every_kernel_gets_the_build_it_got_before_the_table(cpu: str) -> None:
    for kernel, level in zip(KERNELS, TODAY[cpu]):
        build = isa.choose(kernel, CPUS[cpu], cap=None)
        assert (build and build.level) == level, (cpu, kernel)
        if build is not None:
            assert _flags(kernel, build) == FLAGS[kernel, level], (cpu, kernel)


# What the per-kernel variables forced, per CPU, and the PAGEDSERVE_ISA value that forces the same:
# PAGEDSERVE_QGEMM_ISA=X (X in avx512 | avx2 | scalar | vnni) for the three quantized kernels,
# PAGEDSERVE_ATTN_ISA=X for the two attention kernels, PAGEDSERVE_FUSED_ISA=X for the fused ops.
FORCED = {
    ("avx512", ("qgemm", "qgemm_n16", "qgemm_amx")): {
        "none": ("scalar", None, None), "avx2": ("avx2", "avx2", None),
        "avx512": ("avx512", "avx2", None), "vnni": ("avx512", "avx2", None), "bf16": ("avx512", "avx2", None),
        "amx": ("avx512", "avx2", None)},
    ("avx2", ("qgemm", "qgemm_n16", "qgemm_amx")): {
        "none": ("scalar", None, None),
        **{c: ("avx2", "avx2", None) for c in CPUS if c not in ("none", "avx2_no_f16c")}},
    ("scalar", ("qgemm", "qgemm_n16", "qgemm_amx")): {c: ("scalar", None, None) for c in CPUS},
    ("vnni", ("qgemm", "qgemm_n16", "qgemm_amx")): {
        "none": ("scalar", None, None), "avx2": ("avx2", "avx2", None),
        "avx512": ("avx2", "avx2", None), "vnni": ("avx2", "vnni", None), "bf16": ("avx2", "vnni", None),
        "amx": ("avx2", "vnni", None)},
    # (on a CPU without the forced build, PAGEDSERVE_ATTN_ISA turned the kernel off; PAGEDSERVE_ISA
    # caps, so such a CPU runs its best build below: those CPUs are left out here)
    ("avx512", ("paged_attn", "paged_attn_amx")): {c: ("avx512", None) for c in ("avx512", "vnni", "bf16", "amx")},
    ("avx2", ("paged_attn", "paged_attn_amx")): {c: ("avx2", None) for c in CPUS if c not in ("none", "avx2_no_f16c")},
    ("scalar", ("paged_attn", "paged_attn_amx")): {c: ("scalar", None) for c in CPUS},
    ("avx2", ("fused_cpu",)): {"none": ("scalar",), **{c: ("avx2",) for c in CPUS if c != "none"}},
    ("scalar", ("fused_cpu",)): {c: ("scalar",) for c in CPUS},
}


@pytest.mark.parametrize("cap,kernels", FORCED)
def test_the_cap_forces_what_the_per_kernel_variables_forced(cap: str, kernels: tuple[str, ...]) -> None:
    for cpu, levels in FORCED[cap, kernels].items():
        for kernel, level in zip(kernels, levels):
            build = isa.choose(kernel, CPUS[cpu], cap=cap)
            assert (build and build.level) == level, (cap, cpu, kernel)


def test_the_cap_comes_from_pagedserve_isa(monkeypatch) -> None:
    monkeypatch.setenv("PAGEDSERVE_ISA", "avx2")
    assert isa.choose("paged_attn", CPUS["amx"]).level == "avx2"
    assert isa.choose("paged_attn_amx", CPUS["amx"]) is None
    monkeypatch.setenv("PAGEDSERVE_ISA", "scalar")
    assert isa.choose("sample_cpu", CPUS["amx"]) is None  # no scalar build: torch's sampling runs
    monkeypatch.delenv("PAGEDSERVE_ISA")
    assert isa.choose("paged_attn_amx", CPUS["amx"]).level == "amx"


def test_the_switch_takes_exactly_the_table_levels() -> None:
    assert env.ISA.parse.options == isa.LEVELS
    for kernel in isa.KERNELS.values():
        assert all(b.level in isa.LEVELS for b in kernel.builds)
        assert kernel.source.endswith(".c")
        assert all(kernel.source_of(b).endswith(".c") and (cbuild.CSRC / kernel.source_of(b)).is_file()
                   for b in kernel.builds)


def test_levels_here_lists_each_runnable_level_once_best_first() -> None:
    here = isa.cpu_flags()
    levels = isa.levels_here("qgemm")
    assert levels[-1] == "scalar" and len(levels) == len(set(levels))
    assert ("avx2" in levels) == ({"avx2", "fma"} <= here)
    assert ("avx512" in levels) == ({"avx2", "fma", "avx512f", "avx512bw"} <= here)  # the opt-in build too


@pytest.mark.skipif(shutil.which(os.environ.get("CC", "gcc")) is None, reason="no C compiler")
def test_every_build_in_the_table_compiles(tmp_path) -> None:
    """Each (kernel, build) compiles with its flags, also the AVX-512 and AMX ones this CPU cannot run
    (-O0 -c: the intrinsics' target checks without the optimiser's time). A compiler too old for a
    flag (-mamx-tile: gcc 11) is not this code's failure; that build is left out."""
    cc = os.environ.get("CC", "gcc")
    for name, kernel in isa.KERNELS.items():
        for build in kernel.builds:
            cmd = [cc, "-O0", "-std=c11", "-fopenmp", "-c", *kernel.flags(build), str(cbuild.CSRC / kernel.source_of(build)),
                   "-o", str(tmp_path / "k.o")]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            if proc.returncode and "unrecognized command-line option" in proc.stderr:
                continue
            assert proc.returncode == 0, f"{name} {build.level}: {proc.stderr[-2000:]}"


def test_every_avx512_and_amx_build_names_its_tests_against_torch() -> None:
    """Each AVX-512 / AMX build of the table names the tests that check it against a portable (torch)
    reference wherever the CPU runs it (tests/isa_tests.py BUILD_TESTS): a new build without one
    fails here. The named tests exist and are among the ISA tests (make test-isa)."""
    import importlib

    from tests.isa_tests import BUILD_TESTS, ISA_TESTS

    first = isa.LEVELS.index("avx512")
    builds = {(name, b.level) for name, k in isa.KERNELS.items() for b in k.builds
              if isa.LEVELS.index(b.level) >= first}
    assert set(BUILD_TESTS) == builds
    for nodes in BUILD_TESTS.values():
        for node in nodes:
            path, func = node.split("::")
            assert path in ISA_TESTS, node
            assert callable(getattr(importlib.import_module(path[:-3].replace("/", ".")), func, None)), node


@pytest.mark.parametrize("cpu,covered,not_covered", [
    ("avx2", "scalar, avx2", "avx512"),
    ("bf16", "scalar, avx2, avx512, vnni, avx512bf16", "amx"),
    ("amx", "scalar, avx2, avx512, vnni, avx512bf16, amx", None),
])
def test_the_report_says_what_make_test_isa_covers(cpu: str, covered: str, not_covered: str | None) -> None:
    from pagedserve.kernels.isa_report import report

    text = report(CPUS[cpu], cap=None)
    assert f"Covered here by make test-isa: {covered}\n" in text + "\n"
    if not_covered is None:
        assert "Not covered" not in text
    else:
        assert f"Not covered here (their tests skip): {not_covered} (" in text
    line = next(x for x in text.splitlines() if x.startswith("  paged_attn "))
    assert f" {TODAY[cpu][KERNELS.index('paged_attn')]}*" in line  # the build that runs there, starred
