"""`pagedserve bench startup`: cold start of `pagedserve serve`, process start -> /health 200.

Each run spawns a fresh `serve` on a free 127.0.0.1 port, polls /health until it answers 200,
then stops the server with SIGTERM. Reported per run: the wall time to /health 200, to the
"ready" log line, and (with --breakdown) when each start-up log line appeared, so a slow phase
(imports, tokenizer, weight load, KV allocation) shows without a profiler. The median over
--runs is the figure; the machine's load average is printed beside it because a shared box
makes single runs noisy.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time

# Log lines worth a row in the breakdown (substring -> label).
_MILESTONES = (
    ("engine ready", "engine ready (parent)"),
    ("loaded model in", "weights loaded (worker)"),
    ("KV cache:", "KV cache allocated (worker)"),
    ("worker process(es) ready", "workers ready (parent)"),
    ("| ready", "ready line"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--runs", type=int, default=5, help="cold starts to time (median reported)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for one start")
    parser.add_argument("--breakdown", action="store_true",
                        help="print when each start-up log line appeared, per run")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("serve_args", nargs=argparse.REMAINDER,
                        help="arguments after `--` go to `pagedserve serve` (default: the default model)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _health_ok(port: int) -> bool:
    """One GET /health over a raw socket (no HTTP client import in the timed loop)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            head = s.recv(64)
    except OSError:
        return False
    return head.startswith(b"HTTP/1.1 200")


def _logged_at(line: str, wall0: float) -> float | None:
    """Seconds from ``wall0`` (time.time()) to the asctime stamp a serve log line starts with
    ("2026-11-24 01:04:35,078 INFO ..."), or None for a line without one. The stamp, not the time our
    reader thread got to the line: that can come after /health already answered."""
    try:
        when = time.mktime(time.strptime(line[:19], "%Y-%m-%d %H:%M:%S")) + int(line[20:23]) / 1000
    except (ValueError, OverflowError):
        return None
    return when - wall0 if line[19:20] == "," else None


def time_one_start(serve_args: list[str], timeout: float) -> dict:
    """Start one server, time it to /health 200, stop it. Raises RuntimeError with its log on failure."""
    port = _free_port()
    cmd = [sys.executable, "-m", "pagedserve.app.cli", "serve", "--port", str(port), *serve_args]
    lines: list[tuple[float, str]] = []
    cpu0 = _children_cpu_s()
    t0, wall0 = time.perf_counter(), time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)

    def pump() -> None:
        for line in proc.stdout:
            read_at = time.perf_counter() - t0
            logged = _logged_at(line, wall0)
            lines.append((read_at if logged is None else min(logged, read_at), line.rstrip()))

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        deadline = t0 + timeout
        while True:
            if _health_ok(port):
                health_s = time.perf_counter() - t0
                break
            if proc.poll() is not None or time.perf_counter() > deadline:
                log = "\n".join(line for _, line in lines[-40:])
                raise RuntimeError(f"`{' '.join(cmd)}` did not become healthy "
                                   f"(exit code {proc.poll()}):\n{log}")
            time.sleep(0.02)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        reader.join(5)
    marks = {}
    for at, line in lines:
        for needle, label in _MILESTONES:
            if needle in line and label not in marks:
                marks[label] = round(at, 3)
    return {"health_s": round(health_s, 3), "marks": marks, "cpu_s": round(_children_cpu_s() - cpu0, 3),
            "log": [(round(a, 3), l) for a, l in lines]}


def _children_cpu_s() -> float:
    """CPU seconds of finished child processes (the server and, reaped by it, its workers): a
    figure a busy machine inflates far less than wall time."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run(args: argparse.Namespace) -> int:
    serve_args = [a for a in args.serve_args if a != "--"]
    runs = []
    for i in range(args.runs):
        try:
            r = time_one_start(serve_args, args.timeout)
        except RuntimeError as e:
            print(f"bench startup: run {i + 1}: {e}", file=sys.stderr)
            return 1
        runs.append(r)
        if args.breakdown and not args.json:
            print(f"run {i + 1}: /health 200 after {r['health_s']:.2f} s (CPU of the server's processes, "
                  f"start to exit: {r['cpu_s']:.2f} s)")
            for at, line in r["log"]:
                print(f"  {at:7.2f}  {line[:160]}")
        elif not args.json:
            print(f"run {i + 1}: {r['health_s']:.2f} s (CPU {r['cpu_s']:.2f} s)", file=sys.stderr)
    times = [r["health_s"] for r in runs]
    load = os.getloadavg()
    labels = [label for _, label in _MILESTONES]
    result = {
        "median_s": round(statistics.median(times), 3),
        "min_s": min(times), "max_s": max(times), "runs": times,
        "median_cpu_s": round(statistics.median(r["cpu_s"] for r in runs), 3),
        "median_marks": {lab: round(statistics.median(r["marks"][lab] for r in runs), 3)
                         for lab in labels if all(lab in r["marks"] for r in runs)},
        "loadavg": [round(x, 2) for x in load],
        "serve_args": serve_args,
    }
    if args.json:
        json.dump(result, sys.stdout)
        sys.stdout.write("\n")
        return 0
    print(f"serve -> /health 200: median {result['median_s']:.2f} s over {len(times)} runs "
          f"(min {min(times):.2f}, max {max(times):.2f}); CPU of its processes (start to exit) median "
          f"{result['median_cpu_s']:.2f} s; load average {load[0]:.2f}")
    for label, at in result["median_marks"].items():
        print(f"  {label:32s} {at:7.2f} s (median)")
    return 0
