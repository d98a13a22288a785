"""How many CPUs this process may really use, and how its OpenMP threads wait (issue 36 item 5).

Two things made pagedserve lose far more than its share when other work shares the cores:

- **Thread counts.** ``os.cpu_count()`` and torch's default count every CPU of the machine; a
  process may run on fewer: its affinity mask (``taskset``, ``docker --cpuset-cpus``) and a cgroup
  CPU quota (``docker --cpus``, Kubernetes limits: ``cpu.max`` in cgroup v2, ``cpu.cfs_quota_us``
  in v1). More threads than that are preempted in the middle of every parallel region.
- **Spinning.** libgomp (torch's OpenMP, which the C kernels share) lets a thread that waits at a
  barrier or for the next parallel region spin for ``GOMP_SPINCOUNT`` (300,000 ``pause``
  iterations, several milliseconds) before it sleeps. On quiet cores that is free; beside busy
  neighbours a spinning thread holds its core for the rest of its time slice while the thread it
  waits for sits in the run queue, so every region can cost a whole scheduler slice.

``openmp_defaults`` gives the spin a short budget (long enough for most barriers inside one C
kernel call, short enough that a waiter gives the core back within tens of microseconds); it is applied to the
environment before libgomp loads (the CLI's entry, a spawned worker) and never overrides a
variable the user set. Pure stdlib: every room may import it, torch is not needed.
"""
from __future__ import annotations

import logging
import math
import os
from collections.abc import MutableMapping
from pathlib import Path

logger = logging.getLogger(__name__)

# libgomp reads these once, when it is loaded (importing torch loads it). Unset by the user, a waiting
# thread spins this many iterations and then sleeps on a futex: ~30 µs by libgomp's own estimate
# (100,000 per ms), against its default 300,000 (~3 ms). Measured on a shared 2-vCPU EPYC (PERF.md,
# issue 36 item 5): 10,000 lost as badly as the default beside busy processes; 0 (OMP_WAIT_POLICY=
# PASSIVE) lost least there but cost the most on quiet cores; 3,000 was the balance.
GOMP_SPINCOUNT_DEFAULT = "3000"
OPENMP_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")


def openmp_defaults(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set the OpenMP wait settings this process's libgomp will read, where the user set neither
    ``OMP_WAIT_POLICY`` nor ``GOMP_SPINCOUNT`` (either one means the user chose). Returns what was
    set. Call it before torch is imported; children started afterwards inherit it."""
    environ = os.environ if environ is None else environ
    if any(environ.get(name, "").strip() for name in OPENMP_VARIABLES):
        return {}
    chosen = {"GOMP_SPINCOUNT": GOMP_SPINCOUNT_DEFAULT}
    environ.update(chosen)
    return chosen


def openmp_settings(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """The OpenMP wait variables set in ``environ`` (a process started elsewhere, a Ray actor, gets them)."""
    environ = os.environ if environ is None else environ
    return {name: environ[name] for name in OPENMP_VARIABLES if environ.get(name, "").strip()}


def openmp_loaded(maps: Path = Path("/proc/self/maps")) -> bool:
    """Whether an OpenMP runtime is already mapped into this process (then the environment is read
    and changing it no longer matters)."""
    try:
        text = maps.read_text()
    except OSError:
        return False
    return any(lib in text for lib in ("libgomp", "libiomp", "libomp"))


def affinity_cpus() -> int:
    """The CPUs this process may be scheduled on (its affinity mask), else every CPU."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def cgroup_cpu_limit(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> float | None:
    """The CPU quota of this process's cgroup, in CPUs (``quota / period``), or None when there is
    none. The tightest of the cgroup and its ancestors counts (a parent's limit binds the child).
    cgroup v2 (``cpu.max``: ``"max 100000"`` or ``"150000 100000"``) first, then v1's
    ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``; anything unreadable means no limit."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        lines = []
    v2_path, v1_path = None, None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            v2_path = path
        elif "cpu" in controllers.split(","):
            v1_path = (controllers, path)
    limits: list[float] = []
    if v2_path is not None:
        for directory in _self_and_ancestors(root, v2_path):
            limit = _read_v2(directory / "cpu.max")
            if limit is not None:
                limits.append(limit)
    if not limits and v1_path is not None:
        controllers, path = v1_path
        for base in (root / controllers, root / "cpu", root / "cpu,cpuacct"):
            if base.is_dir():
                for directory in _self_and_ancestors(base, path):
                    limit = _read_v1(directory)
                    if limit is not None:
                        limits.append(limit)
                break
    if not limits and v2_path is None and v1_path is None:  # no /proc/self/cgroup: the root's own file
        limit = _read_v2(root / "cpu.max")
        if limit is not None:
            limits.append(limit)
    return min(limits) if limits else None


def _self_and_ancestors(base: Path, path: str) -> list[Path]:
    """``base/a/b/c``, ``base/a/b``, ``base/a``, ``base`` (a container sees its own cgroup as "/")."""
    parts = [p for p in path.strip("/").split("/") if p and p != ".."]
    return [base.joinpath(*parts[:n]) for n in range(len(parts), -1, -1)]


def _read_v2(path: Path) -> float | None:
    try:
        fields = path.read_text().split()
    except OSError:
        return None
    if len(fields) < 1 or fields[0] == "max":
        return None
    try:
        quota = int(fields[0])
        period = int(fields[1]) if len(fields) > 1 else 100_000
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def _read_v1(directory: Path) -> float | None:
    try:
        quota = int((directory / "cpu.cfs_quota_us").read_text())
        period = int((directory / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None


def usable_cpus(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> int:
    """The CPUs this process can keep busy: its affinity mask, capped by its cgroup quota rounded
    down (a quota of 1.5 CPUs runs one thread without being throttled, two would be), at least 1."""
    cpus = affinity_cpus()
    limit = cgroup_cpu_limit(root, proc_cgroup)
    if limit is not None:
        cpus = min(cpus, max(1, math.floor(limit + 1e-9)))
    return max(1, cpus)
