"""Start a real `pagedserve serve` process on a free 127.0.0.1 port, wait until /health answers,
stop it with SIGTERM and report its exit code: what `bench soak --start-server` needs to measure
a server it owns (pid, process tree, the shared-memory segments its executor created)."""
from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from pagedserve.loadtest import proctree
from pagedserve.loadtest.tiny_model import TINY_CONFIG

logger = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[2]  # the checkout (above pagedserve/)

# How long a `serve` may take to answer /health 200, by what it starts (seconds on an idle box):
# the process with its imports and the model, each worker process (or Ray actor), Ray's own start.
# A one-process server gets the 120 s this wait always had; the sum grows with the machine's load
# per core (a correct build on a busy box is slow, not broken) up to a ceiling that still ends a
# server that will never answer.
READY_BASE_S = 105.0
READY_PER_WORKER_S = 15.0
READY_RAY_START_S = 60.0
READY_CEILING_S = 480.0  # under pytest-timeout's 600 s, so the server's log is what a failure shows


def _flag(args: list[str], names: tuple[str, ...], default: str | None) -> str | None:
    """The last value given for any of ``names`` (``--flag value`` or ``--flag=value``)."""
    value = default
    for i, arg in enumerate(args):
        name, eq, inline = arg.partition("=")
        if name in names:
            value = inline if eq else (args[i + 1] if i + 1 < len(args) else value)
    return value


def readiness_timeout(serve_args: list[str]) -> float:
    """Seconds to wait for /health of `pagedserve serve *serve_args`: READY_BASE_S, plus
    READY_PER_WORKER_S per worker process of every replica (tp x pp x dp), plus READY_RAY_START_S
    with the Ray executor, times the 1-minute load per CPU when above 1, at most READY_CEILING_S."""
    tp = int(_flag(serve_args, ("--tensor-parallel-size", "-tp"), "1"))
    pp = int(_flag(serve_args, ("--pipeline-parallel-size", "-pp"), "1"))
    dp = int(_flag(serve_args, ("--data-parallel-size", "-dp"), "1"))
    executor = _flag(serve_args, ("--executor", "--distributed-executor-backend"), None)
    seconds = READY_BASE_S + READY_PER_WORKER_S * tp * pp * dp
    if executor == "ray":
        seconds += READY_RAY_START_S
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    load_per_cpu = os.getloadavg()[0] / cpus
    return min(READY_CEILING_S, seconds * max(1.0, load_per_cpu))


class ServerStartError(RuntimeError):
    """The server exited or did not answer /health in time; the message carries its log."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_args(max_model_len: int = 2048, num_blocks: int = 256, config: dict | None = None) -> list[str]:
    """`serve` arguments for a random-weight model (``config``, default TINY_CONFIG)."""
    from pagedserve.contracts.config import default_model_path

    return ["--model", default_model_path(), "--load-format", "dummy", "--hf-config",
            json.dumps(config or TINY_CONFIG), "--dtype", "float32", "--max-model-len",
            str(max_model_len), "--num-gpu-blocks-override", str(num_blocks)]


class LocalServer:
    """``pagedserve serve *args --port <free>``; its log goes to a temporary file named
    ``<log_prefix><port>-*.log``. It waits ``ready_timeout`` seconds for /health 200, by default
    ``readiness_timeout(args)``. The e2e tests' ServerProcess extends it."""

    def __init__(self, args: list[str], *, ready_timeout: float | None = None,
                 log_prefix: str = "pagedserve-soak-", https_verify: Any = None) -> None:
        """``https_verify``: the server serves HTTPS (--ssl-certfile); an ssl.SSLContext that
        trusts its certificate."""
        self.port = free_port()
        self.verify = https_verify if https_verify is not None else True
        self.url = f"{'https' if https_verify is not None else 'http'}://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "pagedserve.app.cli", "serve", *args, "--host", "127.0.0.1",
               "--port", str(self.port)]
        # The inherited PYTHONPATH stays after the checkout (packages carried to a GPU machine live there).
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
        env = {**os.environ, "PYTHONPATH": path, "PAGEDSERVE_API_KEY": ""}
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"{log_prefix}{self.port}-",
                                               suffix=".log", delete=False)
        logger.info("starting %s (log %s)", " ".join(cmd), self.log.name)
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self.log,
                                     stderr=subprocess.STDOUT)
        self.segments: set[str] = set()
        self._wait_ready(readiness_timeout(args) if ready_timeout is None else ready_timeout)
        self.segments = proctree.mapped_shm(self.proc.pid)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def output(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerStartError(f"server exited with {self.proc.returncode}:\n{self.output()[-4000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=1, verify=self.verify).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise ServerStartError(f"server not ready in {timeout:.0f} s:\n{self.output()[-4000:]}")

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM, wait; SIGKILL only if it does not exit (then the code is negative)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                logger.error("server pid %d ignored SIGTERM for %.0f s; killing it", self.pid, timeout)
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def leftover_segments(self) -> list[str]:
        """Segments this server created that still exist (call after stop)."""
        return sorted(n for n in self.segments if os.path.exists(n))
