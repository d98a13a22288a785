"""The project installs as a wheel under one `pagedserve` namespace (issue 38 item 1): built here,
installed into a fresh venv whose only other packages are the dependencies (no source tree on
sys.path), it serves a chat request and runs `bench latency` on the tiny model, its C kernels
built from the sources the wheel ships."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import time
import zipfile
from pathlib import Path

import httpx
import pytest

from pagedserve.loadtest.local_server import free_port, tiny_args

ROOT = Path(__file__).resolve().parents[2]
ROOMS = ("app", "contracts", "engine", "gpu", "kernels", "loadtest")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                    "-w", str(out), str(ROOT)], check=True, capture_output=True, timeout=600)
    (found,) = out.glob("pagedserve-*.whl")
    return found


def test_the_wheel_has_one_top_level_name_and_the_kernel_sources(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert tops == {"pagedserve"}, tops
    assert not any(n.endswith(".so") for n in names)
    for needed in ("pagedserve/kernels/csrc/qgemm.c", "pagedserve/kernels/csrc/paged_attn.c",
                   "pagedserve/app/static/chat.html", "pagedserve/loadtest/workloads/w1.json"):
        assert needed in names, needed
    assert any(n.startswith("pagedserve/kernels/csrc/") and n.endswith(".h") for n in names)


@pytest.mark.slow
def test_installed_wheel_serves_a_chat_request_and_runs_bench_latency(wheel, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site = Path(subprocess.run([str(venv / "bin" / "python"), "-c",
                                "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    # The dependencies come from this venv's site-packages as a plain path entry: its own .pth files
    # (the editable install of the checkout among them) are not processed, so the source tree stays out.
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install",
                    "--no-deps", "--no-index", "--ignore-installed", str(wheel)], check=True, capture_output=True, timeout=300)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PAGEDSERVE_KERNEL_CACHE"] = str(tmp_path / "kcache")  # built from the wheel's own sources
    env["PAGEDSERVE_API_KEY"] = ""
    exe = str(venv / "bin" / "pagedserve")
    where = subprocess.run([str(venv / "bin" / "python"), "-c",
                            "import pagedserve, pagedserve.kernels.cbuild as c; print(pagedserve.__file__, c.CSRC)"],
                           cwd=tmp_path, env=env, check=True, capture_output=True, text=True).stdout
    assert str(site) in where and str(ROOT) not in where, where
    version = subprocess.run([exe, "--version"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert version.returncode == 0 and version.stdout.startswith("pagedserve "), version
    port = free_port()
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen([exe, "serve", *tiny_args(), "--served-model-name", "tiny", "--host", "127.0.0.1",
                             "--port", str(port)], cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, (tmp_path / "serve.log").read_text()[-3000:]
            time.sleep(0.5)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=120, json={
            "model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] >= 1
    finally:
        proc.terminate()
        assert proc.wait(60) == 0, (tmp_path / "serve.log").read_text()[-3000:]
    bench = subprocess.run([exe, "bench", "latency", *tiny_args(), "--input-len", "8", "--output-len", "4",
                            "--num-iters", "1", "--json"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert bench.returncode == 0, bench.stdout[-2000:] + bench.stderr[-3000:]
    assert json.loads(bench.stdout.strip().splitlines()[-1]), bench.stdout[-2000:]
