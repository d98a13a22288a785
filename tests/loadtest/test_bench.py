"""bench.py against the mock OpenAI server on 127.0.0.1: figures, files, failures, CLI."""
from __future__ import annotations

import json
import math

import pytest

from pagedserve.app.cli import main as cli_main
from pagedserve.loadtest.bench import BenchConfig, RequestResult, compute_metrics, format_table, run_benchmark
from tests.loadtest.mock_server import MODEL, MockServer

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def server():
    with MockServer(mode="ok") as srv:
        yield srv


def _check_sane(result: dict) -> None:
    for r in result["requests"]:
        if r["success"]:
            assert 0 < r["ttft_s"] <= r["e2e_s"]
            assert all(x >= 0 for x in r["itl_s"])
    m = result["metrics"]
    assert m["mean_ttft_ms"] <= m["mean_e2el_ms"]
    assert m["p99_ttft_ms"] >= m["median_ttft_ms"] > 0
    assert m["p99_e2el_ms"] >= m["p90_e2el_ms"] >= m["median_e2el_ms"] > 0


def test_random_completions_figures_json_and_plot(server, tmp_path):
    before = len(server.state.usage)
    json_path, png_path = tmp_path / "run.json", tmp_path / "run.png"
    cfg = BenchConfig(
        base_url=server.base_url, num_prompts=16, max_concurrency=4, random_input_len=24,
        random_output_len=12, random_range_ratio=0.3, seed=7, disable_tqdm=True,
        result_filename=str(json_path), plot=str(png_path), goodput={"ttft": 60_000, "tpot": 60_000},
    )
    result = run_benchmark(cfg)
    m = result["metrics"]
    assert (m["completed"], m["failed"], m["num_prompts"]) == (16, 0, 16)
    assert result["config"]["model"] == MODEL  # discovered from /v1/models
    assert result["tokenizer"].startswith("server:")
    _check_sane(result)

    # Counts equal what the server put in its usage, request by request and in total.
    usage = server.state.usage[before:]
    assert len(usage) == 16
    assert m["total_input_tokens"] == sum(p for p, _ in usage)
    assert m["total_output_tokens"] == sum(c for _, c in usage)
    lengths = set()
    for r in result["requests"]:
        assert r["prompt_tokens"] == r["intended_prompt_len"]  # the workload hit the server's tokenizer count
        assert r["completion_tokens"] == r["output_len"]
        assert len(r["itl_s"]) + 1 < r["completion_tokens"]  # mock packs 1-2 tokens per event
        lengths.add(r["intended_prompt_len"])
        assert 24 * 0.7 - 1 <= r["intended_prompt_len"] <= 24 * 1.3 + 1
    assert len(lengths) > 1  # range ratio spreads the lengths
    assert m["request_throughput"] == pytest.approx(16 / m["duration_s"])
    assert m["output_throughput"] == pytest.approx(m["total_output_tokens"] / m["duration_s"])
    assert m["total_token_throughput"] > m["output_throughput"]
    # TTFT includes the mock's 20 ms first-token delay; TPOT is below its 2 ms per event
    assert m["median_ttft_ms"] >= 19
    assert 0 < m["mean_tpot_ms"] < m["mean_e2el_ms"]
    assert m["good_requests"] == 16 and m["request_goodput"] == pytest.approx(m["request_throughput"])
    assert sum(result["timeseries"]["requests_per_s"]) * result["timeseries"]["bin_s"] == pytest.approx(16)

    saved = json.loads(json_path.read_text())
    assert saved["config"]["num_prompts"] == 16 and saved["config"]["request_rate"] is None
    assert saved["metrics"]["total_output_tokens"] == m["total_output_tokens"]
    assert len(saved["requests"]) == 16
    png = png_path.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000

    table = format_table(result)
    assert "Successful requests" in table and "Mean TTFT (ms)" in table and "P99 E2EL (ms)" in table


def test_chat_prefix_workload_with_poisson_rate(server):
    before = len(server.state.usage)
    result = run_benchmark(dict(
        base_url=server.base_url, endpoint="/v1/chat/completions", dataset_name="prefix", prefix_len=40,
        random_input_len=8, random_output_len=6, num_prompts=10, request_rate=100.0, seed=1,
        disable_tqdm=True, goodput={"ttft": 0.001},
    ))
    m = result["metrics"]
    assert (m["completed"], m["failed"]) == (10, 0)
    _check_sane(result)
    usage = server.state.usage[before:]
    assert m["total_input_tokens"] == sum(p for p, _ in usage)
    assert m["total_output_tokens"] == 10 * 6
    for r in result["requests"]:
        assert r["prompt_tokens"] == r["intended_prompt_len"] == 40 + 8  # the mock has no token for "\n"
    starts = sorted(r["start_s"] for r in result["requests"])
    assert starts[-1] > 0.01  # arrivals were spread out, not all at t=0
    assert m["good_requests"] == 0 and m["request_goodput"] == 0.0  # a 1 us TTFT SLO nobody meets


def test_failures_are_counted_and_the_run_reports(tmp_path):
    with MockServer(mode="faulty") as srv:
        result = run_benchmark(dict(
            base_url=srv.base_url, num_prompts=20, max_concurrency=5, random_input_len=16,
            random_output_len=10, disable_tqdm=True, result_filename=str(tmp_path / "f.json"),
            plot=str(tmp_path / "f.png"),
        ))
        faults = dict(srv.state.faults)
    m = result["metrics"]
    assert faults == {"ok": 4, "http500": 4, "drop": 4, "malformed": 4, "nodone": 4}
    assert (m["completed"], m["failed"]) == (4, 16)
    errs = [r["error"] for r in result["requests"] if not r["success"]]
    assert sum(e.startswith("HTTP 500") for e in errs) == 4
    assert sum(e.startswith("malformed event") for e in errs) == 4
    assert sum("[DONE]" in e for e in errs) == 4
    assert sum("RemoteProtocolError" in e or "ReadError" in e for e in errs) == 4
    assert m["total_output_tokens"] == 4 * 10  # only completed requests count
    _check_sane(result)
    assert "Failed requests" in format_table(result) and "HTTP 500 x4" in format_table(result)
    assert json.loads((tmp_path / "f.json").read_text())["metrics"]["failed"] == 16
    assert (tmp_path / "f.png").stat().st_size > 10_000


def test_without_tokenize_endpoint_falls_back_and_says_so():
    with MockServer(mode="ok", tokenize=False) as srv:
        result = run_benchmark(dict(base_url=srv.base_url, num_prompts=4, random_input_len=10,
                                    random_output_len=4, disable_tqdm=True))
    assert result["metrics"]["completed"] == 4
    assert result["approximate_prompt_lengths"] is True
    assert "approximate" in format_table(result)
    # the word-based fallback is exact for the word-level mock tokenizer
    assert all(r["prompt_tokens"] == 10 for r in result["requests"])


def test_cli_bench_serve_and_compare(server, tmp_path, capsys):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    common = ["bench", "serve", "--base-url", server.base_url + "/v1", "--random-input-len", "12",
              "--random-output-len", "8", "--ignore-eos", "--disable-tqdm", "--save-result"]
    assert cli_main(common + ["--num-prompts", "4", "--max-concurrency", "1", "--result-filename", str(a)]) == 0
    out = capsys.readouterr().out
    assert "Serving Benchmark Result" in out and f"result saved to {a}" in out
    assert cli_main(common + ["--num-prompts", "8", "--max-concurrency", "4", "--result-filename", str(b),
                              "--endpoint", "/v1/chat/completions", "--goodput", "ttft:5000"]) == 0
    rb = json.loads(b.read_text())
    assert rb["config"]["ignore_eos"] is True and rb["config"]["endpoint"] == "/v1/chat/completions"
    assert rb["metrics"]["good_requests"] == 8
    capsys.readouterr()

    assert cli_main(["bench", "serve", "--compare", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    ra = json.loads(a.read_text())
    line = next(ln for ln in out.splitlines() if ln.startswith("Total generated tokens"))
    assert line.split() == ["Total", "generated", "tokens", "32", "64", "2.00x"]
    assert ra["metrics"]["total_output_tokens"] == 32
    assert "ratio" in out and "Mean TTFT (ms)" in out


def test_compare_reads_vllm_flat_results_and_rejects_bad_files(tmp_path, capsys):
    ours = {"config": {"model": "m"}, "metrics": {"completed": 8, "failed": 0, "total_output_tokens": 128,
                                                   "duration_s": 2.0, "mean_ttft_ms": 100.0}}
    # `vllm bench serve --save-result` writes its figures at the top level, duration in seconds
    vllm = {"backend": "vllm", "model_id": "m", "num_prompts": 10, "completed": 8, "duration": 4.0,
            "total_output_tokens": 128, "mean_ttft_ms": 50.0, "ttfts": [0.05] * 8, "errors": [""] * 8}
    a, b = tmp_path / "ours.json", tmp_path / "vllm.json"
    a.write_text(json.dumps(ours))
    b.write_text(json.dumps(vllm))
    assert cli_main(["bench", "serve", "--compare", str(a), str(b)]) == 0
    lines = {ln.rsplit(None, 3)[0]: ln.split()[-3:] for ln in capsys.readouterr().out.splitlines()
             if ln[:1].isupper() and len(ln.split()) > 3}
    assert lines["Benchmark duration (s)"] == ["2.00", "4.00", "2.00x"]
    assert lines["Mean TTFT (ms)"] == ["100.00", "50.00", "0.50x"]
    assert lines["Failed requests"][:2] == ["0", "2"]

    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    assert cli_main(["bench", "serve", "--compare", str(a), str(bad)]) == 2
    assert cli_main(["bench", "serve", "--compare", str(a), str(tmp_path / "missing.json")]) == 2
    err = capsys.readouterr().err
    assert "bad.json: not a saved benchmark result" in err and "missing.json" in err


def test_unreachable_server_is_a_clear_error(capsys):
    from tests.loadtest.mock_server import free_port

    rc = cli_main(["bench", "serve", "--base-url", f"http://127.0.0.1:{free_port()}", "--num-prompts", "2",
                   "--disable-tqdm"])
    assert rc == 1
    assert "could not run the benchmark" in capsys.readouterr().err


def test_compute_metrics_by_hand():
    def ok(ttft, e2e, n, itl):
        return RequestResult(success=True, ttft=ttft, e2e=e2e, completion_tokens=n, prompt_tokens=10, itl=itl)

    results = [ok(0.1, 1.1, 11, [0.1] * 10), ok(0.3, 0.7, 5, [0.1] * 4), RequestResult(error="HTTP 500: x")]
    m = compute_metrics(results, 2.0, {"ttft": 200})
    assert (m["completed"], m["failed"], m["errors"]) == (2, 1, {"HTTP 500": 1})
    assert m["total_output_tokens"] == 16 and m["total_input_tokens"] == 20
    assert m["output_throughput"] == 8.0 and m["request_throughput"] == 1.0
    assert m["mean_ttft_ms"] == pytest.approx(200) and m["median_ttft_ms"] == pytest.approx(200)
    assert m["p90_ttft_ms"] == pytest.approx(280) and m["p99_ttft_ms"] == pytest.approx(298)
    assert m["mean_tpot_ms"] == pytest.approx(100)  # (1.0/10 and 0.4/4) s per token
    assert m["median_itl_ms"] == pytest.approx(100) and math.isclose(m["std_itl_ms"], 0, abs_tol=1e-9)
    assert m["good_requests"] == 1 and m["request_goodput"] == 0.5


def test_against_pagedserve_app_with_fake_engine():
    """Our own HTTP layer (app.server) over the app tests' fake engine: SSE format, usage,
    /tokenize, auth all understood by bench.py."""
    from pagedserve.app.server import build_app
    from tests.app.fake_engine import FakeAsyncEngine
    from tests.loadtest.mock_server import AppServer

    app = build_app(FakeAsyncEngine(max_model_len=512), served_model_name="fake-model", api_key="sekrit")
    with AppServer(app) as srv:
        for endpoint in ("/v1/completions", "/v1/chat/completions"):
            result = run_benchmark(dict(base_url=srv.base_url, endpoint=endpoint, api_key="sekrit",
                                        num_prompts=6, max_concurrency=3, random_input_len=40,
                                        random_output_len=8, ignore_eos=True, disable_tqdm=True))
            m = result["metrics"]
            assert (m["completed"], m["failed"]) == (6, 0), m["errors"]
            assert result["config"]["model"] == "fake-model"
            assert result["tokenizer"].startswith("server:")
            _check_sane(result)
            assert m["total_output_tokens"] == 6 * 8
            if endpoint == "/v1/completions":  # byte tokens: the prompt is exactly 40 of them
                assert all(r["prompt_tokens"] == r["intended_prompt_len"] == 40 for r in result["requests"])
        denied = run_benchmark(dict(base_url=srv.base_url, model="fake-model", num_prompts=2,
                                    random_input_len=4, random_output_len=2, disable_tqdm=True))
        assert denied["metrics"]["failed"] == 2 and "HTTP 401" in denied["metrics"]["errors"]
