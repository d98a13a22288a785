"""PlacedWorkers.release waits for killed actors whose pids it can see: those on the driver's
Ray node, and those on another Ray node of the same host and pid namespace (ray.cluster_utils'
second raylet, or two raylets on one machine). Ray itself is not needed: the wait is plain
pidfds, exercised here on a child process that ends shortly after the wait starts."""
from __future__ import annotations

import subprocess
import sys
import time

from pagedserve.gpu.ray_cluster import PlacedWorkers
from pagedserve.gpu.ray_worker import pid_space


def _placed(node: str, pid: int, space: str) -> PlacedWorkers:
    return PlacedWorkers(pg=None, actors=[], nodes=[node], pids=[pid], driver_node="driver",
                         started_ray=False, pid_spaces=[space])


def _child(seconds: float) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({seconds})"])


def test_waits_for_an_actor_on_another_ray_node_of_this_host():
    child = _child(1.0)
    try:
        t0 = time.monotonic()
        _placed("second-raylet", child.pid, pid_space())._wait_local_exits(20.0)
        waited = time.monotonic() - t0
        assert child.poll() is not None or waited >= 0.9  # it waited for the exit, not skipped it
        assert waited < 15.0
    finally:
        child.kill()
        child.wait()


def test_does_not_wait_on_a_pid_from_another_host():
    child = _child(30.0)  # the same number may name an unrelated process here: never waited on
    try:
        t0 = time.monotonic()
        _placed("remote", child.pid, "another-host")._wait_local_exits(20.0)
        assert time.monotonic() - t0 < 2.0
    finally:
        child.kill()
        child.wait()


def test_pid_space_is_stable_and_names_boot_and_namespace():
    assert pid_space() == pid_space() and pid_space()
