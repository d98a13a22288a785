"""The Triton decode attention kernel over its two tunables, on a lent GPU: keys per tile
(``block_n``) and context splits (``num_splits``), at the GPU check's shapes (the ~1.2B Llama:
32/8 heads, and the default model: 9/3 heads; head_dim 64, 16-slot blocks, bf16), contexts of
1,024 tokens, batches 1 to 256. Each case is timed by ``triton.testing.do_bench`` (median, the L2
cleared before each run) and printed with the KV bytes it read per second; the policy's own choice
(``choose_splits``, DECODE_BLOCK_N) is marked. Picks the defaults in kernels/triton_attention.py.

    python3 -m loadtest.micro.gpu_attention_sweep [--deadline 100] [--json out.json]
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


def main(argv: list[str] | None = None) -> int:
    import torch
    import triton.testing

    from kernels import triton_attention as ta
    from loadtest.micro.gpu_check_decode import _decode_meta

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
            blocks = int(meta.block_tables.max()) + 1
            k_cache = torch.randn(blocks, block, kv_heads, dim, device="cuda", dtype=dtype)
            v_cache = torch.randn_like(k_cache)
            q = torch.randn(batch, heads, dim, device="cuda", dtype=dtype)
            out = torch.empty_like(q)
            kv_bytes = 2 * batch * ctx * kv_heads * dim * 2
            policy = (ta.DECODE_BLOCK_N, ta.choose_splits(batch, kv_heads, q.device))
            times = {}
            for bn in BLOCK_NS:
                for splits in SPLITS:
                    def call():
                        ta.paged_attention_triton(q, k_cache, v_cache, meta, dim ** -0.5, out=out, num_splits=splits,
                                                  block_n=bn)
                    call()
                    times[(bn, splits)] = triton.testing.do_bench(call, warmup=5, rep=25, return_mode="median") * 1e3
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
