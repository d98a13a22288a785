"""A worker pool still loading its model can be cancelled (a shutdown during --restart-workers):
the start raises at once and its workers are killed, instead of the caller waiting for the load."""
from __future__ import annotations

import os
import threading
import time

import pytest

from pagedserve.contracts.errors import ExecutorError
from tests.gpu.test_mp_executor import _config, _existing, _gone, own_segments  # noqa: F401  (fixture)

HERE = "tests.gpu.test_mp_executor_cancel"
MARKER_ENV = "PAGEDSERVE_TEST_LOADING_MARKER"


class LoadingForeverRunner:
    """A model load that never ends; says it has begun by writing its pid to a marker file."""

    def __init__(self, config, rank: int):
        self.rank = rank

    def initialize(self) -> int:
        with open(f"{os.environ[MARKER_ENV]}.{self.rank}", "w") as f:
            f.write(str(os.getpid()))
        threading.Event().wait()
        return 1


def test_cancel_while_the_workers_load_kills_them(tmp_path, monkeypatch, own_segments):  # noqa: F811
    from pagedserve.gpu.mp_executor import MultiprocExecutor

    marker = str(tmp_path / "loading")
    monkeypatch.setenv(MARKER_ENV, marker)  # inherited by the spawned workers
    cancel = threading.Event()
    outcome: list[BaseException] = []

    def start() -> None:
        try:
            MultiprocExecutor(_config(tp=2), runner_factory=f"{HERE}:LoadingForeverRunner",
                              startup_timeout=600, cancel=cancel)
        except BaseException as e:  # noqa: BLE001 - checked below
            outcome.append(e)

    starter = threading.Thread(target=start, daemon=True)
    starter.start()
    paths = [f"{marker}.{rank}" for rank in range(2)]
    while not all(os.path.exists(p) and os.path.getsize(p) for p in paths):
        assert starter.is_alive(), outcome
        time.sleep(0.05)
    pids = [int(open(p).read()) for p in paths]
    cancel.set()
    starter.join(60)  # far less than the load (never) or the startup timeout (600 s)
    assert not starter.is_alive(), "the start went on after it was cancelled"
    assert len(outcome) == 1 and isinstance(outcome[0], ExecutorError), outcome
    assert "cancelled" in str(outcome[0])
    assert all(_gone(p) for p in pids)
    assert not _existing(own_segments)


def test_a_start_cancelled_before_it_began_spawns_nothing(monkeypatch):
    import multiprocessing

    from pagedserve.gpu.mp_executor import MultiprocExecutor

    cancel = threading.Event()
    cancel.set()
    before = set(multiprocessing.active_children())
    with pytest.raises(ExecutorError, match="cancelled"):
        MultiprocExecutor(_config(), runner_factory=f"{HERE}:LoadingForeverRunner",
                          startup_timeout=600, cancel=cancel)
    assert set(multiprocessing.active_children()) <= before
