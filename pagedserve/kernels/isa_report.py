"""``python -m pagedserve.kernels.isa_report`` (the first thing ``make test-isa`` prints): which ISA levels this CPU
has, each kernel's builds (kernels/isa.py) with the one that runs here, and which levels the
ISA-specific tests therefore cover on this machine and which they cannot (their tests skip)."""
from __future__ import annotations

from collections.abc import Set

from pagedserve.contracts import env
from pagedserve.kernels.isa import KERNELS, LEVELS, choose, cpu_flags, level_missing

_UNSET = object()
# Where each level began, for "run make test-isa on such a CPU".
_CPUS = {"avx2": "Haswell, Zen 1", "avx512": "Skylake-SP, Zen 4", "vnni": "Cascade Lake, Zen 4",
         "avx512bf16": "Cooper Lake, Zen 4", "amx": "Sapphire Rapids"}


def report(cpu: Set[str] | None = None, cap=_UNSET) -> str:
    """The report for a CPU with flags ``cpu`` (default: this one) under the PAGEDSERVE_ISA cap ``cap``
    (default: the environment's)."""
    if cpu is None:
        cpu = cpu_flags()
    if cap is _UNSET:
        cap = env.ISA.get()
    lines = ["ISA levels (scalar < avx2 < avx512 < vnni < avx512bf16 < amx) on this CPU:"]
    for lv in LEVELS:
        missing = level_missing(lv, cpu)
        lines.append(f"  {lv:11} " + ("yes" if not missing else f"no   (lacks {', '.join(missing)})"))
    if cap:
        lines.append(f"PAGEDSERVE_ISA={cap}: in-process tests run the builds at or below {cap}; the tests "
                     "that force a build in a fresh process still reach the others")
    lines.append("Kernel builds, best first (* the one that runs here; 'not here': this CPU lacks it):")
    for name, kernel in KERNELS.items():
        chosen = choose(name, cpu, cap)
        cells = [f"{b.level}{'*' if b == chosen else ''}{' opt-in' if b.opt_in else ''}"
                 f"{'' if b.needs <= cpu else ' (not here)'}" for b in kernel.builds]
        lines.append(f"  {name:15} " + ", ".join(cells))
    have = [lv for lv in LEVELS if not level_missing(lv, cpu)]
    lines.append(f"Covered here by make test-isa: {', '.join(have)}")
    lacking = [lv for lv in LEVELS if lv not in have]
    if lacking:
        lines.append("Not covered here (their tests skip): "
                     + "; ".join(f"{lv} (e.g. {_CPUS[lv]} or later)" for lv in lacking)
                     + ": run make test-isa on such a CPU")
    return "\n".join(lines)


if __name__ == "__main__":
    print(report())
