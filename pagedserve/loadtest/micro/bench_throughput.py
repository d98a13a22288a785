"""`pagedserve bench throughput`: the offline workload W1 (or another file of its shape).

A workload file holds {"sampling": {...SamplingParams fields}, "requests": [{"prompt_token_ids",
"max_tokens"}]}. Two requests warm up first, then the whole set runs through LLM.generate.

``--busy-neighbours N`` runs N CPU-bound processes (``while True: pass``) from just after the model
is loaded until the run ends, then kills them: the contention row of issue 36 item 5, reproducible
(compare with the same command at N = 0, back to back).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from pagedserve.app.engine_args import add_engine_args, engine_config_from_args
from pagedserve.app.offline_cmd import _flat

DEFAULT_WORKLOAD = Path(__file__).resolve().parents[1] / "workloads" / "w1.json"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload", default=str(DEFAULT_WORKLOAD), help="workload JSON (default: W1)")
    parser.add_argument("--num-requests", type=int, default=None, help="use only the first N requests")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    parser.add_argument("--busy-neighbours", type=int, default=0, metavar="N",
                        help="run N CPU-bound processes beside the benchmark (warm-up and timed run), "
                             "killed when it ends (default 0)")
    add_engine_args(parser)


def run(args: argparse.Namespace) -> int:
    from pagedserve.engine.llm import LLM
    from pagedserve.engine.sampling_params import SamplingParams
    from pagedserve.loadtest.micro.neighbours import busy_neighbours

    if args.busy_neighbours < 0:
        raise SystemExit("--busy-neighbours must be >= 0")

    workload = json.loads(Path(args.workload).read_text())
    requests = workload["requests"][: args.num_requests]
    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in requests]
    params = [SamplingParams(**workload.get("sampling", {}), max_tokens=r["max_tokens"]) for r in requests]
    llm = LLM(**_flat(engine_config_from_args(args)))
    try:
        with busy_neighbours(args.busy_neighbours):
            llm.generate(prompts[:2], params[:2], use_tqdm=False)
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=not args.json)
            elapsed = time.perf_counter() - start
    finally:
        llm.shutdown()
    input_tokens = sum(len(p["prompt_token_ids"]) for p in prompts)
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    result = {
        "workload": Path(args.workload).name,
        "requests": len(prompts),
        "busy_neighbours": args.busy_neighbours,
        "threads": _threads(),
        "omp_wait": _omp_wait(),
        "elapsed_s": round(elapsed, 3),
        "requests_per_s": round(len(prompts) / elapsed, 3),
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "input_tokens_per_s": round(input_tokens / elapsed, 1),
        "output_tokens_per_s": round(output_tokens / elapsed, 1),
        "total_tokens_per_s": round((input_tokens + output_tokens) / elapsed, 1),
    }
    if args.json:
        json.dump(result, sys.stdout)
        sys.stdout.write("\n")
    else:
        for key, value in result.items():
            print(f"{key:>22}: {value}")
    return 0


def _threads() -> int:
    import torch

    return torch.get_num_threads()


def _omp_wait() -> str:
    """The OpenMP wait settings this run's libgomp read (contracts/cpu_threads.py sets the default)."""
    import os

    shown = [f"{name}={os.environ[name]}" for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT") if os.environ.get(name)]
    return " ".join(shown) or "libgomp default"
