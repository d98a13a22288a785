"""locust headless (a subprocess: locust monkey-patches with gevent) against the mock server."""
from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.loadtest.mock_server import MockServer

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
LOCUST = str(Path(sys.executable).with_name("locust"))


def _run_locust(base_url: str, csv_prefix: Path, extra: list[str], env: dict | None = None):
    cmd = [LOCUST, "-f", str(ROOT / "pagedserve" / "loadtest" / "locustfile.py"), "--headless", "-H", base_url,
           "-u", "4", "-r", "4", "-t", "20s", "--max-requests", "20", "--prompt-len", "20", "--output-len", "10",
           "--csv", str(csv_prefix), "--only-summary", "--loglevel", "WARNING", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=90, cwd=ROOT,
                          env={**os.environ, **(env or {})})
    with open(f"{csv_prefix}_stats.csv", newline="") as f:
        rows = {(r["Type"], r["Name"]): r for r in csv.DictReader(f)}
    return proc, rows


def _count(rows: dict, type_: str, col: str = "Request Count") -> int:
    return sum(int(r[col]) for (t, _), r in rows.items() if t == type_)


def test_locust_streaming_mix_reports_ttft_itl(tmp_path):
    with MockServer(mode="ok") as srv:
        proc, rows = _run_locust(srv.base_url, tmp_path / "ok", ["--endpoint-mix", "chat:1,completions:1"])
        usage = list(srv.state.usage)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert _count(rows, "POST") == 20 and _count(rows, "POST", "Failure Count") == 0
    assert len(usage) == 20  # exactly --max-requests reached the server, all answered in full
    assert {name for (t, name) in rows if t == "POST"} == {"/v1/chat/completions", "/v1/completions"}
    assert _count(rows, "TTFT") == 20 and _count(rows, "TPOT") == 20
    assert _count(rows, "ITL") > 20
    for (t, name), r in rows.items():
        if t == "TTFT":  # the mock waits 20 ms before the first token; TTFT < whole request
            post = rows[("POST", "/v1/chat/completions" if name == "chat" else "/v1/completions")]
            assert 15 <= float(r["Average Response Time"]) <= float(post["Average Response Time"])


def test_locust_counts_failures(tmp_path):
    with MockServer(mode="faulty") as srv:
        proc, rows = _run_locust(srv.base_url, tmp_path / "bad", [])
        faults = dict(srv.state.faults)
    assert faults == {"ok": 4, "http500": 4, "drop": 4, "malformed": 4, "nodone": 4}
    assert proc.returncode == 1  # locust exits 1 when requests failed
    assert _count(rows, "POST") == 20 and _count(rows, "POST", "Failure Count") == 16
    assert _count(rows, "TTFT") == 4  # only the complete streams report latency entries
    with open(f"{tmp_path / 'bad'}_failures.csv", newline="") as f:
        errors = " ".join(r["Error"] for r in csv.DictReader(f))
    for what in ("HTTP 500", "malformed event", "without [DONE]", "ChunkedEncodingError"):
        assert what in errors


def test_locust_non_streaming_options_from_env(tmp_path):
    with MockServer(mode="ok") as srv:
        proc, rows = _run_locust(srv.base_url, tmp_path / "plain", [],
                                 env={"LOCUST_STREAM": "off", "LOCUST_ENDPOINT_MIX": "completions:1",
                                      "LOCUST_MODEL": "mock-model"})
        usage = list(srv.state.usage)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert _count(rows, "POST") == 20 and _count(rows, "POST", "Failure Count") == 0
    assert {name for (t, name) in rows if t == "POST"} == {"/v1/completions"}
    assert _count(rows, "TTFT") == 0
    assert usage == [(20, 10)] * 20
