"""What the soak reads from the server rather than from its answers: /metrics gauges and failure
counters, waiting for it to go idle, polling its event-loop lag, and its pid for /proc readings.
"""
from __future__ import annotations

import asyncio
import time
from urllib.parse import urlsplit

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pagedserve.loadtest import proctree
from pagedserve.loadtest.soak_config import SoakConfig


IDLE_GAUGES = ("kv_cache_usage_perc", "num_requests_running", "num_requests_waiting")
# sample name -> the label that splits it
FAILURE_COUNTERS = {
    "pagedserve:http_error_responses_total": "status_code",
    "pagedserve:request_errors_total": "reason",
    "pagedserve:request_success_total": "finished_reason",
}


def _metric(text: str, name: str) -> float | None:
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "pagedserve:" + name:
                return s.value
    return None


async def gauges(client: httpx.AsyncClient) -> dict[str, float | None]:
    text = (await client.get("/metrics")).text
    return {g: _metric(text, g) for g in IDLE_GAUGES}


def failure_counters(text: str) -> dict[str, dict[str, float]]:
    """The server's own failure counters ({counter: {label value: count}}), to compare with what
    the clients saw; counters an older server lacks are simply absent."""
    out: dict[str, dict[str, float]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            label = FAILURE_COUNTERS.get(s.name)
            if label and label in s.labels:
                out.setdefault(s.name.removeprefix("pagedserve:"), {})[s.labels[label]] = s.value
    return out


async def read_failure_counters(base_url: str) -> dict[str, dict[str, float]]:
    async with httpx.AsyncClient(base_url=base_url, timeout=10) as c:
        return failure_counters((await c.get("/metrics")).text)


def counter_delta(before: dict, after: dict) -> dict[str, dict[str, float]]:
    return {name: {k: v - before.get(name, {}).get(k, 0.0) for k, v in values.items()
                   if v - before.get(name, {}).get(k, 0.0)}
            for name, values in after.items()}


async def wait_idle(base_url: str, timeout: float) -> dict[str, float | None]:
    """Poll /metrics (on a fresh connection) until nothing runs or waits; the last reading."""
    async with httpx.AsyncClient(base_url=base_url, timeout=10) as c:
        deadline = time.monotonic() + timeout
        while True:
            g = await gauges(c)
            if (g["num_requests_running"] == 0 and g["num_requests_waiting"] == 0
                    and g["kv_cache_usage_perc"] == 0) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
    await asyncio.sleep(0.5)  # let the server close the sockets of the clients that just left
    return g


LOOP_LAG = "event_loop_lag_seconds"
LOOP_LAG_MAX = "event_loop_lag_max_seconds"


class LagPoller:
    """Reads the server's loop-lag gauge every ``interval`` s on its own connection (the worst in
    the server's last 10 s), so a stall anywhere in the run is seen; None when the server has no
    such gauge."""

    def __init__(self, base_url: str, interval: float) -> None:
        self.base_url = base_url
        self.interval = interval
        self.max_lag_s: float | None = None
        self.samples = 0
        self._task: asyncio.Task | None = None

    async def _run(self) -> None:
        async with httpx.AsyncClient(base_url=self.base_url, timeout=60) as c:
            while True:
                try:
                    v = _metric((await c.get("/metrics")).text, LOOP_LAG)
                except httpx.HTTPError:
                    v = None
                if v is not None:
                    self.samples += 1
                    self.max_lag_s = v if self.max_lag_s is None else max(self.max_lag_s, v)
                await asyncio.sleep(self.interval)

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


async def read_gauge(base_url: str, name: str) -> float | None:
    async with httpx.AsyncClient(base_url=base_url, timeout=30) as c:
        return _metric((await c.get("/metrics")).text, name)


def server_pid(cfg: SoakConfig) -> int | None:
    if cfg.server_pid is not None:
        return cfg.server_pid
    parts = urlsplit(cfg.base_url)
    if parts.hostname in ("127.0.0.1", "localhost", "::1") and parts.port:
        return proctree.pid_listening_on(parts.port)
    return None
