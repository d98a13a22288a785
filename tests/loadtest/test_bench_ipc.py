"""`pagedserve bench ipc` runs end to end and reports every transport at every batch size. Only the
shape and sanity of the figures are checked: speed is a benchmark, not a test."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_ipc_reports_all_transports_and_sizes():
    cmd = [sys.executable, "-m", "pagedserve.app.cli", "bench", "ipc", "--iters", "40", "--warmup", "5",
           "--batch-sizes", "1,256", "--json"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    assert result["iters"] == 40
    for transport in ("ring", "pipe", "queue", "executor", "async", "pipe-bytes"):
        for size in ("1", "256"):
            figures = result["results"][transport][size]
            assert 0 < figures["median_us"] <= figures["p99_us"], (transport, size, figures)
    # The bigger step is a bigger message, and the ratio is computed from the medians.
    assert result["step_bytes"]["256"] > result["step_bytes"]["1"]
    ring, queue = result["results"]["ring"]["256"], result["results"]["queue"]["256"]
    assert abs(result["queue_over_ring_median"]["256"] - queue["median_us"] / ring["median_us"]) < 0.1


def test_bench_ipc_ray_rows():
    """`--ray` adds the Ray executor's transports, measured on a local instance it stops again."""
    from tests.needs import require

    require("ray")
    cmd = [sys.executable, "-m", "pagedserve.app.cli", "bench", "ipc", "--iters", "20", "--warmup", "5",
           "--batch-sizes", "64", "--no-executor", "--no-raw", "--ray", "--json"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr
    results = json.loads(r.stdout)["results"]
    for transport in ("ring", "queue", "ray-ring", "ray-call", "ray-cgraph"):
        figures = results[transport]["64"]
        assert 0 < figures["median_us"] <= figures["p99_us"], (transport, figures)
