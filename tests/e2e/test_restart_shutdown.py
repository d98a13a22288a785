"""SIGTERM while --restart-workers is loading a new worker pool: the shutdown cancels the load
(kills the worker being started) and the server exits 0 at once, instead of waiting for the load
(minutes for a big model; here it never ends: the new worker is stopped with SIGSTOP)."""
from __future__ import annotations

import os
import signal
import time

from tests.e2e.test_worker_death import children, gone, start, workers_of


def test_sigterm_during_a_restart_kills_the_worker_being_loaded():
    s, kids, workers, segments = start(1, "--restart-workers")
    stopped: list[int] = []
    try:
        os.kill(workers[0], signal.SIGKILL)
        deadline = time.monotonic() + 30  # the idle health check finds the death within a second
        while not stopped:
            assert time.monotonic() < deadline, f"no new worker was started:\n{s.output()[-3000:]}"
            for pid in workers_of(s.proc.pid):
                if pid not in workers:
                    os.kill(pid, signal.SIGSTOP)  # still importing torch: its load never ends now
                    stopped.append(pid)
            time.sleep(0.01)
        time.sleep(0.5)
        assert "worker pool restarted" not in s.output(), "the new pool was ready before SIGSTOP"
        t0 = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(30) == 0, s.output()[-3000:]  # (the startup timeout is 600 s)
        assert time.monotonic() - t0 < 20
        assert "shutdown complete" in s.output()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not gone(stopped[0]):
            time.sleep(0.05)
        assert gone(stopped[0]), "the worker being loaded was left behind"
        assert all(gone(p) for p in children(s.proc.pid))
        assert not [n for n in segments if os.path.exists(n)]
    finally:
        for pid in stopped:
            if not gone(pid):
                os.kill(pid, signal.SIGKILL)
        s.stop()
