"""AsyncEngine with --restart-workers over a fake executor (no model, no processes): a worker
failure fails the in-flight requests, new ones get 503 + Retry-After while a fresh pool and core
are built off the loop, then requests are served again; the counters stay monotonic."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

from pagedserve.engine.errors import EngineDeadError, EngineOverloadedError, EngineRestartingError
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.contracts.errors import ExecutorError
from tests.engine.fakes import FakeExecutor, FakeTokenizer, make_config

PROMPT = FakeTokenizer().encode("restart me")
DEATH = "worker 0 (pid 4242) was killed by SIGKILL; in-flight requests cannot finish"


class Builds:
    """Stands in for engine.bootstrap.build_engine; ``gate`` holds a rebuild (restart) open."""

    def __init__(self):
        self.parts: list = []
        self.gate = threading.Event()
        self.gate.set()
        self.fail_next: BaseException | None = None
        self.shut_down: list[FakeExecutor] = []
        self.honour_cancel = True  # False: a load that cannot be cut short (goes on to the end)
        self.cancelled = 0  # restarts cut short by their cancel event
        self.loading = threading.Event()  # set once a restart's build (the model load) has begun

    def __call__(self, config, tokenizer=None, cancel=None):
        from pagedserve.engine.bootstrap import EngineParts
        from pagedserve.engine.core import EngineCore

        if self.parts:  # a restart: runs off the loop, may be held open by the test
            assert threading.current_thread() is not threading.main_thread()
            self.loading.set()
            t0 = time.monotonic()
            while not self.gate.wait(0.01):  # the model loads until the gate opens
                if self.honour_cancel and cancel is not None and cancel.is_set():
                    self.cancelled += 1  # as MultiprocExecutor: its workers are killed
                    raise ExecutorError("the worker start was cancelled (the server is shutting down)")
                assert time.monotonic() - t0 < 10, "the gate was never opened"
            if self.fail_next is not None:
                raise self.fail_next
        tok = tokenizer or FakeTokenizer()
        executor = FakeExecutor(config.cache.num_gpu_blocks_override, config.cache.block_size)
        executor.shutdown = lambda ex=executor: self.shut_down.append(ex)
        parts = EngineParts(config, {}, tok, executor, EngineCore(config, executor, tok))
        self.parts.append(parts)
        return parts


@pytest.fixture
def builds(monkeypatch):
    import pagedserve.engine.bootstrap
    from pagedserve import engine
    b = Builds()
    monkeypatch.setattr(engine.bootstrap, "build_engine", b)
    return b


async def started(restart: bool = True, policy=None):
    from pagedserve.engine.async_engine import AsyncEngine

    config = make_config(num_blocks=128)
    config.parallel.restart_workers = restart
    engine = AsyncEngine(config) if policy is None else AsyncEngine(config, restart_policy=policy)
    await engine.start()
    return engine


async def wait_loading(builds: Builds, within: float = 10.0) -> None:
    """Until a restart's build has begun (its thread may start late on a loaded box)."""
    assert await asyncio.get_running_loop().run_in_executor(None, builds.loading.wait, within)


def kill_workers(executor: FakeExecutor, message: str = DEATH) -> None:
    async def dead(step):
        raise ExecutorError(message)

    async def dead_health():
        raise ExecutorError(message)

    executor.execute_async = dead
    executor.check_health_async = dead_health


async def wait_status(engine, status: str, within: float = 5.0) -> None:
    for _ in range(int(within / 0.01)):
        if engine.health_status() == status:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"status {engine.health_status()!r}, expected {status!r}")


async def collect(stream) -> list:
    return [d async for d in stream]


async def test_in_flight_fails_new_requests_wait_then_are_served(builds):
    engine = await started()
    try:
        old = builds.parts[0]
        done = await collect(engine.generate(PROMPT, SamplingParams(max_tokens=5), "warm"))
        assert done[-1].finished
        # A long request is running when the workers die; the rebuild is held open.
        builds.gate.clear()
        stream = engine.generate(PROMPT, SamplingParams(max_tokens=100, ignore_eos=True), "victim")
        first = await stream.__anext__()
        assert first.outputs[0].token_ids
        kill_workers(old.executor)
        with pytest.raises(EngineDeadError, match=r"killed by SIGKILL.*restarting"):
            await collect(stream)
        await wait_status(engine, "restarting")
        assert not engine.is_healthy()
        with pytest.raises(EngineRestartingError, match="restarting its workers") as info:
            engine.generate(PROMPT, SamplingParams(max_tokens=2), "too-early")
        assert isinstance(info.value, EngineOverloadedError)  # 503 + Retry-After in app/
        for _ in range(500):  # the old pool is reaped (off the loop) before the new one starts
            if old.executor in builds.shut_down:
                break
            await asyncio.sleep(0.01)
        assert builds.shut_down == [old.executor] and len(builds.parts) == 1
        builds.gate.set()
        await wait_status(engine, "ok")
        new = builds.parts[1]
        assert engine.core is new.core and engine.parts.executor is new.executor
        stats = engine.stats()
        assert stats.num_worker_restarts == 1 and engine.num_worker_restarts == 1
        assert (stats.num_running, stats.num_waiting, stats.kv_cache_usage) == (0, 0, 0.0)
        assert stats.num_free_blocks == stats.num_blocks  # a fresh block manager for the new pool
        assert stats.prefix_cache_queries >= old.core.stats().prefix_cache_queries  # monotonic
        out = await collect(engine.generate(PROMPT, SamplingParams(max_tokens=7, ignore_eos=True), "after"))
        assert out[-1].finished and sum(len(d.outputs[0].token_ids) for d in out) == 7
        assert engine.num_deaths == 0
    finally:
        await engine.shutdown()
    assert builds.parts[1].executor in builds.shut_down


async def test_while_restarting_the_failed_requests_are_not_counted_as_running(builds):
    """The requests a worker failure failed hold no KV and run nowhere: the gauges say so while
    the new pool loads, not only once it is there."""
    engine = await started()
    try:
        builds.gate.clear()
        params = SamplingParams(max_tokens=100, ignore_eos=True)
        stream = engine.generate(PROMPT, params, "victim")
        await stream.__anext__()
        s = engine.stats()
        assert s.num_running == 1 and s.kv_cache_usage > 0
        kill_workers(engine.parts.executor)
        with pytest.raises(EngineDeadError):
            await collect(stream)
        await wait_status(engine, "restarting")
        s = engine.stats()
        assert (s.num_running, s.num_waiting, s.kv_cache_usage) == (0, 0, 0.0)
    finally:
        builds.gate.set()
        await engine.shutdown()


async def test_two_failures_in_a_row_restart_twice(builds):
    engine = await started()
    try:
        for n in (1, 2):
            builds.gate.clear()
            kill_workers(engine.parts.executor)  # idle: the health check notices
            await wait_status(engine, "restarting", within=5)
            builds.gate.set()
            await wait_status(engine, "ok")
            assert engine.num_worker_restarts == n and engine.stats().num_worker_restarts == n
            out = await collect(engine.generate(PROMPT, SamplingParams(max_tokens=3), f"r{n}"))
            assert out[-1].finished
    finally:
        await engine.shutdown()


async def test_a_failed_restart_leaves_the_engine_dead(builds):
    engine = await started()
    try:
        builds.fail_next = ExecutorError("worker 0 failed to start: out of memory")
        kill_workers(engine.parts.executor)
        await wait_status(engine, "dead")
        with pytest.raises(EngineDeadError,
                           match="killed by SIGKILL.*restarting the workers failed.*out of memory"):
            engine.generate(PROMPT, SamplingParams(max_tokens=2), "x")
        assert engine.num_deaths == 1 and engine.num_worker_restarts == 0
    finally:
        await engine.shutdown()


async def test_without_the_flag_a_worker_failure_is_final(builds):
    engine = await started(restart=False)
    try:
        kill_workers(engine.parts.executor)
        stream = engine.generate(PROMPT, SamplingParams(max_tokens=5), "x")
        with pytest.raises(EngineDeadError,
                           match="the engine stopped: .*killed by SIGKILL.*restart the server"):
            await collect(stream)
        assert engine.health_status() == "dead" and len(builds.parts) == 1
    finally:
        await engine.shutdown()


async def test_shutdown_during_a_restart_stops_the_pool_being_built(builds):
    """A load that cannot be cut short: the pool it builds is stopped once it is there."""
    engine = await started()
    builds.honour_cancel = False
    builds.gate.clear()
    kill_workers(engine.parts.executor)
    await wait_status(engine, "restarting")
    await wait_loading(builds)  # a shutdown before the load begins builds nothing (tested below)
    shutting = asyncio.ensure_future(engine.shutdown())
    await asyncio.sleep(0.05)
    builds.gate.set()
    await asyncio.wait_for(shutting, 10)
    assert len(builds.parts) == 2
    assert builds.parts[1].executor in builds.shut_down


async def test_shutdown_before_the_load_begins_builds_nothing(builds):
    """A shutdown during the restart's back-off (or before its thread runs) ends the restart:
    no new pool is built, and shutdown does not wait out the back-off."""
    from pagedserve.engine.async_engine import RestartPolicy

    engine = await started(policy=RestartPolicy(max_restarts=3, window_s=60.0, backoff_s=30.0))
    kill_workers(engine.parts.executor)  # the first restart is immediate
    for _ in range(500):
        if engine.num_worker_restarts == 1:
            break
        await asyncio.sleep(0.01)
    await wait_status(engine, "ok")
    kill_workers(engine.parts.executor)  # the second waits the 30 s back-off
    await wait_status(engine, "restarting")
    t0 = time.monotonic()
    await asyncio.wait_for(engine.shutdown(), 5)
    assert time.monotonic() - t0 < 5 and len(builds.parts) == 2 and builds.cancelled == 0


async def test_shutdown_during_a_restart_cancels_the_model_load(builds):
    """Shutdown does not wait for the new pool's model load (minutes for a big model): it cancels
    the restart, which kills the workers being started."""
    engine = await started()
    builds.gate.clear()  # the new pool's load never ends by itself
    kill_workers(engine.parts.executor)
    await wait_status(engine, "restarting")
    await wait_loading(builds)  # the old pool is reaped, the new one is loading
    await asyncio.wait_for(engine.shutdown(), 5)  # the load would hold it 10 s
    assert builds.cancelled == 1 and len(builds.parts) == 1
    builds.gate.set()


TRACEBACK_DEATH = """step 9 failed on worker 0 while the other 1 rank(s) went on. Worker 0's error:
Traceback (most recent call last):
  File "/srv/pagedserve/gpu/worker.py", line 187, in _serve
    out = runner.execute(step)
RuntimeError: CUDA error: an illegal memory access was encountered
"""


@pytest.mark.parametrize("restart", [False, True])
async def test_a_worker_traceback_never_reaches_the_client(builds, restart):
    """The engine-dead / workers-failed message a request gets (a 503 body, an SSE error event)
    is one line without the server's file paths; the log keeps the traceback."""
    engine = await started(restart=restart)
    try:
        builds.gate.clear()
        stream = engine.generate(PROMPT, SamplingParams(max_tokens=100, ignore_eos=True), "v")
        await stream.__anext__()
        kill_workers(engine.parts.executor, TRACEBACK_DEATH)
        with pytest.raises(EngineDeadError) as info:
            await collect(stream)
        msg = str(info.value)
        assert "\n" not in msg and "/srv/pagedserve" not in msg and "File " not in msg
        assert "step 9 failed on worker 0" in msg
        assert "RuntimeError: CUDA error: an illegal memory access was encountered" in msg
        if not restart:
            with pytest.raises(EngineDeadError) as later:
                engine.generate(PROMPT, SamplingParams(max_tokens=2), "later")
            assert "\n" not in str(later.value) and "/srv/pagedserve" not in str(later.value)
    finally:
        builds.gate.set()
        await engine.shutdown()


class DyingBuilds(Builds):
    """Every rebuilt pool dies as soon as the engine uses it (a model that crashes its workers,
    a broken device); records when each pool was built."""

    def __init__(self):
        super().__init__()
        self.times: list[float] = []

    def __call__(self, config, tokenizer=None, cancel=None):
        parts = super().__call__(config, tokenizer, cancel)
        self.times.append(time.monotonic())
        if len(self.parts) > 1:
            kill_workers(parts.executor)
        return parts


@pytest.fixture
def dying_builds(monkeypatch):
    import pagedserve.engine.bootstrap
    from pagedserve import engine
    b = DyingBuilds()
    monkeypatch.setattr(engine.bootstrap, "build_engine", b)
    return b


async def test_a_pool_that_always_dies_is_restarted_a_bounded_number_of_times(dying_builds, monkeypatch):
    import pagedserve.engine.engine_loop
    from pagedserve import engine
    from pagedserve.engine.async_engine import RestartPolicy

    monkeypatch.setattr(engine.engine_loop, "IDLE_HEALTH_CHECK_S", 0.01)  # deaths found at once

    policy = RestartPolicy(max_restarts=3, window_s=60.0, backoff_s=0.1, max_backoff_s=0.15)
    engine = await started(policy=policy)
    try:
        kill_workers(engine.parts.executor)
        await wait_status(engine, "dead", within=15)  # was rebuilt for ever
        assert len(dying_builds.parts) == 1 + 3 and engine.num_worker_restarts == 3
        assert engine.num_deaths == 1
        with pytest.raises(EngineDeadError, match=r"failed 4 times within 60 s.*at most 3 restarts"):
            engine.generate(PROMPT, SamplingParams(max_tokens=2), "x")
        # Back-off: the first restart at once, then 0.1 s, then 0.15 s (the cap) between them.
        t = dying_builds.times
        assert t[3] - t[2] >= 0.15 and t[2] - t[1] >= 0.1
        await asyncio.sleep(0.3)
        assert len(dying_builds.parts) == 4  # nothing rebuilds a dead engine
    finally:
        await engine.shutdown()


async def test_restarts_older_than_the_window_do_not_count(builds):
    from pagedserve.engine.async_engine import RestartPolicy

    engine = await started(policy=RestartPolicy(max_restarts=1, window_s=0.3, backoff_s=5.0))
    try:
        for n in (1, 2):  # the second failure comes after the window: no back-off, no limit
            kill_workers(engine.parts.executor)
            for _ in range(400):  # the idle health check finds the death within a second
                if engine.num_worker_restarts == n:
                    break
                await asyncio.sleep(0.01)
            await wait_status(engine, "ok", within=2)  # no 5 s back-off came first
            assert engine.num_worker_restarts == n
            await asyncio.sleep(0.4)
    finally:
        await engine.shutdown()


def test_restart_policy_back_off_doubles_up_to_its_cap():
    from pagedserve.engine.async_engine import RestartPolicy

    p = RestartPolicy(max_restarts=10, window_s=60, backoff_s=1.0, max_backoff_s=5.0)
    assert [p.delay(k) for k in range(6)] == [0.0, 1.0, 2.0, 4.0, 5.0, 5.0]
    with pytest.raises(ValueError, match="max_restarts"):
        RestartPolicy(max_restarts=0)
