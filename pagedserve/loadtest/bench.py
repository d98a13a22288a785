"""Serving benchmark against any OpenAI-compatible server (ours, `vllm serve`, llama.cpp).

    pagedserve bench serve --base-url http://127.0.0.1:8000 --dataset-name random \\
        --random-input-len 256 --random-output-len 128 --ignore-eos --num-prompts 64 \\
        --max-concurrency 16 --save-result --plot run.png
    python -m pagedserve.loadtest.bench --compare a.json b.json

Flags follow `vllm bench serve`. Token counts come from the server's streamed usage
(``stream_options.include_usage``), never from counting chunks. A request that gets a
non-200, a malformed event, a dropped connection or a stream without ``[DONE]`` is
counted as failed; the run still finishes and reports.
"""
from __future__ import annotations

import argparse
import logging
import math
import sys

import httpx

# The pieces of `bench serve` live in loadtest/bench_*.py; they are importable from here as before.
from pagedserve.loadtest.bench_config import CHAT, COMPLETIONS, BenchConfig, RequestResult  # noqa: F401
from pagedserve.loadtest.bench_metrics import compute_metrics, throughput_timeseries  # noqa: F401
from pagedserve.loadtest.bench_report import format_compare, format_table, load_result  # noqa: F401
from pagedserve.loadtest.bench_request import build_payload, send_request  # noqa: F401
from pagedserve.loadtest.bench_run import (  # noqa: F401
    async_run_benchmark,
    check_plot,
    default_result_filename,
    discover_model,
    run_benchmark,
)

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    p = parser
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root, e.g. http://127.0.0.1:8000")
    p.add_argument("--endpoint", default=COMPLETIONS, help=f"{COMPLETIONS} (default) or {CHAT}")
    p.add_argument("--model", default=None, help="model name (default: the server's first model)")
    p.add_argument("--dataset-name", default="random", choices=["random", "sharegpt", "prefix", "quote"],
                   help="quote: chat requests to repeat a passage (the answer quotes the prompt; speculative decoding)")
    p.add_argument("--dataset-path", default=None, help="ShareGPT-style JSON for --dataset-name sharegpt")
    p.add_argument("--sharegpt-output-len", type=int, default=None)
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests/s with Poisson arrivals (default inf: all at once)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrivals; 1 = Poisson")
    p.add_argument("--random-input-len", type=int, default=256)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--prefix-len", type=int, default=512, help="shared prefix tokens (--dataset-name prefix)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--api-key", default=None)
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer dir / tokenizer.json / .gguf (default: the server's /tokenize)")
    p.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS", help="SLOs, e.g. ttft:500 tpot:50")
    p.add_argument("--request-timeout", type=float, default=6 * 3600.0)
    p.add_argument("--save-result", action="store_true")
    p.add_argument("--result-filename", default=None)
    p.add_argument("--plot", default=None, metavar="FILE.png", help="latency CDFs and throughput over time")
    p.add_argument("--compare", nargs=2, default=None, metavar=("A.json", "B.json"),
                   help="print two saved results side by side (no server needed)")
    p.add_argument("--disable-tqdm", action="store_true")


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    out: dict[str, float] = {}
    for item in items or []:
        key, sep, val = item.partition(":")
        key = key.strip().lower()
        if not sep or key not in ("ttft", "tpot", "e2el"):
            raise ValueError(f"bad --goodput {item!r}: use ttft:MS, tpot:MS or e2el:MS")
        out[key] = float(val)
    return out


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    return BenchConfig(
        base_url=args.base_url,
        endpoint=args.endpoint,
        model=args.model,
        dataset_name=args.dataset_name,
        dataset_path=args.dataset_path,
        num_prompts=args.num_prompts,
        max_concurrency=args.max_concurrency,
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        random_input_len=args.random_input_len,
        random_output_len=args.random_output_len,
        random_range_ratio=args.random_range_ratio,
        prefix_len=args.prefix_len,
        sharegpt_output_len=args.sharegpt_output_len,
        ignore_eos=args.ignore_eos,
        temperature=args.temperature,
        seed=args.seed,
        api_key=args.api_key,
        tokenizer=args.tokenizer,
        goodput=parse_goodput(args.goodput),
        request_timeout=args.request_timeout,
        save_result=args.save_result,
        result_filename=args.result_filename,
        plot=args.plot,
        disable_tqdm=args.disable_tqdm,
    )


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    # httpx logs every request at INFO: hundreds of lines that break the progress bar.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if args.compare:
        runs = []
        for path in args.compare:
            try:
                runs.append(load_result(path))
            except (OSError, ValueError) as e:
                print(f"error: --compare {path}: {e}", file=sys.stderr)
                return 2
        print(format_compare(runs[0], runs[1], tuple(args.compare)))
        return 0
    try:
        cfg = config_from_args(args)
        if cfg.plot:
            check_plot(cfg.plot)  # before the run: not an ImportError after it
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        result = run_benchmark(cfg)
    except (httpx.HTTPError, RuntimeError, ValueError, OSError) as e:
        print(f"error: could not run the benchmark against {cfg.base_url}: {e}", file=sys.stderr)
        return 1
    print(format_table(result))
    if "result_file" in result:
        print(f"result saved to {result['result_file']}")
    if cfg.plot:
        print(f"plot saved to {cfg.plot}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedserve.loadtest.bench", description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
