"""Soak: thousands of mixed requests against one server, then proof that nothing leaked.

    pagedserve bench soak --base-url http://127.0.0.1:8000 --requests 5000 --concurrency 16
    pagedserve bench soak --start-server tiny --requests 5000 --concurrency 16

The mix (loadtest/soak_mix.py) is chat and completions, streamed and not, n>1, logprobs, stop
strings, streams the client drops mid-way, malformed input and hostile requests (huge lists,
fan-out, multi-MB /tokenize: each may get 200/400/413, never a 5xx). While it runs, /metrics is
polled for ``pagedserve:event_loop_lag_seconds``: the worst event-loop stall is reported and
held to ``--max-loop-lag``. After a warm-up and again at the
end the run reads, with the server idle and no client connection open: RSS and open fds of the
whole server process tree (/proc), and from /metrics the KV usage and running/waiting requests.
It prints a JSON summary and exits 1 when a check fails (any 5xx, any wrong answer, a bad
request without its 4xx, RSS growth or fd growth past the limits, KV or requests left over).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
from collections import Counter
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx
from prometheus_client.parser import text_string_to_metric_families

from loadtest import proctree
from loadtest.soak_mix import HOSTILE_KINDS, MIX, Outcome, Planned, check_full, check_stream, plan
from loadtest.sse import SSEDecoder, StreamError

logger = logging.getLogger(__name__)

IDLE_GAUGES = ("kv_cache_usage_perc", "num_requests_running", "num_requests_waiting")
# sample name -> the label that splits it
FAILURE_COUNTERS = {
    "pagedserve:http_error_responses_total": "status_code",
    "pagedserve:request_errors_total": "reason",
    "pagedserve:request_success_total": "finished_reason",
}


@dataclass(slots=True)
class SoakConfig:
    base_url: str
    requests: int = 5000
    concurrency: int = 16
    warmup: int = 200
    seed: int = 0
    max_tokens: int = 24
    model: str | None = None
    max_model_len: int | None = None
    server_pid: int | None = None  # None: found from the port when the server is local
    request_timeout: float = 120.0
    idle_timeout: float = 60.0
    max_rss_growth_pct: float = 5.0
    fd_tolerance: int = 4
    progress: bool = False
    hostile_scale: float = 1.0  # list sizes of hostile requests (1.0 = those of issue 22)
    no_hostile: bool = False
    max_loop_lag_s: float = 1.0
    lag_poll_s: float = 1.0


# --------------------------------------------------------------------------- one request


async def send(client: httpx.AsyncClient, p: Planned, timeout: float) -> Outcome:
    out = Outcome(p.index, p.kind)
    t0 = time.monotonic()
    try:
        await asyncio.wait_for(_send(client, p, out), timeout)
    except asyncio.TimeoutError:
        out.ok, out.error = False, f"no answer in {timeout:.0f} s (hang)"
    except (httpx.HTTPError, StreamError, ValueError) as e:
        out.ok, out.error = False, f"{type(e).__name__}: {e}"[:300]
    out.latency_s = time.monotonic() - t0
    return out


async def _send(client: httpx.AsyncClient, p: Planned, out: Outcome) -> None:
    kwargs = {"content": p.raw, "headers": {"content-type": "application/json"}} if p.raw is not None \
        else {"json": p.body}
    if p.accept_status is not None:  # hostile: served or refused, never a 5xx
        r = await client.post(p.path, **kwargs)
        out.status = r.status_code
        out.extra["hostile"] = p.note
        out.extra["hostile_size"] = p.size
        if r.status_code not in p.accept_status:
            out.ok, out.error = False, f"{p.note}: got {r.status_code} {r.text[:200]}"
            return
        body = r.json()
        out.ok = ("error" in body) == (r.status_code != 200)
        out.error = "" if out.ok else f"{p.note}: {r.status_code} with body {r.text[:200]}"
        return
    if not p.stream:
        r = await client.post(p.path, **kwargs)
        out.status = r.status_code
        if p.expect_status != 200:
            out.ok = r.status_code == p.expect_status and "error" in r.json()
            out.error = "" if out.ok else f"{p.note}: expected {p.expect_status}, got {r.status_code} {r.text[:200]}"
            return
        out.error = check_full(p, r.json()) if r.status_code == 200 else f"{r.status_code} {r.text[:200]}"
        out.ok = not out.error
        return
    async with client.stream("POST", p.path, **kwargs) as r:
        out.status = r.status_code
        if r.status_code != 200:
            out.error = f"{r.status_code} {(await r.aread())[:200]!r}"
            return
        if p.drop_after_events == 0:  # hang up right after the headers
            out.ok = out.aborted = True
            return
        decoder, finishes = SSEDecoder(), {}
        async for line in r.aiter_lines():
            event = decoder.feed(line)
            if event is None:
                continue
            if "error" in event:
                out.error = f"error event: {str(event['error'])[:200]}"
                return
            out.events += 1
            for c in event.get("choices") or []:
                if c.get("finish_reason"):
                    finishes[c["index"]] = c["finish_reason"]
            if p.drop_after_events is not None and out.events >= p.drop_after_events:
                out.ok = out.aborted = True  # leaving the block closes the connection mid-stream
                return
        if p.drop_after_events is not None:
            out.error = f"a 400-token stream ended after {out.events} events"
            return
        out.error = check_stream(p, finishes, decoder.done)
        out.ok = not out.error


# --------------------------------------------------------------------------- server figures


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


# --------------------------------------------------------------------------- the run


async def _phase(cfg: SoakConfig, start: int, count: int, model: str, max_model_len: int,
                 outcomes: list[Outcome]) -> None:
    """Requests start..start+count at cfg.concurrency; the client and its connections are closed
    at the end so the server's fd count is read with no client attached."""
    limits = httpx.Limits(max_connections=cfg.concurrency, max_keepalive_connections=cfg.concurrency)
    timeout = httpx.Timeout(cfg.request_timeout, connect=30)
    next_index = iter(range(start, start + count))
    step = max(1, count // 10)

    async with httpx.AsyncClient(base_url=cfg.base_url, limits=limits, timeout=timeout) as client:
        async def worker() -> None:
            mix = {k: v for k, v in MIX.items() if k != "hostile"} if cfg.no_hostile else MIX
            for i in next_index:
                p = plan(i, seed=cfg.seed, model=model, max_model_len=max_model_len,
                         max_tokens=cfg.max_tokens, hostile_scale=cfg.hostile_scale, mix=mix)
                o = await send(client, p, cfg.request_timeout)
                outcomes.append(o)
                if not o.ok:
                    logger.warning("request %d (%s) failed: %s", i, p.kind, o.error)
                if cfg.progress and len(outcomes) % step == 0:
                    logger.info("%d requests done", len(outcomes))

        await asyncio.gather(*(worker() for _ in range(cfg.concurrency)))


async def _model_info(cfg: SoakConfig) -> tuple[str, int]:
    async with httpx.AsyncClient(base_url=cfg.base_url, timeout=30) as c:
        model = cfg.model or (await c.get("/v1/models")).json()["data"][0]["id"]
        if cfg.max_model_len:
            return model, cfg.max_model_len
        r = await c.post("/tokenize", json={"model": model, "prompt": "x"})
        return model, int(r.json().get("max_model_len") or 2048)


def _growth_pct(before: int, after: int) -> float | None:
    return round(100.0 * (after - before) / before, 2) if before else None


async def async_run_soak(cfg: SoakConfig) -> dict:
    model, max_model_len = await _model_info(cfg)
    pid = server_pid(cfg)
    if pid is None:
        logger.warning("no server pid (pass --server-pid): RSS and fd figures are left out")
    counters_before = await read_failure_counters(cfg.base_url)
    lag = LagPoller(cfg.base_url, cfg.lag_poll_s)
    lag.start()
    try:
        t0 = time.monotonic()
        warm_outcomes: list[Outcome] = []
        await _phase(cfg, 0, cfg.warmup, model, max_model_len, warm_outcomes)
        warm_gauges = await wait_idle(cfg.base_url, cfg.idle_timeout)
        warm = proctree.snapshot(pid) if pid else None
        t1 = time.monotonic()
        outcomes: list[Outcome] = []
        await _phase(cfg, cfg.warmup, cfg.requests, model, max_model_len, outcomes)
        t2 = time.monotonic()
        end_gauges = await wait_idle(cfg.base_url, cfg.idle_timeout)
        end = proctree.snapshot(pid) if pid else None
    finally:
        await lag.stop()
    counted = counter_delta(counters_before, await read_failure_counters(cfg.base_url))
    loop_lag = {"max_polled_s": lag.max_lag_s, "polls": lag.samples,
                "max_since_server_start_s": await read_gauge(cfg.base_url, LOOP_LAG_MAX)}
    return summarize(cfg, model, warm_outcomes, outcomes, warm_gauges, end_gauges, warm, end,
                     warmup_s=t1 - t0, run_s=t2 - t1, server_counted=counted, loop_lag=loop_lag)


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
            rss_growth_pct=_growth_pct(warm.rss_kib, end.rss_kib), fd_delta=end.fds - warm.fds)
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


def run_soak(cfg: SoakConfig) -> dict:
    """Callable from tests: the JSON summary as a dict."""
    return asyncio.run(async_run_soak(cfg))


# --------------------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    p = parser
    p.add_argument("--base-url", default=None, help="server root (default with --start-server: its own)")
    p.add_argument("--start-server", choices=["tiny", "default"], default=None,
                   help="start `pagedserve serve` here: a tiny random-weight model or the default "
                        "model; it is stopped with SIGTERM at the end and must exit 0 leaving no "
                        "shared-memory segment")
    p.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                   help="extra `serve` argument for --start-server (repeat), e.g. --server-arg=-tp=2")
    p.add_argument("--server-pid", type=int, default=None,
                   help="pid of the server to measure (default: the local process on the port)")
    p.add_argument("--requests", type=int, default=5000, help="requests after the warm-up")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--warmup", type=int, default=200, help="requests before the first reading")
    p.add_argument("--max-tokens", type=int, default=24, help="upper bound of each request's max_tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None, help="model name (default: the server's first model)")
    p.add_argument("--request-timeout", type=float, default=120.0,
                   help="a request unanswered for this long counts as a hang")
    p.add_argument("--max-rss-growth-pct", type=float, default=5.0)
    p.add_argument("--fd-tolerance", type=int, default=4)
    p.add_argument("--max-loop-lag", type=float, default=1.0,
                   help="fail when the server's event loop stalled longer than this many seconds "
                        "(pagedserve:event_loop_lag_seconds, polled from /metrics)")
    p.add_argument("--hostile-scale", type=float, default=1.0,
                   help="list sizes of the hostile requests: 1.0 = those of issue 22 (tens of "
                        "thousands of stop strings, a 2,000-prompt x n=128 fan-out, ...)")
    p.add_argument("--no-hostile", action="store_true", help="leave the hostile requests out of the mix")
    p.add_argument("--output", default=None, help="also write the JSON summary to this file")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if (args.base_url is None) == (args.start_server is None):
        print("error: give exactly one of --base-url and --start-server", file=sys.stderr)
        return 2
    server = None
    if args.start_server:
        from loadtest.local_server import LocalServer, ServerStartError, tiny_args

        serve_args = tiny_args() if args.start_server == "tiny" else []
        try:
            server = LocalServer([*serve_args, *args.server_arg])
        except ServerStartError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    cfg = SoakConfig(base_url=args.base_url or server.url, requests=args.requests,
                     concurrency=args.concurrency, warmup=args.warmup, seed=args.seed,
                     max_tokens=args.max_tokens, model=args.model,
                     server_pid=server.pid if server else args.server_pid,
                     request_timeout=args.request_timeout, max_rss_growth_pct=args.max_rss_growth_pct,
                     fd_tolerance=args.fd_tolerance, progress=True, hostile_scale=args.hostile_scale,
                     no_hostile=args.no_hostile, max_loop_lag_s=args.max_loop_lag)
    try:
        summary = run_soak(cfg)
    except (httpx.HTTPError, OSError, ValueError, KeyError) as e:
        print(f"error: could not run the soak against {cfg.base_url}: {e}", file=sys.stderr)
        return 1
    finally:
        if server is not None:
            code = server.stop()
    if server is not None:
        summary["server"]["exit_code"] = code
        summary["server"]["leftover_shm"] = server.leftover_segments()
        summary["server"]["log"] = server.log.name
        summary["checks"]["server_exit_0"] = code == 0
        summary["checks"]["no_shm_left"] = not summary["server"]["leftover_shm"]
        summary["passed"] = all(summary["checks"].values())
    text = json.dumps(summary, indent=2)
    print(text)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text + "\n")
    return 0 if summary["passed"] else 1
