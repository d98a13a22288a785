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
import json
import logging
import sys

import httpx

# The pieces of `bench soak` live in loadtest/soak_*.py; they are importable from here as before.
from pagedserve.loadtest.soak_config import SoakConfig
from pagedserve.loadtest.soak_run import async_run_soak, run_soak, send  # noqa: F401
from pagedserve.loadtest.soak_server import (  # noqa: F401
    FAILURE_COUNTERS,
    IDLE_GAUGES,
    LOOP_LAG,
    LOOP_LAG_MAX,
    LagPoller,
    counter_delta,
    failure_counters,
    gauges,
    read_failure_counters,
    read_gauge,
    server_pid,
    wait_idle,
)
from pagedserve.loadtest.soak_summary import summarize  # noqa: F401


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
    p.add_argument("--also-model", action="append", default=[], metavar="NAME",
                   help="another served name (e.g. a LoRA adapter) the requests take turns with (repeat)")
    p.add_argument("--output", default=None, help="also write the JSON summary to this file")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if (args.base_url is None) == (args.start_server is None):
        print("error: give exactly one of --base-url and --start-server", file=sys.stderr)
        return 2
    server = None
    if args.start_server:
        from pagedserve.loadtest.local_server import LocalServer, ServerStartError, tiny_args

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
                     no_hostile=args.no_hostile, max_loop_lag_s=args.max_loop_lag,
                     also_models=tuple(args.also_model))
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
