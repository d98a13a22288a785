"""Resource figures of one server's process tree (the server and its workers), read from /proc.

Soak and chaos runs need "RSS of all server processes" and "open file descriptors": a server with
`--executor mp` is several processes, so every figure sums the whole tree under one pid. Only
/proc is read (Linux), so no dependency is needed and other users' processes are never touched.
"""
from __future__ import annotations

import logging
import os
from dataclasses import asdict, dataclass

logger = logging.getLogger(__name__)

SHM_PREFIX = "/dev/shm/"


def children(pid: int) -> list[int]:
    """Direct children of ``pid`` (every thread's children file), [] once it is gone."""
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except (FileNotFoundError, ProcessLookupError):
        return out
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(c) for c in f.read().split()]
        except (FileNotFoundError, ProcessLookupError):
            pass
    return out


def tree(pid: int) -> list[int]:
    """``pid`` and all its descendants, parents first."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop(0)
        if p in out:
            continue
        out.append(p)
        todo += children(p)
    return out


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except (FileNotFoundError, ProcessLookupError):
        return ""


def gone(pid: int) -> bool:
    """The process has exited (no /proc entry, or a zombie waiting to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        return True


def rss_kib(pid: int) -> int:
    """Resident set size (VmRSS) in KiB; 0 for a process that is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError):
        pass
    return 0


def fd_count(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except (FileNotFoundError, ProcessLookupError):
        return 0


def mapped_shm(pid: int, prefix: str = "pagedserve-") -> set[str]:
    """Paths of /dev/shm segments named ``prefix*`` that ``pid`` maps: the segments this server's
    executor created (other servers on the machine have their own, with other names)."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            return {line.split()[-1] for line in f
                    if SHM_PREFIX + prefix in line and line.split()[-1].startswith(SHM_PREFIX)}
    except (FileNotFoundError, ProcessLookupError):
        return set()


@dataclass(slots=True)
class ProcessFigures:
    pid: int
    cmd: str
    rss_kib: int
    fds: int


@dataclass(slots=True)
class TreeSnapshot:
    """One reading of the tree: per process and totals."""

    processes: list[ProcessFigures]

    @property
    def rss_kib(self) -> int:
        return sum(p.rss_kib for p in self.processes)

    @property
    def fds(self) -> int:
        return sum(p.fds for p in self.processes)

    def as_dict(self) -> dict:
        return {"rss_kib": self.rss_kib, "fds": self.fds,
                "processes": [asdict(p) for p in self.processes]}


def snapshot(pid: int) -> TreeSnapshot:
    procs = [ProcessFigures(p, cmdline(p)[:120], rss_kib(p), fd_count(p))
             for p in tree(pid) if not gone(p)]
    return TreeSnapshot(procs)


def pid_listening_on(port: int) -> int | None:
    """The pid of this user's process that listens on TCP ``port`` (127.0.0.1 or any address), or
    None: lets `bench soak --base-url` measure a server it did not start."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    cols = line.split()
                    if cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:  # LISTEN
                        inodes.add(cols[9])
        except FileNotFoundError:
            continue
    if not inodes:
        return None
    targets = {f"socket:[{i}]" for i in inodes}
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            for fd in os.listdir(f"/proc/{entry}/fd"):
                if os.readlink(f"/proc/{entry}/fd/{fd}") in targets:
                    found.append(int(entry))
                    break
        except OSError:  # another user's process, or it exited
            continue
    # A forked child may share the socket: the root is the one whose parent does not.
    roots = [p for p in found if _ppid(p) not in found]
    return roots[0] if roots else None


def _ppid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[-1].split()[1])
    except (FileNotFoundError, ProcessLookupError):
        return None
