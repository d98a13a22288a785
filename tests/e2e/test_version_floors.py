"""The version floors pyproject.toml declares are real (issue 10, fault 10).

The server-side packages are installed from the package index at exactly the floor versions
pyproject.toml declares (``pip install --target DIR name==floor ...``; pip adds what those
releases need, so the floors must also agree with each other), put first on PYTHONPATH, and a
real `pagedserve serve` (tiny random model) must start on them and answer chat completions. A
floor set too low (an API the code uses is missing at that version) fails here; the test reads
the floors from pyproject.toml, so it proves what is declared, not a copy of it.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import httpx
import pytest
from packaging.version import Version

from tests.tiny import TINY_CONFIG

ROOT = Path(__file__).resolve().parents[2]

# Packages the server imports itself (HTTP, SSE, protocol, metrics, IPC, tokenizer, model file).
SERVER_PACKAGES = ("uvicorn", "sse-starlette", "starlette", "anyio", "pydantic", "orjson", "msgspec",
                   "prometheus-client", "tokenizers", "gguf", "jinja2", "uvloop", "httptools")
# Import name of each distribution, to check that the server really imports the floor copy.
MODULES = {"sse-starlette": "sse_starlette", "prometheus-client": "prometheus_client"}
NETWORK_ERRORS = ("NewConnectionError", "Max retries exceeded", "Temporary failure in name resolution",
                  "Network is unreachable", "Connection refused", "ConnectTimeout", "ReadTimeoutError")


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared_floors() -> dict[str, str]:
    """name -> floor version from pyproject's dependencies (``name[extras]>=X``)."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    floors = {}
    for dep in deps:
        m = re.match(r"^\s*([A-Za-z0-9_.-]+)(\[[^\]]*\])?\s*>=\s*([0-9][^,;\s]*)", dep)
        if m:
            floors[_norm(m.group(1))] = m.group(3)
    return floors


def test_declared_python_floor_covers_the_code():
    """asyncio.Runner (serve) is Python 3.11; uvicorn's loop factory is 0.36; sse-starlette's
    disable_automatic_graceful_drain is 3.2 — the declared floors must be at least those."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    m = re.match(r"^>=\s*3\.(\d+)", project["requires-python"])
    assert m and int(m.group(1)) >= 11, project["requires-python"]
    assert "asyncio.Runner" in (ROOT / "pagedserve" / "app" / "serve_cmd.py").read_text()
    floors = declared_floors()

    def at_least(name: str, version: tuple[int, ...]) -> bool:
        return tuple(int(x) for x in re.findall(r"\d+", floors[name])[:len(version)]) >= version

    assert at_least("uvicorn", (0, 36)), floors["uvicorn"]
    assert at_least("sse-starlette", (3, 2)), floors["sse-starlette"]
    missing = [p for p in SERVER_PACKAGES if p not in floors]
    assert not missing, f"declare a floor (name>=X) for {missing} in pyproject.toml"


def pip_install(target: Path, specs: list[str]) -> None:
    cmd = [sys.executable, "-m", "pip", "install", "--no-compile", "--only-binary=:all:",
           "--disable-pip-version-check", "--target", str(target), *specs]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        pytest.skip("the package index did not answer within 600 s; cannot install the floors")
    if proc.returncode != 0:
        out = proc.stdout + proc.stderr
        if any(e in out for e in NETWORK_ERRORS):
            pytest.skip(f"the package index is unreachable; cannot install the floors:\n{out[-800:]}")
        raise AssertionError(f"installing the declared floors failed:\n{' '.join(specs)}\n{out[-3000:]}")


@pytest.fixture(scope="module")
def floor_site(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    floors = {p: v for p, v in declared_floors().items() if p in SERVER_PACKAGES}
    target = tmp_path_factory.mktemp("floors")
    pip_install(target, [f"{p}=={v}" for p, v in sorted(floors.items())])
    return target, floors


@pytest.mark.slow
def test_server_runs_on_the_declared_minimum_versions(floor_site):
    target, floors = floor_site
    env = {**os.environ, "PYTHONPATH": f"{target}{os.pathsep}{ROOT}", "PAGEDSERVE_API_KEY": ""}
    # 1. That environment imports exactly the floor versions, from the floor directory.
    check = ("import importlib, importlib.metadata as md, json, sys\n"
             f"mods = {json.dumps({p: MODULES.get(p, p.replace('-', '_')) for p in floors})}\n"
             "out = {}\n"
             "for dist, mod in mods.items():\n"
             "    m = importlib.import_module(mod)\n"
             "    out[dist] = [md.version(dist), m.__file__]\n"
             "print(json.dumps(out))\n")
    proc = subprocess.run([sys.executable, "-c", check], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout)
    for dist, version in floors.items():
        got, path = seen[dist]
        assert Version(got) == Version(version), (dist, got, version)
        assert path.startswith(str(target)), (dist, path)

    # 2. A real server on those versions starts, streams and answers.
    from pagedserve.loadtest.local_server import readiness_timeout
    from tests.e2e.test_server_e2e import free_port, model_path

    port = free_port()
    cmd = [sys.executable, "-m", "pagedserve.app.cli", "serve", "--model", model_path(), "--load-format", "dummy",
           "--hf-config", json.dumps(TINY_CONFIG), "--dtype", "float32", "--max-model-len", "512",
           "--num-gpu-blocks-override", "64", "--served-model-name", "tiny", "--port", str(port),
           "--shutdown-timeout", "5"]
    log_path = target.parent / f"serve-{port}.log"
    with open(log_path, "w+") as log:
        server = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{port}"
            ready_s = readiness_timeout(cmd)
            deadline = time.monotonic() + ready_s
            while True:
                assert server.poll() is None, f"server exited {server.returncode}:\n{log_path.read_text()}"
                try:
                    if httpx.get(url + "/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline, f"not ready in {ready_s:.0f} s:\n{log_path.read_text()}"
                time.sleep(0.2)
            chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5}
            r = httpx.post(url + "/v1/chat/completions", json=chat, timeout=60)
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["usage"]["completion_tokens"] == 5
            assert body["choices"][0]["finish_reason"] == "length"
            with httpx.stream("POST", url + "/v1/chat/completions", json={**chat, "stream": True},
                              timeout=60) as s:
                lines = [ln for ln in s.iter_lines() if ln.startswith("data: ")]
            assert lines[-1] == "data: [DONE]" and len(lines) >= 3
            r = httpx.post(url + "/v1/chat/completions", json={"messages": "not a list"}, timeout=30)
            assert r.status_code == 400 and r.json()["error"]["message"]
            assert "pagedserve:request_success_total" in httpx.get(url + "/metrics", timeout=30).text
        finally:
            if server.poll() is None:
                server.send_signal(signal.SIGTERM)
                try:
                    server.wait(60)
                except subprocess.TimeoutExpired:
                    server.kill()
                    server.wait(10)
        assert server.returncode == 0, log_path.read_text()


@pytest.mark.slow
def test_gguf_floor_dequantizes_the_default_model(floor_site):
    """The model loader calls gguf.quants.dequantize on GGUF tensors: the floor has it."""
    target, floors = floor_site
    env = {**os.environ, "PYTHONPATH": f"{target}{os.pathsep}{ROOT}"}
    code = ("import gguf, importlib.metadata as md\n"
            "from gguf.quants import dequantize\n"
            "from pagedserve.contracts.config import default_model_path\n"
            "r = gguf.GGUFReader(default_model_path())\n"
            "t = next(t for t in r.tensors if t.name == 'blk.0.attn_k.weight')\n"
            "w = dequantize(t.data, t.tensor_type)\n"
            "print(md.version('gguf'), w.shape, float(abs(w).sum()) > 0)\n")
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    version, *_, nonzero = proc.stdout.split()
    assert Version(version) == Version(floors["gguf"]) and nonzero == "True", proc.stdout
