"""A server that cannot start because of what the user asked for (a missing model file, a bad
config) says so in one line and exits 1: no traceback, never exit code 0."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_missing_model_is_one_line_and_exit_1(tmp_path):
    missing = tmp_path / "no-such-model.gguf"
    proc = subprocess.run([sys.executable, "-m", "pagedserve.app.cli", "serve", "--model", str(missing),
                           "--host", "127.0.0.1", "--port", "0"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "Traceback" not in out, out
    errors = [line for line in out.splitlines() if " ERROR " in line]
    assert len(errors) == 1, out
    assert str(missing) in errors[0] and "does not exist" in errors[0]


def test_data_parallel_needs_worker_processes():
    for flags, reason in ((["--data-parallel-size", "2", "--executor", "inproc"], "needs worker processes"),
                          (["--data-parallel-size", "0"], "must be at least 1")):
        proc = subprocess.run([sys.executable, "-m", "pagedserve.app.cli", "serve", *flags, "--host", "127.0.0.1",
                               "--port", "0"], cwd=ROOT, capture_output=True, text=True, timeout=120)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 1 and "Traceback" not in out, out
        errors = [line for line in out.splitlines() if " ERROR " in line]
        assert len(errors) == 1 and reason in errors[0], out


def test_device_cuda_without_cuda_is_one_line_saying_why():
    """Issue 24 fault 5: refused before any worker starts, naming what torch lacks."""
    import torch

    if torch.cuda.is_available():
        import pytest

        pytest.skip("this box has CUDA")
    proc = subprocess.run([sys.executable, "-m", "pagedserve.app.cli", "serve", "--device", "cuda", "--host", "127.0.0.1",
                           "--port", "0"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1 and "Traceback" not in out, out
    errors = [line for line in out.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and "--device cuda: CUDA is not available: torch" in errors[0], out
