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

import httpx

from loadtest import proctree
from loadtest.tiny_model import TINY_CONFIG

logger = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[1]

class ServerStartError(RuntimeError):
    """The server exited or did not answer /health in time; the message carries its log."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_args(max_model_len: int = 2048, num_blocks: int = 256, config: dict | None = None) -> list[str]:
    """`serve` arguments for a random-weight model (``config``, default TINY_CONFIG)."""
    from contracts.config import default_model_path

    return ["--model", default_model_path(), "--load-format", "dummy", "--hf-config",
            json.dumps(config or TINY_CONFIG), "--dtype", "float32", "--max-model-len",
            str(max_model_len), "--num-gpu-blocks-override", str(num_blocks)]


class LocalServer:
    """``pagedserve serve *args --port <free>``; its log goes to a temporary file named
    ``<log_prefix><port>-*.log``. The e2e tests' ServerProcess extends it."""

    def __init__(self, args: list[str], *, ready_timeout: float = 120.0,
                 log_prefix: str = "pagedserve-soak-") -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "app.cli", "serve", *args, "--host", "127.0.0.1",
               "--port", str(self.port)]
        env = {**os.environ, "PYTHONPATH": str(ROOT), "PAGEDSERVE_API_KEY": ""}
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"{log_prefix}{self.port}-",
                                               suffix=".log", delete=False)
        logger.info("starting %s (log %s)", " ".join(cmd), self.log.name)
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self.log,
                                     stderr=subprocess.STDOUT)
        self.segments: set[str] = set()
        self._wait_ready(ready_timeout)
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
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
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
