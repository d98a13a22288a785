"""What a MultiprocExecutor owns (worker processes, their ready pipes, the two channels) and how
it is released: ``WorkerGroup.close`` is the executor's finalizer and its reaper thread's target,
so it never references the executor."""
from __future__ import annotations

import logging
import multiprocessing
import signal
import threading
import time
from multiprocessing.connection import Connection

from pagedserve.gpu.shm_ring import RingError, ShmRing
from pagedserve.gpu.worker import SHUTDOWN_MESSAGE

logger = logging.getLogger(__name__)


def describe_exit(proc: multiprocessing.process.BaseProcess) -> str:
    code = proc.exitcode
    if code is None:
        return "is still running"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class WorkerGroup:
    """What the executor owns; ``close`` is the finalizer (never references the executor).

    ``close`` may take seconds (joins, terminate, kill) and runs on a reaper thread after a
    failure; the lock makes a second caller (shutdown, the finalizer) wait for the first."""

    def __init__(self):
        self.procs: list[multiprocessing.process.BaseProcess] = []
        self.conns: list[Connection] = []
        self.step_ring: ShmRing | None = None
        self.reply_ring: ShmRing | None = None
        self.closed = False
        self._lock = threading.Lock()

    def close(self, graceful: bool = True, join_timeout: float = 5.0) -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = True
            self._close(graceful, join_timeout)

    def _close(self, graceful: bool, join_timeout: float) -> None:
        alive = [p for p in self.procs if p.exitcode is None]
        if self.step_ring is not None and alive and graceful:
            try:
                self.step_ring.send(SHUTDOWN_MESSAGE, timeout=0.5)
            except (RingError, OSError, ValueError):
                pass
        if self.step_ring is not None:
            self.step_ring.mark_closed()  # wakes workers blocked on the ring
        deadline = time.monotonic() + (join_timeout if graceful else 0.0)
        for p in alive:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.exitcode is None:
                p.terminate()
        for p in self.procs:
            p.join(2.0)
            if p.exitcode is None:
                p.kill()
                p.join(2.0)
        for ring in (self.step_ring, self.reply_ring):
            if ring is not None:
                ring.close()
        for c in self.conns:
            c.close()
        logger.debug("executor resources released")
