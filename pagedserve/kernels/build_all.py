"""``python -m pagedserve.kernels.build_all``: build now every C kernel this CPU will run (``make install`` calls it).

Each kernel otherwise builds on first use, which needs a C compiler at run time. Built here, the
libraries land in the kernel cache (kernels/cbuild.py) and a later process only loads them; gcc is
then needed again only if the cache is removed, the sources change, or the process runs with
another ``PAGEDSERVE_ISA`` or ``PAGEDSERVE_KERNEL_CACHE``. Exits 1 when the quantized kernel cannot
be built (it has no fall-back: --quantization int8/int4 needs it); every other kernel has a torch
path, so its failure is reported and the install goes on.
"""
from __future__ import annotations

import sys

from pagedserve.kernels import abi, cbuild, isa

REQUIRED = ("qgemm",)


def build_all() -> list[tuple[str, str, str]]:
    """(kernel, level or '-', outcome) for every kernel of kernels/isa.py, built where this CPU runs it."""
    rows = []
    for name in isa.KERNELS:
        choice = isa.choose(name)
        if choice is None:
            rows.append((name, "-", "not used on this CPU"))
            continue
        try:
            abi.bind(cbuild.build_kernel(name, choice), name)
        except cbuild.KernelBuildError as e:
            rows.append((name, choice.level, f"FAILED: {e}"))
            continue
        rows.append((name, choice.level, "ready"))
    return rows


def main() -> int:
    rows = build_all()
    for name, level, outcome in rows:
        print(f"{name:15} {level:11} {outcome}")
    failed = [name for name, _, outcome in rows if outcome.startswith("FAILED") and name in REQUIRED]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
