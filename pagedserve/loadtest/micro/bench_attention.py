"""CPU timing of paged attention, the C decode kernel against the torch path (not a test; run by hand).

    .venv/bin/python -m pagedserve.loadtest.micro.bench_attention [--threads N] [--rounds R] [--dtype bf16|fp32|both]

Each case runs both paths in turn within every round (interleaved, so a busy neighbour slows both)
and prints the median over rounds of wall time and process CPU time per call; on a shared machine
the CPU time is the steadier figure. Shapes are the default model's (9 query heads, 3 KV heads,
head_dim 64, block 16); context lengths are those of W1 and the c=16 serving run.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import time

import torch

from pagedserve.contracts import env
from pagedserve.kernels import cpu_attention
from pagedserve.kernels.attention import paged_attention, write_kv_cache
from pagedserve.loadtest.micro.paged_batch import make_batch

IMPLS = ("torch", "c")


def _once(fn, iters: int) -> tuple[float, float]:
    w0, c0 = time.perf_counter(), time.process_time()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - w0) / iters * 1e6, (time.process_time() - c0) / iters * 1e6


def _set_impl(impl: str) -> None:
    env.CPU_ATTENTION.put("torch" if impl == "torch" else None)


def _wrapper_overhead(dtype, heads: int, kv_heads: int, dim: int, bs: int, scale: float, iters: int) -> None:
    """Python cost of one layer's decode call: paged_attention against the bare ctypes call, on an
    empty context (the kernel does next to nothing), one thread."""
    lib = cpu_attention.library()
    if lib is None:
        return
    batch = make_batch([(0, 1)], heads, kv_heads, dim, bs, dtype)
    out = torch.empty_like(batch.q)
    meta = batch.meta
    fn = lambda: paged_attention(batch.q, batch.k_cache, batch.v_cache, meta, scale, out=out)  # noqa: E731
    args = (batch.q.data_ptr(), heads * dim, batch.k_cache.data_ptr(), batch.v_cache.data_ptr(),
            meta.block_tables.data_ptr(), meta.block_tables.stride(0), meta.seq_lens.data_ptr(), 1, heads, kv_heads,
            dim, bs, scale, out.data_ptr(), heads * dim, cpu_attention._DTYPES[dtype], 0, 1)
    raw = lambda: lib.pa_decode(*args)  # noqa: E731
    fn()
    full = statistics.median(_once(fn, iters)[0] for _ in range(5))
    bare = statistics.median(_once(raw, iters)[0] for _ in range(5))
    print(f"  {'wrapper: paged_attention, empty ctx':<38} {full:9.1f} us; bare ctypes call {bare:.1f} us; "
          f"Python around it {full - bare:.1f} us")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    parser.add_argument("--dtype", choices=["bf16", "fp32", "both"], default="both")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rng = random.Random(0)
    heads, kv_heads, dim, bs = 9, 3, 64, 16
    scale = dim**-0.5
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, kernel {cpu_attention.isa()}; "
          f"H={heads} Hkv={kv_heads} D={dim} block={bs}; loadavg {os.getloadavg()}")
    print(f"median of {args.rounds} interleaved rounds x {args.iters} calls, us per call (wall / cpu)")
    dtypes = {"bf16": [torch.bfloat16], "fp32": [torch.float32], "both": [torch.bfloat16, torch.float32]}[args.dtype]
    for dtype in dtypes:
        cases = [
            ("decode 1 req, ctx 400", [(400, 1)], 10),
            ("decode 1 req, ctx 320", [(320, 1)], 10),
            ("decode 16 reqs, ctx 256-384", [(rng.randint(256, 384), 1) for _ in range(16)], 1),
            ("decode 48 reqs, ctx 300-600", [(rng.randint(300, 600), 1) for _ in range(48)], 1),
            ("mixed: 32 decodes + 2 prefill chunks",
             [(rng.randint(300, 600), 1) for _ in range(32)] + [(0, 256), (200, 64)], 1),
            ("prefill chunk 256 after 512 cached", [(512, 256)], 1),
        ]
        print(dtype)
        for name, reqs, mult in cases:
            batch = make_batch(reqs, heads, kv_heads, dim, bs, dtype)
            fn = lambda: paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, scale)  # noqa: E731
            samples: dict[str, list[tuple[float, float]]] = {impl: [] for impl in IMPLS}
            for impl in IMPLS:  # warm up both (builds, workspaces)
                _set_impl(impl)
                batch.meta.cpu_plan = None
                fn()
            for _ in range(args.rounds):
                for impl in IMPLS:
                    _set_impl(impl)
                    batch.meta.cpu_plan = None
                    fn()
                    samples[impl].append(_once(fn, args.iters * mult))
            line = f"  {name:<38}"
            med = {}
            for impl in IMPLS:
                wall = statistics.median(s[0] for s in samples[impl])
                cpu = statistics.median(s[1] for s in samples[impl])
                med[impl] = wall
                line += f" {impl:>5} {wall:8.0f} / {cpu:8.0f}"
            print(line + f"   torch/c {med['torch'] / med['c']:5.2f}x")
        _set_impl("c")
        _wrapper_overhead(dtype, heads, kv_heads, dim, bs, scale, args.iters * 30)
        k = torch.randn(48, kv_heads, dim).to(dtype)
        decode = make_batch([(300, 1)] * 48, heads, kv_heads, dim, bs, dtype)
        wall, cpu = _once(lambda: write_kv_cache(k, k, decode.k_cache, decode.v_cache, decode.meta.slot_mapping),
                          args.iters * 10)
        print(f"  {'write_kv_cache 48 tokens':<38} {wall:9.1f} / {cpu:9.1f}")


if __name__ == "__main__":
    main()
