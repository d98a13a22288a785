"""`pagedserve bench startup` starts real servers, times them to /health 200 and stops them."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from pagedserve.loadtest.local_server import tiny_args

ROOT = Path(__file__).resolve().parents[2]


def test_bench_startup_times_a_real_server_and_stops_it():
    cmd = [sys.executable, "-m", "pagedserve.app.cli", "bench", "startup", "--runs", "1", "--json", "--",
           *tiny_args(num_blocks=64)]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(result["runs"]) == 1 and 0 < result["median_s"] == result["runs"][0]
    marks = result["median_marks"]
    # The milestones of a start in order, all before /health answered.
    assert marks["workers ready (parent)"] <= marks["engine ready (parent)"] <= marks["ready line"]
    assert marks["ready line"] <= result["median_s"]
    assert result["median_cpu_s"] > 0  # the server was reaped: its CPU time is counted


def test_bench_startup_reports_a_server_that_cannot_start():
    cmd = [sys.executable, "-m", "pagedserve.app.cli", "bench", "startup", "--runs", "1", "--",
           "--model", "/nonexistent/model.gguf"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 1
    assert "did not become healthy" in out.stderr and "does not exist" in out.stderr
    assert "Traceback" not in out.stderr.split("did not become healthy")[0]  # one clear message first


def test_milestones_are_stamped_with_the_server_logs_own_time():
    """A milestone's time is the asctime stamp the server wrote (ms), not when our reader thread read
    the line, which can be after /health already answered (CI once saw ready line 2.960 > 2.959)."""
    import time

    from pagedserve.loadtest.bench_startup import _logged_at

    wall0 = 1_700_000_000.25
    when = wall0 + 1.5
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(when)) + f",{int(when * 1000) % 1000:03d}"
    assert abs(_logged_at(f"{stamp} INFO pagedserve.serve: x | ready", wall0) - 1.5) < 1e-6
    assert _logged_at("INFO: Uvicorn running", wall0) is None
    assert _logged_at("2026-11-24 01:04:35 no milliseconds", wall0) is None
