"""The figures of a `bench serve` run (percentiles, throughput, goodput, the throughput time
series), computed from its RequestResults: pure functions, no server needed.
"""
from __future__ import annotations

import math

from pagedserve.loadtest.bench_config import RequestResult


def _percentile(sorted_xs: list[float], p: float) -> float:
    """Linear-interpolated percentile (numpy's default) of a sorted list."""
    if not sorted_xs:
        return 0.0
    k = (len(sorted_xs) - 1) * p / 100.0
    lo = math.floor(k)
    hi = min(lo + 1, len(sorted_xs) - 1)
    return sorted_xs[lo] + (sorted_xs[hi] - sorted_xs[lo]) * (k - lo)


def _stats(name: str, values_s: list[float], out: dict) -> None:
    xs = sorted(v * 1000.0 for v in values_s)
    n = len(xs)
    mean = sum(xs) / n if n else 0.0
    out[f"mean_{name}_ms"] = mean
    out[f"median_{name}_ms"] = _percentile(xs, 50)
    out[f"std_{name}_ms"] = math.sqrt(sum((x - mean) ** 2 for x in xs) / n) if n else 0.0
    out[f"p90_{name}_ms"] = _percentile(xs, 90)
    out[f"p99_{name}_ms"] = _percentile(xs, 99)
    out[f"max_{name}_ms"] = xs[-1] if xs else 0.0


def _tpot(r: RequestResult) -> float | None:
    if r.completion_tokens and r.completion_tokens > 1:
        return (r.e2e - r.ttft) / (r.completion_tokens - 1)
    return None


def compute_metrics(results: list[RequestResult], duration: float, goodput: dict[str, float] | None = None) -> dict:
    ok = [r for r in results if r.success]
    failed = [r for r in results if not r.success]
    in_tok = sum(r.prompt_tokens or 0 for r in ok)
    out_tok = sum(r.completion_tokens or 0 for r in ok)
    tpots = [t for t in (_tpot(r) for r in ok) if t is not None]
    errors: dict[str, int] = {}
    for r in failed:
        key = r.error.split(":", 1)[0] if r.error.startswith(("HTTP ", "malformed")) else r.error[:80]
        errors[key] = errors.get(key, 0) + 1
    m: dict = {
        "num_prompts": len(results),
        "completed": len(ok),
        "failed": len(failed),
        "errors": errors,
        "requests_without_usage": sum(1 for r in ok if r.completion_tokens is None),
        "duration_s": duration,
        "total_input_tokens": in_tok,
        "total_output_tokens": out_tok,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_throughput": out_tok / duration if duration > 0 else 0.0,
        "total_token_throughput": (in_tok + out_tok) / duration if duration > 0 else 0.0,
    }
    _stats("ttft", [r.ttft for r in ok], m)
    _stats("tpot", tpots, m)
    _stats("itl", [x for r in ok for x in r.itl], m)
    _stats("e2el", [r.e2e for r in ok], m)
    if goodput:
        good = 0
        for r in ok:
            t = _tpot(r) or 0.0
            if "ttft" in goodput and r.ttft * 1000 > goodput["ttft"]:
                continue
            if "tpot" in goodput and t * 1000 > goodput["tpot"]:
                continue
            if "e2el" in goodput and r.e2e * 1000 > goodput["e2el"]:
                continue
            good += 1
        m["goodput_slo_ms"] = dict(goodput)
        m["good_requests"] = good
        m["request_goodput"] = good / duration if duration > 0 else 0.0
    return m


def throughput_timeseries(results: list[RequestResult], duration: float, bins: int = 50) -> dict:
    """Output tokens/s and finished requests/s per time bin. A request's usage count is
    spread over the times its text chunks arrived (the count itself comes from usage)."""
    width = max(duration / bins, 1e-3) if duration > 0 else 1.0
    nbins = max(1, math.ceil(duration / width)) if duration > 0 else 1
    tokens = [0.0] * nbins
    finished = [0] * nbins
    for r in results:
        if not r.success:
            continue
        end_bin = min(int((r.start + r.e2e) / width), nbins - 1)
        finished[end_bin] += 1
        if r.completion_tokens and r.chunk_times:
            share = r.completion_tokens / len(r.chunk_times)
            for t in r.chunk_times:
                tokens[min(int(t / width), nbins - 1)] += share
    return {
        "bin_s": width,
        "t_s": [i * width for i in range(nbins)],
        "output_tokens_per_s": [x / width for x in tokens],
        "requests_per_s": [x / width for x in finished],
    }
