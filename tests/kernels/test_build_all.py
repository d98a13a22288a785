"""``python -m pagedserve.kernels.build_all`` (make install) builds every kernel this CPU runs, so a server
started afterwards loads them from the cache and needs no compiler."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from pagedserve.kernels import build_all, isa

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CC", "gcc")) is None, reason="no C compiler")


def test_every_kernel_this_cpu_runs_is_built_and_the_rest_named() -> None:
    rows = {name: (level, outcome) for name, level, outcome in build_all.build_all()}
    assert set(rows) == set(isa.KERNELS)
    for name, (level, outcome) in rows.items():
        choice = isa.choose(name)
        if choice is None:
            assert (level, outcome) == ("-", "not used on this CPU")
        else:
            assert (level, outcome) == (choice.level, "ready"), name


def test_after_it_the_kernels_load_without_a_compiler(tmp_path) -> None:
    """Build into a fresh cache, then load every kernel with CC naming no compiler: none rebuilds."""
    env = {**os.environ, "PAGEDSERVE_KERNEL_CACHE": str(tmp_path / "cache")}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    subprocess.run([sys.executable, "-m", "pagedserve.kernels.build_all"], env=env, cwd=root, check=True, timeout=900,
                   capture_output=True)
    code = ("from pagedserve.kernels import attn_amx, cpu_attention, fused, isa, qgemm, qgemm_n16, sample_cpu\n"
            "qgemm.library(); assert fused.available() and cpu_attention.library() is not None\n"
            "for name, lib in (('sample_cpu', sample_cpu.library()), ('qgemm_n16', qgemm_n16.library())):\n"
            "    assert (lib is None) == (isa.choose(name) is None), name\n"
            "print('ok')\n")
    proc = subprocess.run([sys.executable, "-c", code], env={**env, "CC": "no-such-compiler-xyz"}, cwd=root,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr
