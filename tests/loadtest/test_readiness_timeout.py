"""The e2e servers' readiness wait grows with what `serve` starts and with the box's load, and has
a ceiling (a Ray-backed server on a busy box once missed a fixed 60 s)."""
from __future__ import annotations

import os

import pytest

from pagedserve.loadtest import local_server
from pagedserve.loadtest.local_server import (READY_BASE_S, READY_CEILING_S, READY_PER_WORKER_S,
                                   READY_RAY_START_S, readiness_timeout)


@pytest.fixture
def idle_box(monkeypatch):
    monkeypatch.setattr(local_server.os, "getloadavg", lambda: (0.0, 0.0, 0.0))


def test_one_process_server_keeps_the_old_wait(idle_box):
    assert readiness_timeout(["--served-model-name", "tiny"]) == 120.0 == READY_BASE_S + READY_PER_WORKER_S


def test_each_worker_replica_and_ray_add_their_share(idle_box):
    one = readiness_timeout([])
    assert readiness_timeout(["--executor", "mp", "-tp", "2"]) == one + READY_PER_WORKER_S
    assert readiness_timeout(["--tensor-parallel-size=2", "--pipeline-parallel-size", "2",
                              "--data-parallel-size", "2"]) == one + 7 * READY_PER_WORKER_S
    assert readiness_timeout(["--distributed-executor-backend", "ray"]) == one + READY_RAY_START_S
    assert readiness_timeout(["--distributed-executor-backend", "ray", "-tp", "3"]) == (
        one + 2 * READY_PER_WORKER_S + READY_RAY_START_S)


def test_load_per_cpu_stretches_it_up_to_the_ceiling(monkeypatch):
    cpus = len(os.sched_getaffinity(0))
    monkeypatch.setattr(local_server.os, "getloadavg", lambda: (3.0 * cpus, 0.0, 0.0))
    assert readiness_timeout([]) == pytest.approx(3 * 120.0)
    monkeypatch.setattr(local_server.os, "getloadavg", lambda: (100.0 * cpus, 0.0, 0.0))
    assert readiness_timeout(["--distributed-executor-backend", "ray"]) == READY_CEILING_S
