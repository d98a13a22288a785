"""Decode steps of the default model with the AMX attention kernel on and off, in one process.

    python -m pagedserve.loadtest.micro.bench_decode_attention_e2e [--requests 16] [--prompt-len 256] [--output-len 128]
        [--rounds 3] [--threads N]

Offline ``LLM`` (bf16 where the CPU has it), ``--requests`` prompts of random token ids, greedy,
``ignore_eos``; rounds alternate AVX-512 attention (kernels.attn_amx.decode_fn patched to None)
and AMX. Prints per round the wall time of ``generate`` and the time inside the decode attention
calls (``decode_attention_c``), and the medians. Not a test.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave the engine's choice)")
    args = ap.parse_args()

    from pagedserve.engine.llm import LLM
    from pagedserve.engine.sampling_params import SamplingParams
    from pagedserve.kernels import attn_amx, cpu_attention

    if args.threads:
        torch.set_num_threads(args.threads)
    inside = [0.0]
    decode = cpu_attention.decode_attention_c

    def timed(*a, **k):
        t0 = time.perf_counter()
        decode(*a, **k)
        inside[0] += time.perf_counter() - t0

    cpu_attention.decode_attention_c = timed
    cpu_attention._decode_with.cache_clear()
    amx_fn = attn_amx.decode_fn
    llm = LLM(kv_cache_memory=1.0)
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(1000, 40000) for _ in range(args.prompt_len)]}
               for _ in range(args.requests)]
    sp = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)  # warm up
    results: dict[str, list[tuple[float, float]]] = {"avx512": [], "amx": []}
    for r in range(args.rounds):
        for path in ("avx512", "amx"):
            attn_amx.decode_fn = amx_fn if path == "amx" else (lambda *a: None)
            inside[0] = 0.0
            t0 = time.perf_counter()
            llm.generate(prompts, sp, use_tqdm=False)
            wall = time.perf_counter() - t0
            results[path].append((wall, inside[0]))
            print(f"round {r} {path:>6}: generate {wall:6.2f} s, decode attention {inside[0] * 1e3:8.1f} ms",
                  flush=True)
    for path, rows in results.items():
        print(f"median {path:>6}: generate {statistics.median(w for w, _ in rows):6.2f} s, decode attention "
              f"{statistics.median(a for _, a in rows) * 1e3:8.1f} ms")


if __name__ == "__main__":
    main()
