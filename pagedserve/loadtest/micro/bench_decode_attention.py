"""Decode attention kernels side by side: AVX-512 (csrc/paged_attn.c) against AMX (csrc/paged_attn_amx.c).

    python -m pagedserve.loadtest.micro.bench_decode_attention [--batches 1 4 16] [--contexts 128 384 1024]
        [--threads 2] [--reps 7] [--layers 8] [--paths avx512 amx amx-fp8]

Default-model shapes (SmolLM2-135M: 9 query heads, 3 KV heads, head_dim 64, block 16, bf16).
Every request of a case has the same context; the caches of ``--layers`` layers are cycled as in a
step (a layer's K/V is not hot in L2 when its turn comes). The thread count and the split into
parts are the ones the server picks; a path named ``<kernel>-fp8`` reads fp8 copies of the caches
(--kv-cache-dtype fp8). The thread count and the split into parts are the ones the server picks (kernels.cpu_attention._threads_and_parts). Each rep times
every path back to back (interleaved, so a busy neighbour slows both); the median and the minimum
over reps of wall time per layer call are printed, with the ratio of the medians (first path over
last). On a busy box at ``nice -n 19`` a two-thread OpenMP region can wait milliseconds for its
second thread: such reps show as medians far above the minima. Not a test.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import time

import torch

from pagedserve.kernels import attn_amx, cpu_attention
from pagedserve.kernels.kv_cache_dtype import FP8
from pagedserve.loadtest.micro.paged_batch import make_batch

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def _decoder(path: str):
    """The pa_decode-compatible entry point of ``path`` (None: the default build's pa_decode)."""
    if path.removesuffix("-fp8") == "amx":
        lib = attn_amx.library()
        if lib is None:
            raise SystemExit("no AMX kernel on this machine")
        return lib.pam_decode
    return None


def _case(batch_size: int, context: int, layers: int, paths: list[str], reps: int, min_time: float) -> dict:
    batch = make_batch([(context - 1, 1)] * batch_size, HEADS, KV_HEADS, HEAD_DIM, BLOCK, torch.bfloat16, seed=1,
                       spare_blocks=0)
    caches = [(batch.k_cache.clone(), batch.v_cache.clone()) for _ in range(layers)]
    fp8_caches = [(k.to(FP8), v.to(FP8)) for k, v in caches]
    lib = cpu_attention.library()
    q, meta = batch.q[:batch_size], batch.meta
    out = torch.empty_like(q)
    scale = HEAD_DIM ** -0.5
    threads, part = cpu_attention._threads_and_parts(meta.seq_lens_host, HEADS, KV_HEADS, HEAD_DIM, BLOCK)
    key = ("c", batch_size, HEADS, KV_HEADS, HEAD_DIM, BLOCK)
    calls = {p: cpu_attention.step_call(meta, key, threads, part, _decoder(p)) for p in paths}

    def run(path: str, n: int) -> float:
        meta.cpu_plan = (key, calls[path])
        layer_caches = fp8_caches if path.endswith("-fp8") else caches
        t0 = time.perf_counter()
        for _ in range(n):
            for k, v in layer_caches:
                cpu_attention.decode_attention_c(lib, q, k, v, meta, scale, out)
        return (time.perf_counter() - t0) / (n * layers) * 1e6

    outs = {}
    for p in paths:  # warm up, check the paths agree, size the rounds to ~min_time each
        run(p, 1)
        outs[p] = out.clone()
    n = max(1, int(min_time / (run(paths[0], 1) * layers * 1e-6)))
    times: dict[str, list[float]] = {p: [] for p in paths}
    for _ in range(reps):
        for p in paths:
            times[p].append(run(p, n))
    diff = max((outs[p].float() - outs[paths[0]].float()).abs().max().item() for p in paths
               if p.endswith("-fp8") == paths[0].endswith("-fp8"))
    return {"threads": threads, "part": part, "n": n, "diff": diff,
            "median": {p: statistics.median(t) for p, t in times.items()}, "all": times}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--contexts", type=int, nargs="+", default=[128, 384, 1024])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--min-time", type=float, default=0.05, help="seconds per path per rep")
    ap.add_argument("--paths", nargs="+", default=["avx512", "amx"])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    kind = subprocess.run("grep -o 'avx512_bf16\\|amx_bf16\\|avx2' /proc/cpuinfo | sort -u | tr '\\n' ' '",
                          shell=True, capture_output=True, text=True).stdout.strip()
    print(f"machine: {kind}; torch threads {args.threads}; {args.layers} layers cycled; median of {args.reps} reps; "
          f"us per layer call (H={HEADS} Hkv={KV_HEADS} D={HEAD_DIM} block={BLOCK}, bf16)")
    head = "".join(f"{p + ' med':>12}{'min':>8}" for p in args.paths)
    print(f"{'batch':>5} {'ctx':>5} {'thr':>3} {'part':>5}{head}  ratio(med)  max|diff|")
    for b in args.batches:
        for c in args.contexts:
            r = _case(b, c, args.layers, args.paths, args.reps, args.min_time)
            med = r["median"]
            cols = "".join(f"{med[p]:12.1f}{min(r['all'][p]):8.1f}" for p in args.paths)
            ratio = med[args.paths[0]] / med[args.paths[-1]]
            print(f"{b:5d} {c:5d} {r['threads']:3d} {r['part']:5d}{cols}  {ratio:9.2f}x"
                  f"  {r['diff']:.4f}", flush=True)


if __name__ == "__main__":
    main()
