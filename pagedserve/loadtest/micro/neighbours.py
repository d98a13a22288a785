"""Busy neighbours for a benchmark: N CPU-bound processes (``while True: pass``) that run beside the
measured work and are gone when it ends (issue 36 item 5: how pagedserve degrades when the cores
are shared, as on a laptop, a shared server or a container with a CPU quota).

Each neighbour is a plain Python process in ``while True: pass``. On Linux it first asks to be
killed with its parent (``PR_SET_PDEATHSIG``, set by the child itself: no ``preexec_fn`` in a process
that already runs OpenMP threads), so none outlives a benchmark that is killed before its
``finally`` runs.
"""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator

BUSY_LOOP = "while True: pass"
# argv[1]: the parent's pid. PR_SET_PDEATHSIG = 1, SIGKILL = 9; a parent already gone -> exit.
_NEIGHBOUR = f"""import os, sys
if sys.platform == "linux":
    import ctypes
    ctypes.CDLL(None).prctl(1, 9)
    if os.getppid() != int(sys.argv[1]):
        sys.exit(0)
{BUSY_LOOP}
"""


def start_neighbours(n: int) -> list[subprocess.Popen]:
    procs: list[subprocess.Popen] = []
    try:
        for _ in range(n):
            procs.append(subprocess.Popen([sys.executable, "-c", _NEIGHBOUR, str(os.getpid())],
                                          stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL))
    except BaseException:
        stop_neighbours(procs)
        raise
    return procs


def stop_neighbours(procs: list[subprocess.Popen]) -> None:
    """Kill and reap every neighbour (nothing left running, no zombie)."""
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
    for proc in procs:
        proc.wait()


@contextlib.contextmanager
def busy_neighbours(n: int) -> Iterator[list[subprocess.Popen]]:
    """Run ``n`` busy processes for the duration of the ``with`` block (none when n == 0)."""
    if n < 0:
        raise ValueError(f"the number of busy neighbours must be >= 0, got {n}")
    procs = start_neighbours(n)
    try:
        yield procs
    finally:
        stop_neighbours(procs)
