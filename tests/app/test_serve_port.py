"""`pagedserve serve` binds its port before the engine loads (issue 10, fault 7): a busy port is a
one-line error and exit code 1 in about a second, never after a full model load."""
from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from pagedserve.app.cli import build_parser
from pagedserve.app.listen import ListenError, bind_socket
from tests.tiny import TINY_CONFIG

ROOT = Path(__file__).resolve().parents[2]


def occupied_port() -> socket.socket:
    """A socket listening on a free port of 127.0.0.1 (the port stays busy while it is open)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


def serve_argv(port: int) -> list[str]:
    from pagedserve.contracts.config import default_model_path

    return ["serve", "--model", default_model_path(), "--load-format", "dummy",
            "--hf-config", json.dumps(TINY_CONFIG), "--dtype", "float32", "--max-model-len", "256",
            "--num-gpu-blocks-override", "64", "--host", "127.0.0.1", "--port", str(port)]


def test_bind_socket_reports_a_busy_port_in_one_line():
    with occupied_port() as busy:
        port = busy.getsockname()[1]
        with pytest.raises(ListenError) as e:
            bind_socket("127.0.0.1", port)
    msg = str(e.value)
    assert "\n" not in msg and f"127.0.0.1:{port}" in msg and "already in use" in msg
    assert "--port" in msg


def test_bind_socket_unknown_host_is_a_listen_error():
    with pytest.raises(ListenError, match="unknown host"):
        bind_socket("no-such-host.invalid", 0)


def test_busy_port_fails_before_the_engine_starts(monkeypatch, caplog):
    from pagedserve.app import serve_cmd
    from pagedserve.engine.async_engine import AsyncEngine

    started = []

    async def start(self):
        started.append(True)
        raise AssertionError("the engine must not start when the port is busy")

    monkeypatch.setattr(AsyncEngine, "start", start)
    with occupied_port() as busy:
        port = busy.getsockname()[1]
        args = build_parser(serve_argv(port)).parse_args(serve_argv(port))
        rc = serve_cmd.run(args)
    assert rc == 1
    assert started == []
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and "already in use" in errors[0] and str(port) in errors[0]


def test_the_port_is_held_while_the_engine_loads(monkeypatch):
    """Bound first: while the engine starts, nobody else can take the port."""
    from pagedserve.app import serve_cmd
    from pagedserve.engine.async_engine import AsyncEngine

    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    seen = []

    async def start(self):
        with socket.socket() as other:
            try:
                other.bind(("127.0.0.1", port))
            except OSError as e:
                seen.append(e.errno)
            else:
                seen.append("bound")
        raise RuntimeError("stop here: this test only looks at the port during start")

    monkeypatch.setattr(AsyncEngine, "start", start)
    args = build_parser(serve_argv(port)).parse_args(serve_argv(port))
    with pytest.raises(RuntimeError, match="stop here"):
        serve_cmd.run(args)
    assert seen == [errno.EADDRINUSE]
    with socket.socket() as again:  # and it is released when serve returns
        again.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        again.bind(("127.0.0.1", port))


def test_serve_process_on_a_busy_port_exits_1_with_one_line_and_no_engine():
    with occupied_port() as busy:
        port = busy.getsockname()[1]
        env = {**os.environ, "PYTHONPATH": str(ROOT), "PAGEDSERVE_API_KEY": ""}
        proc = subprocess.run([sys.executable, "-m", "pagedserve.app.cli", *serve_argv(port)], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=120)
    out = (proc.stdout + proc.stderr).strip().splitlines()
    assert proc.returncode == 1, out
    # One line, naming the address and what to change; nothing from the engine or its workers.
    assert len(out) == 1, out
    assert f"127.0.0.1:{port}" in out[0] and "already in use" in out[0] and "ERROR" in out[0]
