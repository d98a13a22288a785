"""Where a decode step of the GPU check's ~1.2B Llama spends its time, kernel by kernel (a tool
for a lent GPU, like loadtest/micro/gpu_check.py): torch.profiler over eager steps and graph
replays at the batch sizes given, then an engine run's step times. Prints tables, writes nothing.

    python3 -m pagedserve.loadtest.micro.gpu_profile_decode --batches 1,64
"""
from __future__ import annotations

import argparse
import sys

from pagedserve.loadtest.micro.gpu_check import ROOT, _model_dir
from pagedserve.loadtest.micro.gpu_check_common import Ctx, decode_run
from pagedserve.loadtest.micro.gpu_check_decode import CONFIG_1B, _decode_meta
from pagedserve.loadtest.micro.gpu_check_common import random_prompts, tiny_options


def _profile(fn, steps: int, title: str, rows: int) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    averages = prof.key_averages()
    kernels = [e for e in averages if e.device_type.name == "CUDA"]
    total_us = sum(e.self_device_time_total for e in kernels) / steps
    count = sum(e.count for e in kernels) / steps
    print(f"\n### {title}: {count:.0f} kernels, {total_us:.0f} us of kernel time per step", flush=True)
    print(averages.table(sort_by="self_device_time_total", row_limit=rows, max_name_column_width=60),
          flush=True)


def launch_costs(calls: int = 2000) -> None:
    """Host microseconds per call, queued back to back (the GPU waits on the host): torch's
    RMSNorm and add against the Triton RMSNorm kernel, on one row of 2,048 bf16 values. Eager
    steps (prefills, mixed steps) pay this per kernel."""
    import time

    import torch
    import torch.nn.functional as F

    from pagedserve.kernels import triton_elementwise as te

    x = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16)
    w = torch.ones(2048, device="cuda", dtype=torch.bfloat16)
    w32 = w.float()
    cases = {"torch F.rms_norm": lambda: F.rms_norm(x, (2048,), w, 1e-6), "torch add": lambda: x + x,
             "triton rms_norm": lambda: te.rms_norm(x, w32, 1e-6),
             "triton rotary_neox_": lambda: te.rotary_neox_(x.view(1, 32, 64), w32.view(16, 128), pos, 64),
             "triton silu_and_mul": lambda: te.silu_and_mul(x)}
    pos = torch.zeros(1, dtype=torch.long, device="cuda")
    for name, fn in cases.items():
        for _ in range(50):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        print(f"launch cost {name}: {(time.perf_counter() - t0) / calls * 1e6:.1f} us a call", flush=True)


def main(argv: list[str] | None = None) -> int:
    import torch

    from pagedserve.engine.llm import LLM
    from pagedserve.gpu.forward_context import forward_context

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--rows", type=int, default=22)
    parser.add_argument("--launch-only", action="store_true", help="only the host cost of a launch")
    args = parser.parse_args(argv)
    launch_costs()
    if args.launch_only:
        return 0
    batches = [int(b) for b in args.batches.split(",")]
    ctx = Ctx(False, _model_dir(str(ROOT / ".gpu_check"), False))
    blocks = max(batches) * -(-args.context // 16) + 64
    options = tiny_options(ctx, hf_config=CONFIG_1B, dtype="bfloat16", enforce_eager=False,
                           cuda_graph_batch_sizes=batches, num_gpu_blocks_override=blocks, max_model_len=2048)
    with LLM(**options) as llm:
        runner = llm.parts.executor.runner
        model, gr = runner.model, runner.graph_runner
        for b in batches:
            meta = _decode_meta(b, args.context, runner.block_size, "cuda")
            ids = torch.randint(100, 40000, (b,), device="cuda")
            pos = torch.full((b,), args.context - 1, dtype=torch.long, device="cuda")
            size = gr._fill(ids, pos, meta)
            static = gr._static_meta(size, meta.block_tables.shape[1], meta.seq_lens_host, args.context)

            def eager():
                with torch.inference_mode(), forward_context(static, runner.kv_caches):
                    model(gr.input_ids[:size], gr.positions[:size])

            _profile(eager, 5, f"eager step, batch {b}", args.rows)
            graph = gr.graphs.get(size)
            if graph is not None:
                _profile(graph.replay, 5, f"graph replay, batch {b}", args.rows)
        run = decode_run(llm, random_prompts(16, 128, 128, seed=3), 32)
        print("\nLLM decode run (16 x 128-token prompts, 32 tokens):", run, flush=True)
        run = decode_run(llm, random_prompts(16, 128, 128, seed=4), 32)
        print("again, warm:", run, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
