"""bench.py and locust against ONE real `pagedserve serve` process on 127.0.0.1 (the tiny random
Llama of tests/e2e with the default model's tokenizer): zero failures, sane figures, counts that
match what was asked and what the server's /metrics counted.

locust runs as a subprocess: importing it here would monkey-patch this process with gevent.
"""
from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagedserve.loadtest.bench import BenchConfig, run_benchmark
from tests.e2e.test_server_e2e import ServerProcess

pytestmark = pytest.mark.timeout(180)

ROOT = Path(__file__).resolve().parents[2]
LOCUST = str(Path(sys.executable).with_name("locust"))
INPUT_LEN, OUTPUT_LEN = 32, 16


@pytest.fixture(scope="module")
def server():
    s = ServerProcess()
    yield s
    assert s.stop() == 0, s.output()[-3000:]


def counters(url: str) -> dict[str, float]:
    """Every sample of /metrics, keyed by name (+ labels other than model_name)."""
    out: dict[str, float] = {}
    text = httpx.get(url + "/metrics", timeout=10).text
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = "".join(f"|{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[s.name + labels] = s.value
    return out


def test_bench_random_workload(server, tmp_path):
    json_path, png_path = tmp_path / "run.json", tmp_path / "run.png"
    before = counters(server.url)
    n = 12
    result = run_benchmark(BenchConfig(
        base_url=server.url, num_prompts=n, max_concurrency=4, dataset_name="random",
        random_input_len=INPUT_LEN, random_output_len=OUTPUT_LEN, ignore_eos=True, seed=3,
        disable_tqdm=True, result_filename=str(json_path), plot=str(png_path),
    ))
    after = counters(server.url)
    m = result["metrics"]

    assert result["tokenizer"].startswith("server:") and not result["approximate_prompt_lengths"]
    assert result["config"]["model"] == "tiny"  # discovered from /v1/models
    assert m["failed"] == 0 and m["completed"] == n and m["errors"] == {}, m["errors"]
    assert m["requests_without_usage"] == 0
    reqs = result["requests"]
    assert len(reqs) == n
    for r in reqs:
        assert r["success"] and r["error"] == ""
        assert 0 < r["ttft_s"] <= r["e2e_s"]
        assert r["completion_tokens"] == OUTPUT_LEN  # ignore_eos: exactly max_tokens, from usage
        assert abs(r["intended_prompt_len"] - INPUT_LEN) <= 1  # workload built to the length
        assert abs(r["prompt_tokens"] - r["intended_prompt_len"]) <= 1  # server saw that length
        assert len(r["itl_s"]) >= 1 and all(x >= 0 for x in r["itl_s"])
    assert m["total_output_tokens"] == n * OUTPUT_LEN
    assert abs(m["total_input_tokens"] - n * INPUT_LEN) <= n
    assert m["total_input_tokens"] == sum(r["prompt_tokens"] for r in reqs)
    assert 0 < m["median_ttft_ms"] <= m["median_e2el_ms"] and m["mean_ttft_ms"] <= m["mean_e2el_ms"]
    assert m["p99_e2el_ms"] >= m["p90_e2el_ms"] >= m["median_e2el_ms"]
    assert m["output_throughput"] == pytest.approx(n * OUTPUT_LEN / m["duration_s"])

    # the server counted the same tokens as the usage the benchmark read
    gen = "pagedserve:generation_tokens_total"
    prompt = "pagedserve:prompt_tokens_total"
    assert after[gen] - before.get(gen, 0) == n * OUTPUT_LEN
    assert after[prompt] - before.get(prompt, 0) == m["total_input_tokens"]
    ok = "pagedserve:request_success_total|finished_reason=length"
    assert after[ok] - before.get(ok, 0) == n

    saved = json.loads(json_path.read_text())
    assert result["result_file"] == str(json_path)
    assert saved["metrics"]["completed"] == n and saved["metrics"]["total_output_tokens"] == n * OUTPUT_LEN
    assert saved["config"]["max_concurrency"] == 4 and saved["config"]["random_input_len"] == INPUT_LEN
    assert len(saved["requests"]) == n
    png = png_path.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_bench_prefix_workload_hits_prefix_cache(server):
    key_hits, key_queries = "pagedserve:prefix_cache_hits_total", "pagedserve:prefix_cache_queries_total"
    before = counters(server.url)
    n, conc, prefix_len = 8, 2, 96
    result = run_benchmark(BenchConfig(
        base_url=server.url, num_prompts=n, max_concurrency=conc, dataset_name="prefix",
        prefix_len=prefix_len, random_input_len=16, random_output_len=4, ignore_eos=True,
        seed=5, disable_tqdm=True,
    ))
    after = counters(server.url)
    m = result["metrics"]
    assert m["failed"] == 0 and m["completed"] == n, m["errors"]
    assert all(r["completion_tokens"] == 4 for r in result["requests"])

    hits = after[key_hits] - before[key_hits]
    queries = after[key_queries] - before[key_queries]
    assert 0 < hits <= queries
    # Every request after the first `conc` starts once an earlier one has computed the shared
    # prefix; each then finds at least the full 16-token blocks of the prefix but one.
    block = 16
    assert hits >= (n - conc) * (prefix_len // block - 1) * block, (hits, queries)


def _locust(url: str, csv_prefix: Path, n: int) -> subprocess.CompletedProcess:
    cmd = [LOCUST, "-f", str(ROOT / "pagedserve" / "loadtest" / "locustfile.py"), "--headless", "-H", url,
           "-u", "4", "-r", "4", "-t", "40s", "--max-requests", str(n),
           "--prompt-len", str(INPUT_LEN), "--output-len", str(OUTPUT_LEN), "--ignore-eos",
           "--endpoint-mix", "chat:1,completions:1", "--csv", str(csv_prefix),
           "--only-summary", "--loglevel", "WARNING"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_locust_headless(server, tmp_path):
    n = 12
    before = counters(server.url)
    proc = _locust(server.url, tmp_path / "loc", n)
    after = counters(server.url)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(f"{tmp_path / 'loc'}_stats.csv", newline="") as f:
        rows = {(r["Type"], r["Name"]): r for r in csv.DictReader(f)}

    def total(type_: str, col: str = "Request Count") -> int:
        return sum(int(r[col]) for (t, _), r in rows.items() if t == type_)

    assert total("POST") == n and total("POST", "Failure Count") == 0
    assert int(rows[("", "Aggregated")]["Failure Count"]) == 0
    assert {name for (t, name) in rows if t == "POST"} <= {"/v1/chat/completions", "/v1/completions"}
    assert total("TTFT") == n and total("TPOT") == n
    assert total("ITL") >= n  # several content events per stream
    for (t, name), r in rows.items():
        if t == "TTFT":
            post = rows[("POST", "/v1/chat/completions" if name == "chat" else "/v1/completions")]
            assert 0 < float(r["Average Response Time"]) <= float(post["Average Response Time"])
            assert int(r["Request Count"]) == int(post["Request Count"])

    # what locust counted is what the server served, each to exactly max_tokens
    ok = "pagedserve:request_success_total|finished_reason=length"
    assert after[ok] - before.get(ok, 0) == n
    gen = "pagedserve:generation_tokens_total"
    assert after[gen] - before.get(gen, 0) == n * OUTPUT_LEN
