"""The default model's 120 layer linears + LM head, plain F.linear against the prepacked weights
(gpu/models/packed_linear.py), per batch size: ``python -m pagedserve.loadtest.micro.bench_packed_linear``.
Min and median ms of one pass over all 121 matmuls; random weights (speed does not depend on values)."""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from pagedserve.gpu.models.packed_linear import PackedWeight
from pagedserve.kernels import fused

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]


def _ms(fn, repeats: int) -> str:
    """min / median ms: on a shared box the minimum is what the code can do."""
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return f"{min(times) * 1e3:6.1f}/{statistics.median(times) * 1e3:6.1f}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--rows", default="1,2,4,8,16,64,256,512,2048")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    torch.manual_seed(0)
    ws = [(torch.randn(o, i) * 0.05).to(dtype) for o, i in SHAPES]
    t = time.perf_counter()
    packed = [PackedWeight(w) for w in ws]  # the packed path alone, for every batch size
    print(f"{args.dtype}: oneDNN packing of {len(ws)} weights took {time.perf_counter() - t:.2f} s; "
          f"{args.threads} threads, ms min/median of {args.repeats}")
    extra = {}
    if dtype is torch.float32 and torch.backends.mkl.is_available():  # MKL's packed sgemm, for comparison
        mkl = [torch.ops.mkl._mkl_reorder_linear_weight(w, 16) for w in ws]
        extra["mkl"] = lambda xs: [torch.ops.mkl._mkl_linear(xs[w.shape[1]], p, w, None, xs[w.shape[1]].shape[0])
                                   for p, w in zip(mkl, ws)]
    gemv = dtype is torch.bfloat16 and fused.has_bf16_gemv()
    with torch.inference_mode():
        for m in (int(r) for r in args.rows.split(",")):
            xs = {k: torch.randn(m, k).to(dtype) for k in {i for _, i in SHAPES}}
            err = max(((p.linear(xs[w.shape[1]]).float() - F.linear(xs[w.shape[1]], w).float()).abs().max()
                       / F.linear(xs[w.shape[1]], w).float().abs().max()).item() for p, w in zip(packed[:4], ws))
            fns = {"F.linear": lambda: [F.linear(xs[w.shape[1]], w) for w in ws],
                   "packed": lambda: [p.linear(xs[p.in_features]) for p in packed]}
            fns.update({k: (lambda f=f: f(xs)) for k, f in extra.items()})
            if gemv and m <= 16:
                fns["gemv"] = lambda: [fused.gemv_bf16(xs[w.shape[1]], w) for w in ws]
            line = "  ".join(f"{k} {_ms(f, args.repeats)}" for k, f in fns.items())
            print(f"M={m:5d}  {line}   (packed rel. err {err:.1e})", flush=True)


if __name__ == "__main__":
    main()
