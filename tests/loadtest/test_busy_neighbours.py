"""`bench throughput --busy-neighbours N`: N CPU-bound processes run beside the benchmark and are
gone when it ends, also when it fails or is killed (issue 36 item 5). Nothing here is timed."""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pagedserve.loadtest.micro import bench_throughput, neighbours

ROOT = Path(__file__).resolve().parents[2]


def alive(pid: int) -> bool:
    """Running (a zombie counts as gone: it no longer takes CPU)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_gone(pid: int, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if not alive(pid):
            return True
        time.sleep(0.05)
    return False


def test_neighbours_run_inside_the_block_and_are_reaped_after():
    with neighbours.busy_neighbours(2) as procs:
        pids = [p.pid for p in procs]
        assert len(set(pids)) == 2
        assert all(p.poll() is None for p in procs) and all(alive(pid) for pid in pids)
    assert all(p.returncode is not None for p in procs)  # killed and waited for: no zombie left
    assert not any(alive(pid) for pid in pids)


def test_neighbours_are_reaped_when_the_block_raises():
    with pytest.raises(RuntimeError):
        with neighbours.busy_neighbours(1) as procs:
            raise RuntimeError("the benchmark failed")
    assert procs[0].returncode is not None and not alive(procs[0].pid)


def test_zero_neighbours_start_nothing_and_negative_is_refused():
    with neighbours.busy_neighbours(0) as procs:
        assert procs == []
    with pytest.raises(ValueError):
        with neighbours.busy_neighbours(-1):
            pass


@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux only")
def test_neighbours_die_with_a_killed_benchmark():
    """A benchmark killed with SIGKILL runs no finally; its neighbours still go (parent-death signal)."""
    code = ("import time\n"
            "from pagedserve.loadtest.micro.neighbours import start_neighbours\n"
            "procs = start_neighbours(2)\n"
            "print(' '.join(str(p.pid) for p in procs), flush=True)\n"
            "time.sleep(60)\n")
    parent = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        pids = [int(p) for p in parent.stdout.readline().split()]
        assert len(pids) == 2
        time.sleep(0.5)  # let each neighbour reach its prctl
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=10)
        assert all(wait_gone(pid) for pid in pids), [pid for pid in pids if alive(pid)]
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


class FakeLLM:
    """Stands in for engine.llm.LLM: records which neighbours ran during each generate call."""
    seen: list[list[int]] = []

    def __init__(self, **kwargs):
        pass

    def generate(self, prompts, params, use_tqdm=False):
        running = [p.pid for p in STARTED if p.poll() is None]
        FakeLLM.seen.append(running)
        return [_Out(p["max"]) for p in params]

    def shutdown(self):
        pass


class _Out:
    def __init__(self, n: int):
        self.outputs = [type("C", (), {"token_ids": list(range(n))})()]


STARTED: list = []


def test_bench_throughput_runs_beside_n_neighbours_and_leaves_none(tmp_path, monkeypatch, capsys):
    workload = {"sampling": {}, "requests": [{"prompt_token_ids": [1, 2, 3], "max_tokens": 2}] * 3}
    path = tmp_path / "w.json"
    path.write_text(json.dumps(workload))
    real_start = neighbours.start_neighbours

    def start(n):
        procs = real_start(n)
        STARTED.extend(procs)
        return procs

    import pagedserve.engine.llm

    from pagedserve import engine
    import pagedserve.engine.sampling_params
    from pagedserve import engine
    monkeypatch.setattr(neighbours, "start_neighbours", start)
    monkeypatch.setattr(engine.llm, "LLM", FakeLLM)
    monkeypatch.setattr(engine.sampling_params, "SamplingParams", lambda max_tokens, **kw: {"max": max_tokens})
    monkeypatch.setattr(bench_throughput, "engine_config_from_args", lambda args: None)
    monkeypatch.setattr(bench_throughput, "_flat", lambda config: {})
    FakeLLM.seen = []
    STARTED.clear()
    parser = argparse.ArgumentParser()
    bench_throughput.add_arguments(parser)
    args = parser.parse_args(["--workload", str(path), "--json", "--busy-neighbours", "3"])
    assert bench_throughput.run(args) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["busy_neighbours"] == 3 and result["requests"] == 3 and result["output_tokens"] == 6
    assert len(STARTED) == 3
    assert FakeLLM.seen == [[p.pid for p in STARTED]] * 2  # warm-up and timed run, all three running
    assert all(p.returncode is not None for p in STARTED) and not any(alive(p.pid) for p in STARTED)


def test_bench_throughput_refuses_a_negative_count(tmp_path):
    parser = argparse.ArgumentParser()
    bench_throughput.add_arguments(parser)
    args = parser.parse_args(["--busy-neighbours", "-2"])
    with pytest.raises(SystemExit):
        bench_throughput.run(args)
