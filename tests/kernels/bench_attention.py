"""CPU timing of the torch paged-attention path (not a test; run by hand).

    .venv/bin/python -m tests.kernels.bench_attention [--threads N]
"""
from __future__ import annotations

import argparse
import random
import time

import torch

from kernels.attention import paged_attention, write_kv_cache
from tests.kernels.paged_batch import make_batch


def _time(fn, iters: int) -> float:
    fn()
    fn()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        best = min(best, (time.perf_counter() - t0) / iters)
    return best * 1e6


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
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}")
    for dtype in (torch.bfloat16, torch.float32):
        decode = make_batch([(rng.randint(300, 600), 1) for _ in range(args.decodes)], heads, kv_heads, dim, bs, dtype)
        us = _time(lambda: paged_attention(decode.q, decode.k_cache, decode.v_cache, decode.meta, scale), args.iters)
        print(f"{dtype}: decode {args.decodes} reqs ctx 300-600: {us:8.0f} us/call")
        single = make_batch([(200, 1)], heads, kv_heads, dim, bs, dtype)
        us = _time(lambda: paged_attention(single.q, single.k_cache, single.v_cache, single.meta, scale), args.iters * 10)
        print(f"{dtype}: decode 1 req ctx 200:          {us:8.0f} us/call")
        prefill = make_batch([(0, 512)], heads, kv_heads, dim, bs, dtype)
        us = _time(lambda: paged_attention(prefill.q, prefill.k_cache, prefill.v_cache, prefill.meta, scale), args.iters)
        print(f"{dtype}: prefill 512 tokens:            {us:8.0f} us/call")
        chunk = make_batch([(512, 256)], heads, kv_heads, dim, bs, dtype)
        us = _time(lambda: paged_attention(chunk.q, chunk.k_cache, chunk.v_cache, chunk.meta, scale), args.iters)
        print(f"{dtype}: prefill chunk 256 after 512:   {us:8.0f} us/call")
        k = torch.randn(args.decodes, kv_heads, dim).to(dtype)
        slots = decode.meta.slot_mapping
        us = _time(lambda: write_kv_cache(k, k, decode.k_cache, decode.v_cache, slots), args.iters * 10)
        print(f"{dtype}: write_kv_cache {args.decodes} tokens:     {us:8.1f} us/call")


if __name__ == "__main__":
    main()
