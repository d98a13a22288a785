"""Peak summed RSS and PSS (MiB) of a process tree (a server and its workers), sampled every 0.25 s
until SIGTERM/SIGINT, then written to a file: `python loadtest/tree_rss.py PID OUT`.
RSS counts shared pages once per process; PSS splits them, so it is the fairer sum."""
from __future__ import annotations

import os
import signal
import sys
import time


def _parent(pid: str) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def tree(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                children.setdefault(_parent(entry), []).append(int(entry))
            except OSError:
                pass  # exited meanwhile
    todo, found = [root], []
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += children.get(pid, [])
    return found


def field_kib(pid: int, name: str, key: str) -> int:
    try:
        with open(f"/proc/{pid}/{name}") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def main() -> None:
    root, out = int(sys.argv[1]), sys.argv[2]
    peak = {"rss": 0, "pss": 0}

    def stop(*_):
        with open(out, "w") as f:
            f.write(f"peak_rss_mib={peak['rss'] / 1024:.0f} peak_pss_mib={peak['pss'] / 1024:.0f}\n")
        sys.exit(0)
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    while True:
        pids = tree(root)
        peak["rss"] = max(peak["rss"], sum(field_kib(p, "status", "VmRSS:") for p in pids))
        peak["pss"] = max(peak["pss"], sum(field_kib(p, "smaps_rollup", "Pss:") for p in pids))
        time.sleep(0.25)


if __name__ == "__main__":
    main()
