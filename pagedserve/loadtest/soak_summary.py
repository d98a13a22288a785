"""The verdict of a soak: the JSON summary of what the clients saw and what the server reported,
and the checks (no 5xx, right answers, no leak) that decide pass or fail.
"""
from __future__ import annotations

from collections import Counter

from pagedserve.loadtest import proctree
from pagedserve.loadtest.soak_config import SoakConfig
from pagedserve.loadtest.soak_mix import HOSTILE_KINDS, Outcome


def _growth_pct(before: int, after: int) -> float | None:
    return round(100.0 * (after - before) / before, 2) if before else None


def summarize(cfg: SoakConfig, model: str, warm_outcomes: list[Outcome], outcomes: list[Outcome],
              warm_gauges: dict, end_gauges: dict, warm: proctree.TreeSnapshot | None,
              end: proctree.TreeSnapshot | None, *, warmup_s: float, run_s: float,
              server_counted: dict | None = None, loop_lag: dict | None = None) -> dict:
    every = warm_outcomes + outcomes
    statuses = Counter(str(o.status) if o.status is not None else "no_response" for o in every)
    kinds: dict[str, Counter] = {}
    for o in every:
        kinds.setdefault(o.kind, Counter())["ok" if o.ok else "failed"] += 1
    bad = [o for o in every if o.kind == "bad_input"]
    failures = [o for o in every if not o.ok]
    five_xx = sum(1 for o in every if o.status is not None and o.status >= 500)
    server: dict = {"pid": end.processes[0].pid if end and end.processes else None}
    if warm and end:
        server.update(
            warm=warm.as_dict(), end=end.as_dict(),
            rss_growth_pct=_growth_pct(warm.rss_kib, end.rss_kib), fd_delta=end.fds - warm.fds,
            # what a leak per finished sequence shows as, whatever the run's length (issue 35: 0.37 MiB)
            finished_sequences=sum(o.sequences for o in outcomes),
            rss_growth_kib_per_sequence=round((end.rss_kib - warm.rss_kib) / max(1, sum(o.sequences for o in outcomes)), 2))
    checks = {
        "zero_5xx": five_xx == 0,
        "every_request_answered_right": not failures,
        "bad_input_got_its_4xx": all(o.ok for o in bad),
        "idle_at_end": end_gauges.get("num_requests_running") == 0
        and end_gauges.get("num_requests_waiting") == 0,
        "kv_usage_back_to_0": end_gauges.get("kv_cache_usage_perc") == 0,
    }
    hostile = [o for o in every if o.kind == "hostile"]
    hostile_by: dict[str, Counter] = {}
    hostile_sizes: dict[str, int] = {}  # the largest of each kind sent
    for o in hostile:
        kind = o.extra.get("hostile", "?")
        hostile_by.setdefault(kind, Counter())[str(o.status) if o.status is not None else "no_response"] += 1
        hostile_sizes[kind] = max(hostile_sizes.get(kind, 0), o.extra.get("hostile_size", 0))
    if hostile:
        checks["hostile_no_5xx"] = not any(o.status is not None and o.status >= 500 for o in hostile)
    worst_lag = None
    if loop_lag:
        known = [v for v in (loop_lag.get("max_polled_s"), loop_lag.get("max_since_server_start_s"))
                 if v is not None]
        worst_lag = max(known) if known else None
        if worst_lag is not None:
            checks["loop_lag_under_limit"] = worst_lag < cfg.max_loop_lag_s
    if warm and end:
        checks["rss_growth_under_limit"] = server["rss_growth_pct"] is not None and \
            server["rss_growth_pct"] < cfg.max_rss_growth_pct
        checks["fds_flat"] = abs(server["fd_delta"]) <= cfg.fd_tolerance
    if server_counted and "http_error_responses_total" in server_counted:
        # the server's /metrics saw the same failures as the clients (issue 10 fault 9); meaningful
        # only when this run is the server's only traffic
        client_4xx = {k: float(v) for k, v in statuses.items() if k.isdigit() and int(k) >= 400}
        checks["metrics_count_the_same_errors"] = \
            server_counted.get("http_error_responses_total", {}) == client_4xx
        checks["metrics_count_no_server_failure"] = not server_counted.get("request_errors_total")
        checks["metrics_count_every_abort"] = \
            server_counted.get("request_success_total", {}).get("abort", 0.0) == \
            sum(1 for o in every if o.aborted)
    latencies = sorted(o.latency_s for o in every
                       if o.ok and not o.aborted and o.kind not in ("bad_input", "hostile"))
    return {
        "model": model,
        "base_url": cfg.base_url,
        "requests": len(outcomes),
        "warmup_requests": len(warm_outcomes),
        "concurrency": cfg.concurrency,
        "warmup_s": round(warmup_s, 2),
        "run_s": round(run_s, 2),
        "requests_per_s": round(len(outcomes) / run_s, 2) if run_s else None,
        "latency_s": {"p50": _pct(latencies, 50), "p99": _pct(latencies, 99), "max": _pct(latencies, 100)},
        "status_counts": dict(sorted(statuses.items())),
        "by_kind": {k: dict(v) for k, v in sorted(kinds.items())},
        "aborted_mid_stream": sum(1 for o in every if o.aborted),
        "bad_input": {"sent": len(bad), "got_expected_4xx": sum(1 for o in bad if o.ok)},
        "hostile": {"sent": len(hostile),
                    "five_xx": sum(1 for o in hostile if o.status is not None and o.status >= 500),
                    "latency_max_s": round(max((o.latency_s for o in hostile), default=0.0), 3),
                    "by_kind": {k: dict(v) for k, v in sorted(hostile_by.items())},
                    # kind -> the largest sent, and the kinds that never came up (a short run)
                    "size_by_kind": dict(sorted(hostile_sizes.items())),
                    "kinds_not_sent": [k for k in HOSTILE_KINDS if k not in hostile_by]},
        "five_xx": five_xx,
        "loop_lag_s": {**(loop_lag or {}), "worst": worst_lag},
        "failures": len(failures),
        "first_failures": [{"index": o.index, "kind": o.kind, "status": o.status, "error": o.error}
                           for o in sorted(failures, key=lambda o: o.index)[:20]],
        "server_counted": server_counted,
        "metrics_after_warmup": warm_gauges,
        "metrics_at_end": end_gauges,
        "server": server,
        "limits": {"max_rss_growth_pct": cfg.max_rss_growth_pct, "fd_tolerance": cfg.fd_tolerance,
                   "max_loop_lag_s": cfg.max_loop_lag_s},
        "checks": checks,
        "passed": all(checks.values()),
    }


def _pct(xs: list[float], p: float) -> float | None:
    if not xs:
        return None
    return round(xs[min(len(xs) - 1, int(len(xs) * p / 100))], 4)
