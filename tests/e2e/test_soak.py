"""A bounded soak (`pagedserve bench soak`, loadtest/soak.py) against a real tiny-model server:
a few hundred mixed requests at concurrency 16, then zero 5xx, every bad request answered with
its 4xx, KV usage 0 and nothing running, fds flat and RSS growth bounded across the whole server
process tree. The long version (5,000 requests) is the same code run from the command line."""
from __future__ import annotations

import json

import pytest

from pagedserve.loadtest.local_server import LocalServer, tiny_args
from pagedserve.loadtest.soak import SoakConfig, run_soak, summarize
from pagedserve.loadtest.soak_mix import MIX, Outcome, plan

# A short run has a short warm-up, so allocator and cache growth after it is still visible; the
# long run is held to the 5 %.
SHORT_RUN_RSS_GROWTH_PCT = 10.0


@pytest.mark.slow
def test_bounded_soak_leaves_nothing_behind():
    s = LocalServer([*tiny_args(), "--served-model-name", "tiny"])
    try:
        summary = run_soak(SoakConfig(base_url=s.url, requests=300, warmup=60, concurrency=16,
                                      server_pid=s.pid, max_rss_growth_pct=SHORT_RUN_RSS_GROWTH_PCT,
                                      fd_tolerance=4, request_timeout=60, max_tokens=12))
    finally:
        code = s.stop()
    report = json.dumps(summary, indent=1)[:6000]
    assert summary["requests"] == 300 and summary["warmup_requests"] == 60
    assert summary["five_xx"] == 0, report
    assert summary["failures"] == 0, report
    assert set(summary["by_kind"]) == set(MIX), report  # every kind of traffic was sent
    assert summary["bad_input"]["sent"] > 10
    assert summary["bad_input"]["got_expected_4xx"] == summary["bad_input"]["sent"], report
    assert summary["aborted_mid_stream"] > 10, report
    assert summary["metrics_at_end"] == {"kv_cache_usage_perc": 0.0, "num_requests_running": 0.0,
                                         "num_requests_waiting": 0.0}, report
    server = summary["server"]
    assert len(server["end"]["processes"]) >= 2, report  # the server and its worker(s) were measured
    assert abs(server["fd_delta"]) <= 4, report
    assert server["rss_growth_pct"] < SHORT_RUN_RSS_GROWTH_PCT, report
    assert summary["checks"]["metrics_count_the_same_errors"], report
    assert summary["checks"]["metrics_count_every_abort"], (
        summary["aborted_mid_stream"], summary["server_counted"])
    assert summary["passed"], report
    assert code == 0, s.output()[-3000:]
    assert s.leftover_segments() == []


def test_plans_are_replayable_and_bad_ones_expect_4xx():
    a = [plan(i, seed=3, model="m", max_model_len=64, max_tokens=8) for i in range(300)]
    b = [plan(i, seed=3, model="m", max_model_len=64, max_tokens=8) for i in range(300)]
    assert [(p.kind, p.body, p.raw) for p in a] == [(p.kind, p.body, p.raw) for p in b]
    assert {p.kind for p in a} == set(MIX)
    assert all(400 <= p.expect_status < 500 for p in a if p.kind == "bad_input")
    assert all(p.expect_status == 200 for p in a if p.kind != "bad_input")
    assert all(p.drop_after_events is not None and p.stream for p in a if p.kind == "abort_stream")
    # dropped streams ask for most of the context: the client must hang up long before their end
    # (400 tokens took the tiny model ~0.2 s, and CI saw one finish before the server saw the hang-up)
    from pagedserve.loadtest.soak_mix import abort_stream_tokens

    assert abort_stream_tokens(64) == 32 and abort_stream_tokens(2048) == 1792 and abort_stream_tokens(32768) == 4096
    assert all(p.body["max_tokens"] == 32 for p in a if p.kind == "abort_stream")


def test_summary_fails_on_a_5xx_a_leak_or_a_busy_engine():
    from pagedserve.loadtest.proctree import ProcessFigures, TreeSnapshot

    cfg = SoakConfig(base_url="http://x", max_rss_growth_pct=5, fd_tolerance=2)
    idle = {"kv_cache_usage_perc": 0.0, "num_requests_running": 0.0, "num_requests_waiting": 0.0}
    warm = TreeSnapshot([ProcessFigures(1, "server", 1000, 20)])
    good = [Outcome(0, "chat", 200, ok=True), Outcome(1, "bad_input", 400, ok=True)]

    def run(outcomes, end_gauges=idle, end=warm):
        return summarize(cfg, "m", [], outcomes, idle, end_gauges, warm, end, warmup_s=1, run_s=1)

    assert run(good)["passed"]
    s = run([*good, Outcome(2, "chat", 500, ok=False, error="boom")])
    assert not s["passed"] and s["five_xx"] == 1 and not s["checks"]["zero_5xx"]
    assert not run(good, end=TreeSnapshot([ProcessFigures(1, "server", 1100, 20)]))["passed"]
    assert not run(good, end=TreeSnapshot([ProcessFigures(1, "server", 1000, 30)]))["passed"]
    assert not run(good, end_gauges={**idle, "kv_cache_usage_perc": 0.01})["passed"]
    assert not run(good, end_gauges={**idle, "num_requests_running": 1.0})["passed"]


def test_summary_compares_the_servers_failure_counters_with_the_clients():
    cfg = SoakConfig(base_url="http://x")
    idle = {"kv_cache_usage_perc": 0.0, "num_requests_running": 0.0, "num_requests_waiting": 0.0}
    seen = [Outcome(0, "bad_input", 400, ok=True), Outcome(1, "abort_stream", 200, ok=True, aborted=True)]

    def run(counted):
        return summarize(cfg, "m", [], seen, idle, idle, None, None, warmup_s=1, run_s=1,
                         server_counted=counted)

    same = {"http_error_responses_total": {"400": 1.0}, "request_errors_total": {},
            "request_success_total": {"abort": 1.0, "length": 3.0}}
    assert run(same)["passed"]
    assert not run({**same, "http_error_responses_total": {}})["passed"]  # a 4xx not counted
    assert not run({**same, "request_errors_total": {"internal_error": 1.0}})["passed"]
    assert not run({**same, "request_success_total": {"length": 3.0}})["passed"]  # abort not counted


def test_hostile_plans_cover_every_kind_and_accept_only_200_400_413():
    from pagedserve.loadtest.soak_mix import HOSTILE_KINDS, HOSTILE_OK

    hostile = [p for i in range(1500)
               if (p := plan(i, seed=1, model="m", max_model_len=64, max_tokens=8, hostile_scale=0.01)).kind
               == "hostile"]
    assert {p.note for p in hostile} == set(HOSTILE_KINDS)
    assert all(p.accept_status == HOSTILE_OK for p in hostile)
    small = next(p for p in hostile if p.note == "huge_stop")
    big = plan(small.index, seed=1, model="m", max_model_len=64, max_tokens=8)  # full size
    assert big.note == "huge_stop" and len(big.body["stop"]) == 40_000 and len(small.body["stop"]) == 400


def test_every_hostile_kind_comes_at_its_full_size():
    from pagedserve.loadtest.soak_mix import HOSTILE_FULL_SIZE, HOSTILE_KINDS

    full = {}
    for i in range(1500):
        p = plan(i, seed=0, model="m", max_model_len=64, max_tokens=8)
        if p.kind == "hostile":
            full.setdefault(p.note, p)
    assert set(full) == set(HOSTILE_KINDS) == set(HOSTILE_FULL_SIZE)
    measured = {"huge_stop": lambda b: len(b["stop"]), "big_bad_words": lambda b: len(b["bad_words"]),
                "big_logit_bias": lambda b: len(b["logit_bias"]), "fanout_n": lambda b: len(b["prompt"]),
                "big_tokenize": lambda b: len(b["prompt"]) // len("hello world "),
                "many_tool_messages": lambda b: sum(m["role"] == "tool" for m in b["messages"]),
                "template_kwargs_self": lambda b: 0,
                "huge_text_prompt": lambda b: len(b["prompt"]) // len("The quick brown fox. "),
                "long_stop_string": lambda b: len(b["stop"]), "many_long_stops": lambda b: len(b["stop"]),
                "long_bad_word": lambda b: len(b["bad_words"][0]),
                "long_tool_description": lambda b: len(b["tools"][0]["function"]["description"]),
                "request_template": lambda b: 0,
                "anthropic_huge_stop": lambda b: len(b["stop_sequences"]),
                "anthropic_many_tool_results": lambda b: len(b["messages"][-1]["content"]),
                "ollama_many_messages": lambda b: len(b["messages"])}
    for kind, p in full.items():
        assert p.size == HOSTILE_FULL_SIZE[kind] == measured[kind](p.body), kind
    assert len(full["huge_text_prompt"].body["prompt"]) > 4_000_000  # multi-MB


def test_summary_fails_on_a_hostile_5xx_or_a_loop_stall():
    cfg = SoakConfig(base_url="http://x", max_loop_lag_s=1.0)
    idle = {"kv_cache_usage_perc": 0.0, "num_requests_running": 0.0, "num_requests_waiting": 0.0}
    ok = [Outcome(0, "chat", 200, ok=True), Outcome(1, "hostile", 400, ok=True, extra={"hostile": "huge_stop"})]

    def run(outcomes, lag):
        return summarize(cfg, "m", [], outcomes, idle, idle, None, None, warmup_s=1, run_s=1,
                         loop_lag={"max_polled_s": lag, "max_since_server_start_s": lag})

    good = run(ok, 0.05)
    assert good["passed"] and good["hostile"]["by_kind"] == {"huge_stop": {"400": 1}}
    assert good["loop_lag_s"]["worst"] == 0.05
    stalled = run(ok, 17.0)
    assert not stalled["passed"] and not stalled["checks"]["loop_lag_under_limit"]
    five = run([*ok, Outcome(2, "hostile", 500, ok=False, extra={"hostile": "fanout_n"})], 0.05)
    assert not five["passed"] and not five["checks"]["hostile_no_5xx"] and five["hostile"]["five_xx"] == 1


def test_a_stream_that_ended_before_the_client_hung_up_is_not_an_abort():
    """A lagging client reads merged deltas: a few events can hold the whole stream. Hanging up
    after the final event is no abort (the server counted the request finished), so the soak
    must not count it as one (CI saw the abort check fail this way)."""
    import asyncio

    import httpx

    from pagedserve.loadtest.soak_mix import Planned
    from pagedserve.loadtest.soak_run import _send

    def sse(events: list[dict]) -> bytes:
        return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"

    def chunk(text: str, finish: str | None) -> dict:
        return {"choices": [{"index": 0, "text": text, "finish_reason": finish}]}

    async def outcome(events: list[dict]) -> Outcome:
        transport = httpx.MockTransport(lambda request: httpx.Response(
            200, content=sse(events), headers={"content-type": "text/event-stream"}))
        p = Planned(0, "abort_stream", "/v1/completions", {"prompt": "x"}, stream=True, drop_after_events=2)
        out = Outcome(index=0, kind=p.kind)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            await _send(client, p, out)
        return out

    merged = asyncio.run(outcome([chunk("a", None), chunk("b" * 400, "length")]))
    assert merged.ok and not merged.aborted
    cut = asyncio.run(outcome([chunk("a", None), chunk("b", None), chunk("c", "length")]))
    assert cut.ok and cut.aborted


def test_requests_take_turns_with_the_other_served_names():
    """`bench soak --also-model ADAPTER`: a LoRA adapter in the mix (issue 35's soak with --enable-lora)."""
    from pagedserve.loadtest.soak_run import model_for

    assert [model_for(i, "base", ()) for i in range(3)] == ["base"] * 3
    assert [model_for(i, "base", ("ad",)) for i in range(4)] == ["base", "ad", "base", "ad"]
