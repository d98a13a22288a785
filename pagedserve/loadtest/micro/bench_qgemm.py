"""CPU timing of the quantized matmul kernel against fp32 and PyTorch's packed int8 op (not a
test; run by hand).

    .venv/bin/python -m pagedserve.loadtest.micro.bench_qgemm [--threads N] [--rounds R] [--m M]

The candidates are timed interleaved (one batch of calls each, round after round) and the median
per-call wall time over the rounds is printed, so a load spike from another process on a shared
machine hits every candidate alike.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from pagedserve.kernels import qgemm


def _batch(fn, iters: int) -> float:
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters * 1e6


def bench_shape(m: int, k: int, n: int, rounds: int) -> None:
    torch.manual_seed(0)
    x = torch.randn(m, k)
    w = torch.randn(n, k) * 0.02
    w8, scale = qgemm.quantize_int8(w)
    w4, d, mn = qgemm.quantize_int4(w)
    cands = {
        "fp32 x @ w.T": lambda: x @ w.t(),
        "qgemm int8": lambda: qgemm.int8_mm(x, w8, scale),
        "qgemm int4": lambda: qgemm.int4_mm(x, w4, d, mn),
        "torch _weight_int8pack_mm": lambda: torch.ops.aten._weight_int8pack_mm(x, w8, scale),
    }
    iters = max(3, int(2e8 / (k * n * 4)))  # about 200 MB of fp32 weights read per batch
    times: dict[str, list[float]] = {name: [] for name in cands}
    for fn in cands.values():
        fn()
    for _ in range(rounds):
        for name, fn in cands.items():
            times[name].append(_batch(fn, iters))
    base = statistics.median(times["fp32 x @ w.T"])
    print(f"M={m} K={k} N={n} ({iters} calls x {rounds} rounds, median us/call)")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"  {name:28s} {med:9.1f} us   {base / med:5.2f}x fp32")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--m", type=int, nargs="+", default=[1])
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"threads={torch.get_num_threads()} isa={qgemm.isa()} loadavg={os.getloadavg()}")
    for m in args.m:
        for k, n in ((576, 1536), (576, 49152)):
            bench_shape(m, k, n, args.rounds)
    print(f"loadavg={os.getloadavg()}")


if __name__ == "__main__":
    main()
