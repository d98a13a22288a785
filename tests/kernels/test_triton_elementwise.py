"""The decoder's elementwise Triton kernels (kernels/triton_elementwise.py: RMSNorm with the
residual add, rotary in place, SiLU and mul) against torch, and a tiny Llama's forward through
them equal to its torch path, under the Triton interpreter on CPU tensors. The interpreter must
be switched on before triton is first imported, so the cases (tests/kernels/
triton_elementwise_cases.py) run in a process of their own."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.needs import on_x86_64, require_installed

require_installed("triton", in_test_extra=on_x86_64())

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("case", ["rms_norm_cases", "gemma_norm_case", "rotary_cases", "silu_cases", "model_case"])
def test_triton_elementwise(case):
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "tests.kernels.triton_elementwise_cases", case], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and f"ok {case}" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]
