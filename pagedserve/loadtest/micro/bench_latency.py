"""`pagedserve bench latency`: one request's prefill time and decode speed (greedy, ignore_eos)."""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from pagedserve.app.engine_args import add_engine_args, engine_config_from_args
from pagedserve.app.offline_cmd import _flat


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--num-iters", type=int, default=3, help="measured runs (median reported)")
    parser.add_argument("--json", action="store_true")
    add_engine_args(parser)


def measure_once(llm, input_len: int, output_len: int) -> tuple[float, float]:
    """(prefill seconds, decode tokens/s) of one request run alone."""
    from pagedserve.engine.sampling_params import SamplingParams

    prompt = {"prompt_token_ids": [1000 + i % 20000 for i in range(input_len)]}
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=output_len)
    start = time.perf_counter()
    first = None
    tokens = 0
    for delta in llm.stream(prompt, params):
        tokens += len(delta.outputs[0].token_ids)
        if first is None and tokens:
            first = time.perf_counter()
    end = time.perf_counter()
    return first - start, (tokens - 1) / (end - first)


def run(args: argparse.Namespace) -> int:
    from pagedserve.engine.llm import LLM

    llm = LLM(**_flat(engine_config_from_args(args)))
    try:
        from tqdm import tqdm

        measure_once(llm, args.input_len, min(args.output_len, 8))  # warm-up
        runs = [measure_once(llm, args.input_len, args.output_len)
                for _ in tqdm(range(args.num_iters), desc="bench latency", unit="run", file=sys.stderr,
                              leave=False)]
    finally:
        llm.shutdown()
    result = {
        "input_len": args.input_len,
        "output_len": args.output_len,
        "dtype": llm.config.model.dtype,
        "prefill_s": round(statistics.median(r[0] for r in runs), 4),
        "decode_tokens_per_s": round(statistics.median(r[1] for r in runs), 1),
        "runs": [{"prefill_s": round(p, 4), "decode_tokens_per_s": round(d, 1)} for p, d in runs],
    }
    if args.json:
        json.dump(result, sys.stdout)
        sys.stdout.write("\n")
    else:
        print(f"prefill ({args.input_len} tokens): {result['prefill_s'] * 1000:.1f} ms")
        print(f"decode: {result['decode_tokens_per_s']} tokens/s (median of {args.num_iters})")
    return 0
