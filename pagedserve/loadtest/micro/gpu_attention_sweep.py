"""The Triton decode attention kernel over its two tunables, on a lent GPU: keys per tile
(``block_n``) and context splits (``num_splits``), at the GPU check's shapes (the ~1.2B Llama:
32/8 heads, and the default model: 9/3 heads; head_dim 64, 16-slot blocks, bf16), contexts of
1,024 tokens, batches 1 to 256. Each case is a CUDA graph of one call per layer, each layer on caches
of its own (together larger than the L2), replayed: a kernel's own time, as in a captured decode
step. (Timing single Python calls had measured the launch below batch 64: 60-200 us for a kernel
that takes 4.4 us in a graph, loadtest/PERF.md.) Printed with the KV bytes read per second; the
policy's own choice (``choose_splits``, DECODE_BLOCK_N) is marked. Picks the defaults in
kernels/triton_attention.py.

    python3 -m pagedserve.loadtest.micro.gpu_attention_sweep [--deadline 100] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import sys
import time

SHAPES = {"1.2B (32/8)": (32, 8), "default (9/3)": (9, 3)}
BATCHES = (1, 16, 64, 256)
BLOCK_NS = (16, 32, 64, 128)
SPLITS = (1, 2, 4, 8, 16)


L2_BYTES = 128 << 20  # more than an H100's or H200's L2 (50 / 60 MB): each replay reads from HBM


def _replay_us(calls, replays: int = 20) -> float:
    """Microseconds per call of ``calls`` (one per layer) captured in one CUDA graph, median of replays."""
    import statistics

    import torch

    for call in calls:
        call()  # compiles, and allocates outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    import torch

    from pagedserve.kernels import triton_attention as ta
    from pagedserve.loadtest.micro.gpu_check_decode import _decode_meta

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--deadline", type=float, default=100.0, help="seconds; stops early with what it has")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    t_end = time.monotonic() + args.deadline
    dim, block, dtype, ctx = 64, 16, torch.bfloat16, args.context
    rows = []
    for shape, (heads, kv_heads) in SHAPES.items():
        for batch in BATCHES:
            if time.monotonic() > t_end:
                print("deadline reached", flush=True)
                break
            meta = _decode_meta(batch, ctx, block, "cuda")
            meta.token_request = torch.arange(batch, dtype=torch.int32, device="cuda")  # as the graph runner gives it
            blocks = int(meta.block_tables.max()) + 1
            kv_bytes = 2 * batch * ctx * kv_heads * dim * 2
            layers = max(4, min(64, -(-L2_BYTES // kv_bytes)))
            caches = [(torch.randn(blocks, block, kv_heads, dim, device="cuda", dtype=dtype),
                       torch.randn(blocks, block, kv_heads, dim, device="cuda", dtype=dtype)) for _ in range(layers)]
            q = torch.randn(batch, heads, dim, device="cuda", dtype=dtype)
            out = torch.empty_like(q)
            policy = (ta.DECODE_BLOCK_N, ta.choose_splits(batch, kv_heads, q.device))
            times = {}
            for bn in BLOCK_NS:
                for splits in SPLITS:
                    calls = [lambda k=k, v=v, bn=bn, splits=splits: ta.paged_attention_triton(
                        q, k, v, meta, dim ** -0.5, out=out, num_splits=splits, block_n=bn) for k, v in caches]
                    times[(bn, splits)] = _replay_us(calls)
            best = min(times, key=times.get)
            row = {"shape": shape, "batch": batch, "context": ctx,
                   "us": {f"{bn}x{s}": round(t, 2) for (bn, s), t in times.items()},
                   "best": {"block_n": best[0], "splits": best[1], "us": round(times[best], 2),
                            "GB/s": round(kv_bytes / times[best] / 1e3, 1)},
                   "policy": {"block_n": policy[0], "splits": policy[1], "us": round(times[policy], 2)},
                   "before": {"block_n": 16, "splits": policy[1], "us": round(times[(16, policy[1])], 2)}}
            rows.append(row)
            grid = "  ".join(f"{bn}:" + ",".join(f"{times[(bn, s)]:.1f}" for s in SPLITS) for bn in BLOCK_NS)
            print(f"{shape} batch {batch}: best {row['best']}, policy {row['policy']}, before {row['before']}\n"
                  f"    us by block_n: splits {SPLITS} -> {grid}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
