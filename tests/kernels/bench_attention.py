"""CPU timing of the torch paged-attention path (not a test; run by hand).

    .venv/bin/python -m tests.kernels.bench_attention [--threads N]

Prints wall time and process CPU time per call (best of 3 rounds); on a shared machine the CPU
time is the steadier figure.
"""
from __future__ import annotations

import argparse
import random
import time

import torch

from kernels.attention import paged_attention, write_kv_cache
from tests.kernels.paged_batch import make_batch


def _time(fn, iters: int) -> tuple[float, float]:
    fn()
    fn()
    best_wall = best_cpu = float("inf")
    for _ in range(3):
        w0, c0 = time.perf_counter(), time.process_time()
        for _ in range(iters):
            fn()
        best_wall = min(best_wall, (time.perf_counter() - w0) / iters)
        best_cpu = min(best_cpu, (time.process_time() - c0) / iters)
    return best_wall * 1e6, best_cpu * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--decodes", type=int, default=64)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rng = random.Random(0)
    heads, kv_heads, dim, bs = 9, 3, 64, 16
    scale = dim**-0.5
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}; H={heads} Hkv={kv_heads} D={dim} block={bs}")

    def report(name: str, batch, iters: int) -> None:
        wall, cpu = _time(lambda: paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, scale), iters)
        print(f"  {name:<34} {wall:9.0f} us wall {cpu:9.0f} us cpu")

    for dtype in (torch.bfloat16, torch.float32):
        print(dtype)
        decode = make_batch([(rng.randint(300, 600), 1) for _ in range(args.decodes)], heads, kv_heads, dim, bs, dtype)
        report(f"decode {args.decodes} reqs, ctx 300-600", decode, args.iters)
        report("decode 1 req, ctx 200", make_batch([(200, 1)], heads, kv_heads, dim, bs, dtype), args.iters * 10)
        report("prefill 512 tokens", make_batch([(0, 512)], heads, kv_heads, dim, bs, dtype), args.iters)
        report("prefill chunk 256 after 512 cached", make_batch([(512, 256)], heads, kv_heads, dim, bs, dtype), args.iters)
        mixed = [(rng.randint(300, 600), 1) for _ in range(32)] + [(0, 256), (200, 64)]
        report("mixed: 32 decodes + 2 prefill chunks", make_batch(mixed, heads, kv_heads, dim, bs, dtype), args.iters)
        k = torch.randn(args.decodes, kv_heads, dim).to(dtype)
        wall, cpu = _time(
            lambda: write_kv_cache(k, k, decode.k_cache, decode.v_cache, decode.meta.slot_mapping), args.iters * 10
        )
        print(f"  {'write_kv_cache ' + str(args.decodes) + ' tokens':<34} {wall:9.1f} us wall {cpu:9.1f} us cpu")


if __name__ == "__main__":
    main()
