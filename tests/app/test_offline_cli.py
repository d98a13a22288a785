"""The offline subcommands end to end as a user runs them: generate, chat, bench throughput and
bench latency, on the tiny random model with the default model's tokenizer."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.tiny import TINY_CONFIG

ROOT = Path(__file__).resolve().parents[2]


def run_cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    from pagedserve.contracts.config import default_model_path

    engine = ["--model", default_model_path(), "--load-format", "dummy", "--hf-config", json.dumps(TINY_CONFIG),
              "--dtype", "float32", "--kv-cache-memory", "0.05"]
    cmd = [sys.executable, "-m", "pagedserve.app.cli", *args, *engine]
    return subprocess.run(cmd, cwd=ROOT, input=stdin, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_generate_streams_prompt_and_completion():
    r = run_cli("generate", "The capital of France is", "--max-tokens", "5", "--ignore-eos")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("The capital of France is")
    assert len(r.stdout.strip()) > len("The capital of France is")
    assert "[finish_reason: length]" in r.stderr


def test_chat_answers_each_line_until_empty_line():
    r = run_cli("chat", "--max-tokens", "4", "--ignore-eos", stdin="Hello\nAnd again\n\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("> ") == 3  # two answers, then the prompt that read the empty line


def test_bench_throughput_and_latency_json(tmp_path):
    workload = {"sampling": {"temperature": 0.6, "ignore_eos": True},
                "requests": [{"prompt_token_ids": list(range(100, 100 + n)), "max_tokens": m}
                             for n, m in [(5, 4), (17, 6), (40, 3), (9, 5)]]}
    path = tmp_path / "w.json"
    path.write_text(json.dumps(workload))
    r = run_cli("bench", "throughput", "--workload", str(path), "--json", "--busy-neighbours", "1")
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["busy_neighbours"] == 1 and result["threads"] >= 1
    assert result["omp_wait"] != "libgomp default"  # the CLI set a short spin (or the user chose one)
    assert result["requests"] == 4
    assert result["input_tokens"] == 5 + 17 + 40 + 9
    assert result["output_tokens"] == 4 + 6 + 3 + 5  # ignore_eos: exactly max_tokens each
    assert result["output_tokens_per_s"] > 0 and result["elapsed_s"] > 0
    for key in ("requests_per_s", "total_tokens_per_s"):
        assert result[key] > 0

    r = run_cli("bench", "latency", "--input-len", "16", "--output-len", "8", "--num-iters", "1", "--json")
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["prefill_s"] > 0 and result["decode_tokens_per_s"] > 0
