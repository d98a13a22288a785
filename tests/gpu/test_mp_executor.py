"""MultiprocExecutor with a fake runner (no model): start-up, steps, failures, clean shutdown."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from pagedserve.contracts.config import EngineConfig
from pagedserve.contracts.errors import ExecutorError
from pagedserve.contracts.messages import NewSeq, SamplingOptions, StepInput, StepOutput
from pagedserve.gpu.shm_ring import ShmRing
from pagedserve.gpu.transport import pick_transport

HERE = "tests.gpu.test_mp_executor"
SLOW_STEP = -2  # a step id the fake runner sleeps on (to be killed mid-step)
FAILING_STEP = -1  # a step id the fake runner raises on
BIG_STEP = -3  # a step id the fake runner answers with a reply larger than the whole ring
WRONG_ID_STEP = -4  # a step id the fake runner answers with the id of a step never sent
HANG_STEP = -5  # a step id the fake runner never finishes (a hung worker)
NAP_STEP = -6  # a step id the fake runner answers normally after half a second
RANK0_FAILING_STEP = -7  # with TPRunner: rank 0 raises, rank 1 is left waiting in its collective
BIG_TOKENS = 100_000  # ~1.2 MB of msgpack (int64 seq ids + int32 tokens), the reply ring holds 1 MiB


class FakeRunner:
    """Echoes deterministic tokens: seq s at step k samples s * 1000 + its number of tokens."""

    def __init__(self, config: EngineConfig, rank: int):
        self.config = config
        self.rank = rank
        self.seqs: dict[int, list[int]] = {}

    def initialize(self) -> int:
        return self.config.cache.num_gpu_blocks_override or 42

    def execute(self, step: StepInput) -> StepOutput:
        if step.step_id == FAILING_STEP:
            raise ValueError("boom in the fake runner")
        if step.step_id == SLOW_STEP:
            time.sleep(60)
        if step.step_id == WRONG_ID_STEP:
            return StepOutput.pack(step.step_id - 100, step.seq_ids, [0] * len(step.seq_ids))
        if step.step_id == HANG_STEP:
            threading.Event().wait()  # a deadlock: alive, never answers
        if step.step_id == NAP_STEP:
            time.sleep(0.5)
        if step.step_id == BIG_STEP:
            return StepOutput.pack(step.step_id, range(BIG_TOKENS), [t % 50_000 for t in range(BIG_TOKENS)])
        for s in step.finished_seq_ids:
            self.seqs.pop(s, None)
        for new in step.new_seqs:
            self.seqs[new.seq_id] = list(new.token_ids)
        tokens = []
        for s in step.seq_ids:
            t = s * 1000 + len(self.seqs[s])
            self.seqs[s].append(t)
            tokens.append(t)
        return StepOutput.pack(step.step_id, step.seq_ids, tokens)


class BrokenRunner(FakeRunner):
    def initialize(self) -> int:
        raise FileNotFoundError("fake weights missing: /nowhere/model.gguf")


def exiting_runner(config, rank):
    os._exit(3)


def _config(tp: int = 1, num_blocks: int = 77) -> EngineConfig:
    return EngineConfig.from_options(tensor_parallel_size=tp, executor="mp", num_gpu_blocks_override=num_blocks)


def _step(step_id: int, seq_ids: list[int], new: list[int] = ()) -> StepInput:
    news = [NewSeq(s, [1, 2, 3], 3, 0, [s], SamplingOptions()) for s in new]
    return StepInput.pack(step_id, news, seq_ids, [1] * len(seq_ids))


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z"  # a zombie is gone too
    except FileNotFoundError:
        return True


@pytest.fixture
def own_segments(monkeypatch):
    """Names of the ring segments this test creates (other tests running at the same time create
    their own, so checks are scoped to these)."""
    names: list[str] = []
    real_create = ShmRing.create.__func__

    def recording_create(cls, *args, **kwargs):
        ring = real_create(cls, *args, **kwargs)
        names.append(ring.name)
        return ring

    monkeypatch.setattr(ShmRing, "create", classmethod(recording_create))
    return names


def _existing(names: list[str]) -> list[str]:
    return [n for n in names if os.path.exists(f"/dev/shm/{n}")]


@pytest.fixture
def executor(own_segments):
    from pagedserve.gpu.mp_executor import MultiprocExecutor

    ex = MultiprocExecutor(_config(), runner_factory=f"{HERE}:FakeRunner", startup_timeout=60)
    yield ex
    ex.shutdown()
    assert not _existing(own_segments)


def test_ready_sync_and_async_steps(executor):
    assert executor.num_blocks == 77
    out = executor.execute(_step(1, [5, 6], new=[5, 6]))
    assert (out.step_id, list(out.seq_ids), list(out.token_ids), out.error) == (1, [5, 6], [5003, 6003], None)

    async def two_steps():
        a = await executor.execute_async(_step(2, [5, 6]))
        b = await executor.execute_async(_step(3, [6]))
        return a, b

    a, b = asyncio.run(two_steps())
    assert list(a.token_ids) == [5004, 6004] and list(b.token_ids) == [6005]
    executor.check_health()


def test_step_error_is_returned_and_worker_keeps_serving(executor):
    out = executor.execute(_step(FAILING_STEP, []))
    assert out.error is not None and "boom in the fake runner" in out.error
    assert list(executor.execute(_step(4, [9], new=[9])).token_ids) == [9003]
    executor.check_health()


def test_a_step_that_cannot_be_encoded_is_refused_and_the_executor_goes_on(executor):
    """Nothing is sent, so no reply is due: the next steps (sync and async) are answered."""
    from pagedserve.contracts.messages import StepEncodeError

    bad = NewSeq(9, [1, 2, 3], 3, 0, [9], SamplingOptions(top_k=2**64))
    with pytest.raises(StepEncodeError, match="step 4 cannot be encoded"):
        executor.execute(StepInput.pack(4, [bad], [9], [1]))
    with pytest.raises(StepEncodeError):
        asyncio.run(executor.execute_async(StepInput.pack(5, [bad], [9], [1])))
    assert list(executor.execute(_step(6, [9], new=[9])).token_ids) == [9003]
    assert list(asyncio.run(executor.execute_async(_step(7, [9]))).token_ids) == [9004]
    executor.check_health()


def test_event_loop_stays_free_while_a_step_runs(executor):
    async def main():
        ticks = 0
        task = asyncio.ensure_future(executor.execute_async(_step(5, list(range(256)), new=list(range(256)))))
        while not task.done():
            ticks += 1
            await asyncio.sleep(0)
        return await task, ticks

    out, ticks = asyncio.run(main())
    assert list(out.token_ids) == [s * 1000 + 3 for s in range(256)]
    assert ticks > 1


def test_startup_error_is_reported_with_the_worker_traceback(own_segments):
    from pagedserve.gpu.mp_executor import MultiprocExecutor

    with pytest.raises(ExecutorError) as info:
        MultiprocExecutor(_config(), runner_factory=f"{HERE}:BrokenRunner", startup_timeout=60)
    assert "worker 0 failed to start" in str(info.value)
    assert "fake weights missing: /nowhere/model.gguf" in str(info.value)
    assert not _existing(own_segments)


def test_worker_dying_silently_at_startup_is_reported():
    from pagedserve.gpu.mp_executor import MultiprocExecutor

    with pytest.raises(ExecutorError, match="exited with code 3"):
        MultiprocExecutor(_config(), runner_factory=f"{HERE}:exiting_runner", startup_timeout=60)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_kill9_mid_step_raises_within_seconds(executor, mode):
    pids = executor.worker_pids
    executor.execute(_step(1, [1], new=[1]))
    killer = None

    def kill_soon():
        time.sleep(0.3)
        os.kill(pids[0], signal.SIGKILL)

    import threading

    killer = threading.Thread(target=kill_soon)
    t0 = time.monotonic()
    killer.start()
    with pytest.raises(ExecutorError, match="killed by SIGKILL"):
        if mode == "sync":
            executor.execute(_step(SLOW_STEP, [1]))
        else:
            asyncio.run(executor.execute_async(_step(SLOW_STEP, [1])))
    killer.join()
    assert time.monotonic() - t0 < 5
    # later calls fail the same way, at once
    with pytest.raises(ExecutorError, match="killed by SIGKILL"):
        executor.execute(_step(2, [1]))
    with pytest.raises(ExecutorError):
        executor.check_health()
    executor.shutdown()
    assert all(_gone(p) for p in pids)


def test_shutdown_is_clean_and_idempotent(own_segments):
    from pagedserve.gpu.mp_executor import MultiprocExecutor

    ex = MultiprocExecutor(_config(), runner_factory=f"{HERE}:FakeRunner", startup_timeout=60)
    pids = ex.worker_pids
    assert _existing(own_segments) == own_segments  # the rings exist while running (none: pipes)
    ex.execute(_step(1, [1], new=[1]))
    t0 = time.monotonic()
    ex.shutdown()
    assert time.monotonic() - t0 < 5
    ex.shutdown()
    assert all(_gone(p) for p in pids)
    assert not _existing(own_segments)
    with pytest.raises(ExecutorError, match="shut down"):
        ex.execute(_step(2, [1]))


@pytest.mark.skipif(pick_transport() != "shm", reason="checks shared-memory segments; pipes have none")
@pytest.mark.parametrize("how", ["sigkill", "exit_without_shutdown"])
def test_owner_gone_leaves_no_worker_and_no_segment(how):
    """SIGKILL: workers see the owner's sentinel close and exit, its resource tracker unlinks the
    rings. A normal exit without shutdown(): the finalizer runs at interpreter exit."""
    script = textwrap.dedent(f"""
        import sys, time
        from pagedserve.contracts.config import EngineConfig
        from pagedserve.gpu.mp_executor import MultiprocExecutor
        if __name__ == "__main__":
            cfg = EngineConfig.from_options(executor="mp", num_gpu_blocks_override=5)
            ex = MultiprocExecutor(cfg, runner_factory="{HERE}:FakeRunner", startup_timeout=60)
            print(" ".join(map(str, ex.worker_pids)), ex._res.step_ring.name, ex._res.reply_ring.name,
                  flush=True)
            if {how == "sigkill"}:
                time.sleep(120)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                           cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    try:
        fields = proc.stdout.readline().split()
        assert len(fields) == 3, fields
        pid, names = int(fields[0]), fields[1:]
        if how == "sigkill":
            assert all(os.path.exists(f"/dev/shm/{n}") for n in names)
            proc.kill()
        assert proc.wait(10) == (-9 if how == "sigkill" else 0)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not (_gone(pid) and not any(
                os.path.exists(f"/dev/shm/{n}") for n in names)):
            time.sleep(0.05)
        assert _gone(pid)
        assert not any(os.path.exists(f"/dev/shm/{n}") for n in names)
    finally:
        proc.kill()
        proc.wait()


class TPRunner(FakeRunner):
    """Checks the tensor-parallel setup: every token is the all-reduced sum of (rank + 1)."""

    def initialize(self) -> int:
        from pagedserve.gpu.parallel_state import get_tp_rank, get_tp_size

        assert (get_tp_rank(), get_tp_size()) == (self.rank, 2)
        return 10 + self.rank  # the executor reports the smallest count

    def execute(self, step: StepInput) -> StepOutput:
        import torch

        from pagedserve.gpu.parallel_state import tp_all_reduce

        if step.step_id == FAILING_STEP and self.rank == 1:
            raise ValueError("rank 1 cannot run this step")
        if step.step_id == RANK0_FAILING_STEP and self.rank == 0:
            raise MemoryError("rank 0 alone ran out of memory mid-step")
        x = tp_all_reduce(torch.full((len(step.seq_ids),), float(self.rank + 1)))
        return StepOutput.pack(step.step_id, step.seq_ids, [int(v) for v in x.tolist()])


def test_tensor_parallel_two_workers_over_gloo(own_segments):
    from pagedserve.gpu.mp_executor import MultiprocExecutor

    ex = MultiprocExecutor(_config(tp=2), runner_factory=f"{HERE}:TPRunner", startup_timeout=120,
                           num_threads=1)
    try:
        assert ex.num_blocks == 10
        pids = ex.worker_pids
        assert len(pids) == 2
        out = ex.execute(_step(1, [4, 5, 6], new=[4, 5, 6]))
        assert list(out.token_ids) == [3, 3, 3]  # 1 + 2 summed over the two ranks
        # a step failing on rank 1 only: rank 0 is stuck in the collective, the group is torn down
        t0 = time.monotonic()
        with pytest.raises(ExecutorError, match="worker 1 .*exited with code 1") as info:
            ex.execute(_step(FAILING_STEP, [4]))
        assert "rank 1 cannot run this step" in str(info.value)
        assert time.monotonic() - t0 < 10
    finally:
        ex.shutdown()
    assert all(_gone(p) for p in pids)
    assert not _existing(own_segments)


def test_cancelled_async_step_does_not_shift_later_replies(executor):
    async def main():
        task = asyncio.ensure_future(executor.execute_async(_step(1, [3], new=[3])))
        await asyncio.sleep(0)  # the step is sent, its reply not awaited
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return await executor.execute_async(_step(2, [3]))

    out = asyncio.run(main())
    assert (out.step_id, list(out.token_ids)) == (2, [3004])


def test_reply_larger_than_the_ring_sync_and_async(executor):
    out = executor.execute(_step(BIG_STEP, []))
    assert list(out.token_ids) == [t % 50_000 for t in range(BIG_TOKENS)]
    out = asyncio.run(executor.execute_async(_step(BIG_STEP, [])))
    assert len(out.seq_ids) == BIG_TOKENS and out.token_ids[-1] == (BIG_TOKENS - 1) % 50_000
    assert list(executor.execute(_step(1, [2], new=[2])).token_ids) == [2003]


# ---------------------------------------------------------------- replies matched by step id


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_reply_with_an_unexpected_step_id_fails_the_executor(executor, mode):
    """A reply for a step never sent is a worker fault: a clear error and a dead executor, never
    a wrong output handed to the engine as if it answered this step."""
    executor.execute(_step(1, [7], new=[7]))
    with pytest.raises(ExecutorError, match=r"expected the reply to step -4.* got step -104"):
        if mode == "sync":
            executor.execute(_step(WRONG_ID_STEP, [7]))
        else:
            asyncio.run(asyncio.wait_for(executor.execute_async(_step(WRONG_ID_STEP, [7])), 10))
    with pytest.raises(ExecutorError, match="got step -104"):
        executor.check_health()
    with pytest.raises(ExecutorError, match="got step -104"):
        executor.execute(_step(2, [7]))


def test_lost_reply_of_an_abandoned_step_is_a_fault_not_a_shift(executor):
    """Step 1's waiter is cancelled and its reply is lost (taken off the ring here): step 2's reply
    must not be dropped in its place (that shifts every later step by one, or hangs)."""
    ring = executor._res.reply_ring

    async def main():
        task = asyncio.ensure_future(executor.execute_async(_step(1, [3], new=[3])))
        await asyncio.sleep(0)  # the step is sent, its reply not awaited
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        lost = None
        deadline = time.monotonic() + 10
        while lost is None and time.monotonic() < deadline:
            lost = ring.try_recv()
            await asyncio.sleep(0.01)
        assert lost is not None
        return await asyncio.wait_for(executor.execute_async(_step(2, [3])), 10)

    with pytest.raises(ExecutorError, match=r"expected the reply to step 1 .*abandoned.* got step 2"):
        asyncio.run(main())
    with pytest.raises(ExecutorError):
        executor.check_health()


def test_interrupted_sync_step_reply_is_dropped_by_id(executor):
    """A sync step interrupted (Ctrl-C) while waiting: its reply is recognised by id and dropped."""
    real_wait = executor._res.reply_ring.wait
    calls = {"n": 0}

    def interrupted_wait(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise KeyboardInterrupt
        return real_wait(*args, **kwargs)

    executor._res.reply_ring.wait = interrupted_wait
    try:
        with pytest.raises(KeyboardInterrupt):  # the reply is still half a second away
            executor.execute(_step(NAP_STEP, [4], new=[4]))
    finally:
        executor._res.reply_ring.wait = real_wait
    out = executor.execute(_step(2, [4]))
    assert (out.step_id, list(out.token_ids)) == (2, [4004])
    executor.check_health()


# ---------------------------------------------------------------- hung worker (step timeout)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_hung_worker_fails_the_step_after_the_step_timeout(mode, own_segments):
    """A worker alive but stuck in a step: after --step-timeout the executor fails as for a dead
    worker (clear error, later calls fail at once, the stuck worker is stopped)."""
    from pagedserve.gpu.mp_executor import WARMUP_STEPS, MultiprocExecutor

    config = EngineConfig.from_options(executor="mp", num_gpu_blocks_override=9, step_timeout=1.5)
    ex = MultiprocExecutor(config, runner_factory=f"{HERE}:FakeRunner", startup_timeout=60)
    pids = ex.worker_pids
    try:
        ex.execute(_step(1, [1], new=[1]))
        for k in range(2, WARMUP_STEPS + 1):  # the first steps may take the startup timeout
            ex.execute(_step(k, [1]))
        t0 = time.monotonic()
        with pytest.raises(ExecutorError, match=r"no reply to step -5 within 1.5 s .*--step-timeout"):
            if mode == "sync":
                ex.execute(_step(HANG_STEP, [1]))
            else:
                asyncio.run(asyncio.wait_for(ex.execute_async(_step(HANG_STEP, [1])), 20))
        assert 1.4 < time.monotonic() - t0 < 10
        with pytest.raises(ExecutorError, match="no reply to step -5"):
            ex.check_health()
        with pytest.raises(ExecutorError, match="no reply to step -5"):
            ex.execute(_step(99, [1]))
    finally:
        ex.shutdown()
    assert all(_gone(p) for p in pids)
    assert not _existing(own_segments)


def test_first_steps_get_the_startup_timeout():
    """A slow first step (compilation, lazy allocation) is not a hang."""
    from pagedserve.gpu.mp_executor import WARMUP_STEPS, MultiprocExecutor

    config = EngineConfig.from_options(executor="mp", num_gpu_blocks_override=9, step_timeout=7.0)
    ex = MultiprocExecutor(config, runner_factory=f"{HERE}:FakeRunner", startup_timeout=60)
    try:
        assert WARMUP_STEPS >= 1
        assert ex._timeout_for_next_step() == 60
        for k in range(1, WARMUP_STEPS + 1):
            ex.execute(_step(k, [k], new=[k]))
        assert ex._timeout_for_next_step() == 7.0
    finally:
        ex.shutdown()


def test_step_timeout_zero_means_none():
    config = EngineConfig.from_options(executor="mp", num_gpu_blocks_override=9, step_timeout=0)
    assert config.parallel.step_timeout_s == 0
    from pagedserve.gpu.mp_executor import MultiprocExecutor

    ex = MultiprocExecutor(config, runner_factory=f"{HERE}:FakeRunner", startup_timeout=60)
    try:
        assert ex._timeout_for_next_step() is None
    finally:
        ex.shutdown()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_tensor_parallel_step_failing_on_rank0_alone_fails_the_group(mode, own_segments):
    """Rank 0 fails a step the other rank runs on (a lone OOM, a collective that timed out):
    rank 1 is left inside the step's collective, so the next step's collectives would pair with
    the wrong peers. The group cannot go on: the executor fails, naming the cause."""
    from pagedserve.gpu.mp_executor import MultiprocExecutor

    ex = MultiprocExecutor(_config(tp=2), runner_factory=f"{HERE}:TPRunner", startup_timeout=120,
                           num_threads=1)
    pids = ex.worker_pids
    try:
        assert list(ex.execute(_step(1, [4], new=[4])).token_ids) == [3]
        with pytest.raises(ExecutorError, match=r"(?s)collectives are out of step.*rank 0 alone ran out"):
            if mode == "sync":
                ex.execute(_step(RANK0_FAILING_STEP, [4]))
            else:
                asyncio.run(asyncio.wait_for(ex.execute_async(_step(RANK0_FAILING_STEP, [4])), 30))
        with pytest.raises(ExecutorError, match="out of step"):
            ex.execute(_step(2, [4]))
    finally:
        ex.shutdown()
    assert all(_gone(p) for p in pids)
    assert not _existing(own_segments)
