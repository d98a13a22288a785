"""Quantized matmuls on the default model's shapes, by rows M: the row-layout kernel, the AVX-512
VNNI 16-channel kernel and oneDNN's packed bf16 matmul (what `--quantization none` runs). Not a
test; run by hand:

    .venv/bin/python -m pagedserve.loadtest.micro.bench_qgemm_model [--threads N] [--rounds R] [--m 1 16]

bf16 activations (this machine's dtype) unless ``--fp32``. The candidates run interleaved, one
batch of calls each per round; the median ms per call over the rounds is printed per shape, and
a "pass" line sums one decode step's matmuls (30 layers x 4 shapes + the LM head).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from pagedserve.kernels import qgemm, qgemm_n16

# SmolLM2-135M: hidden 576, intermediate 1536, 9 heads / 3 kv heads of 64, vocab 49152 (tied)
SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576), "head": (576, 49152)}
PER_PASS = {"qkv": 30, "o": 30, "gate_up": 30, "down": 30, "head": 1}


def _row_layout(mode, packed):
    real = qgemm_n16.library
    qgemm_n16.library = lambda: None
    try:
        return qgemm.PackedLinear(mode, packed)
    finally:
        qgemm_n16.library = real


def _time(fn, iters: int) -> float:
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters * 1e3


def candidates(k: int, n: int, m: int, dt: torch.dtype) -> dict:
    gen = torch.Generator().manual_seed(k + n)
    w = torch.randn(n, k, generator=gen) * 0.05
    x = torch.randn(m, k, generator=gen).to(dt)
    out = {}
    for mode in ("q4_1", "q8_0"):
        packed = qgemm.quantize(w, mode)
        row = _row_layout(mode, packed)
        out[f"{mode} row"] = lambda f=row: f(x)  # above FUSED_MAX_M rows: dequantize + matmul
        vnni, amx = qgemm.PackedLinear(mode, packed), qgemm.PackedLinear(mode, packed)
        if vnni.n16 is not None:
            vnni._amx, vnni._fused_max = None, 1 << 30  # the kernel itself at every M
            out[f"{mode} vnni"] = lambda f=vnni: f(x)
        if amx._amx is not None and dt is torch.bfloat16:
            amx._fused_max = 1 << 30
            out[f"{mode} amx"] = lambda f=amx: f(x)
    if dt is torch.bfloat16:
        wb = w.to(dt)
        wp = torch.ops.mkldnn._reorder_linear_weight(wb, 16)
        out["bf16 onednn"] = lambda: torch.ops.mkldnn._linear_pointwise(x, wp, None, "none", [], "")
    else:
        out["fp32 F.linear"] = lambda: torch.nn.functional.linear(x, w)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--m", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--fp32", action="store_true")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dt = torch.float32 if args.fp32 else torch.bfloat16
    print(f"threads={torch.get_num_threads()} dtype={dt} n16={qgemm_n16.library() is not None} "
          f"amx={qgemm_n16.amx_library() is not None} "
          f"loadavg={os.getloadavg()}")
    for m in args.m:
        totals: dict[str, float] = {}
        print(f"M={m}: median ms per call")
        for name, (k, n) in SHAPES.items():
            cands = candidates(k, n, m, dt)
            iters = max(3, int(3e6 / (k * n)))
            times: dict[str, list[float]] = {c: [] for c in cands}
            for fn in cands.values():
                fn()
            for _ in range(args.rounds):
                for c, fn in cands.items():
                    times[c].append(_time(fn, iters))
            meds = {c: statistics.median(ts) for c, ts in times.items()}
            for c, v in meds.items():
                totals[c] = totals.get(c, 0.0) + v * PER_PASS[name]
            print(f"  {name:8s} {k}->{n}: " + "  ".join(f"{c} {v:.4f}" for c, v in meds.items()))
        print("  pass ms: " + "  ".join(f"{c} {v:.2f}" for c, v in totals.items()))
    print(f"loadavg={os.getloadavg()}")


if __name__ == "__main__":
    main()
