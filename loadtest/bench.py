"""Serving benchmark against any OpenAI-compatible server (ours, `vllm serve`, llama.cpp).

    pagedserve bench serve --base-url http://127.0.0.1:8000 --dataset-name random \\
        --random-input-len 256 --random-output-len 128 --ignore-eos --num-prompts 64 \\
        --max-concurrency 16 --save-result --plot run.png
    python -m loadtest.bench --compare a.json b.json

Flags follow `vllm bench serve`. Token counts come from the server's streamed usage
(``stream_options.include_usage``), never from counting chunks. A request that gets a
non-200, a malformed event, a dropped connection or a stream without ``[DONE]`` is
counted as failed; the run still finishes and reports.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime

import httpx
import orjson

from loadtest import workloads
from loadtest.sse import SSEDecoder, StreamError

logger = logging.getLogger(__name__)

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


@dataclass(slots=True)
class BenchConfig:
    base_url: str = "http://127.0.0.1:8000"
    endpoint: str = COMPLETIONS
    model: str | None = None
    dataset_name: str = "random"
    dataset_path: str | None = None
    num_prompts: int = 100
    max_concurrency: int | None = None
    request_rate: float = math.inf
    burstiness: float = 1.0
    random_input_len: int = 256
    random_output_len: int = 128
    random_range_ratio: float = 0.0
    prefix_len: int = 512
    sharegpt_output_len: int | None = None
    ignore_eos: bool = False
    temperature: float = 0.0
    seed: int = 0
    api_key: str | None = None
    tokenizer: str | None = None
    goodput: dict[str, float] = field(default_factory=dict)  # ttft / tpot / e2el -> ms
    request_timeout: float = 6 * 3600.0
    save_result: bool = False
    result_filename: str | None = None
    plot: str | None = None
    disable_tqdm: bool = False


@dataclass(slots=True)
class RequestResult:
    success: bool = False
    error: str = ""
    start: float = 0.0  # seconds since benchmark start
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    chunk_times: list[float] = field(default_factory=list)  # seconds since benchmark start
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    intended_prompt_len: int = 0
    output_len: int = 0
    text_len: int = 0


# --------------------------------------------------------------------------- one request


def _headers(api_key: str | None) -> dict:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def build_payload(cfg: BenchConfig, model: str, req: workloads.SampleRequest) -> dict:
    body: dict = {
        "model": model,
        "max_tokens": req.output_len,
        "temperature": cfg.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if cfg.endpoint.endswith("chat/completions"):
        body["messages"] = req.chat_messages()
    else:
        body["prompt"] = req.completion_prompt()
    if cfg.ignore_eos:
        body["ignore_eos"] = True  # vLLM/pagedserve extension; llama.cpp ignores unknown keys
    return body


def _chunk_text(event: dict, chat: bool) -> str:
    choices = event.get("choices")
    if not isinstance(choices, list):
        raise StreamError(f"malformed event: no choices list: {str(event)[:200]}")
    text = ""
    for choice in choices:
        if not isinstance(choice, dict):
            raise StreamError(f"malformed event: choice is not an object: {str(event)[:200]}")
        if chat:
            delta = choice.get("delta") or {}
            text += (delta.get("content") or "") + (delta.get("reasoning_content") or "")
        else:
            text += choice.get("text") or ""
    return text


async def send_request(
    client: httpx.AsyncClient, cfg: BenchConfig, model: str, req: workloads.SampleRequest, t0: float
) -> RequestResult:
    """Stream one request; every failure mode ends up in RequestResult.error, never raised."""
    res = RequestResult(intended_prompt_len=req.prompt_len, output_len=req.output_len)
    chat = cfg.endpoint.endswith("chat/completions")
    start = time.perf_counter()
    res.start = start - t0
    last = start
    sse = SSEDecoder()
    try:
        async with client.stream("POST", cfg.endpoint, json=build_payload(cfg, model, req)) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode("utf-8", "replace")
                raise StreamError(f"HTTP {resp.status_code}: {body[:200]}")
            async for line in resp.aiter_lines():
                event = sse.feed(line)
                if event is None:
                    continue
                if event.get("error"):
                    raise StreamError(f"error event: {str(event['error'])[:200]}")
                usage = event.get("usage")
                if usage:
                    res.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                    res.completion_tokens = int(usage.get("completion_tokens") or 0)
                text = _chunk_text(event, chat)
                if text:
                    now = time.perf_counter()
                    if not res.chunk_times:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
                    res.chunk_times.append(now - t0)
                    res.text_len += len(text)
        sse.finish()
        res.e2e = time.perf_counter() - start
        if not res.chunk_times:  # nothing generated: first token time = end of stream
            res.ttft = res.e2e
        res.success = True
    except StreamError as e:
        res.error = str(e)
    except httpx.HTTPError as e:
        res.error = f"{type(e).__name__}: {e}"[:300]
    except Exception as e:  # noqa: BLE001 - one broken request must not end the run
        res.error = f"{type(e).__name__}: {e}"[:300]
    if not res.success:
        res.e2e = time.perf_counter() - start
    return res


# --------------------------------------------------------------------------- server discovery


def _api_base(base_url: str, endpoint: str) -> str:
    base = base_url.rstrip("/")
    if base.endswith("/v1") and endpoint.startswith("/v1/"):
        base = base[: -len("/v1")]
    return base


def discover_model(base: str, api_key: str | None) -> str:
    r = httpx.get(f"{base}/v1/models", headers=_headers(api_key), timeout=30.0)
    r.raise_for_status()
    data = r.json().get("data") or []
    if not data:
        raise RuntimeError(f"{base}/v1/models lists no model: pass --model")
    return str(data[0]["id"])


# --------------------------------------------------------------------------- load shape


async def _arrivals(n: int, rate: float, burstiness: float, rng: random.Random):
    """Yield request indexes: all at once for rate=inf, else Poisson (gamma if burstiness != 1)."""
    for i in range(n):
        yield i
        if math.isinf(rate) or i == n - 1:
            continue
        theta = 1.0 / (rate * burstiness)
        await asyncio.sleep(rng.gammavariate(burstiness, theta))


async def async_run_benchmark(cfg: BenchConfig) -> dict:
    base = _api_base(cfg.base_url, cfg.endpoint)
    headers = _headers(cfg.api_key)
    model = cfg.model or await asyncio.to_thread(discover_model, base, cfg.api_key)
    tokenizer = await asyncio.to_thread(workloads.load_tokenizer, cfg.tokenizer, base, model, headers)
    requests = await asyncio.to_thread(
        workloads.build_requests,
        cfg.dataset_name,
        tokenizer,
        cfg.num_prompts,
        input_len=cfg.random_input_len,
        output_len=cfg.random_output_len,
        range_ratio=cfg.random_range_ratio,
        prefix_len=cfg.prefix_len,
        dataset_path=cfg.dataset_path,
        sharegpt_output_len=cfg.sharegpt_output_len,
        seed=cfg.seed,
    )
    if hasattr(tokenizer, "close"):
        tokenizer.close()

    pbar = None
    if not cfg.disable_tqdm:
        from tqdm import tqdm

        pbar = tqdm(total=len(requests), desc="requests", unit="req")
    sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    limits = httpx.Limits(max_connections=cfg.max_concurrency or None, max_keepalive_connections=None)
    timeout = httpx.Timeout(cfg.request_timeout, connect=60.0)
    rng = random.Random(cfg.seed)
    results: list[RequestResult] = []

    async with httpx.AsyncClient(base_url=base, headers=headers, timeout=timeout, limits=limits) as client:

        async def one(req: workloads.SampleRequest) -> RequestResult:
            if sem is None:
                r = await send_request(client, cfg, model, req, t0)
            else:
                async with sem:
                    r = await send_request(client, cfg, model, req, t0)
            if pbar is not None:
                pbar.update(1)
            return r

        t0 = time.perf_counter()
        tasks = []
        async for i in _arrivals(len(requests), cfg.request_rate, cfg.burstiness, rng):
            tasks.append(asyncio.create_task(one(requests[i])))
        results = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - t0
    if pbar is not None:
        pbar.close()

    metrics = compute_metrics(results, duration, cfg.goodput)
    result = {
        "date": datetime.now().isoformat(timespec="seconds"),
        "config": {**asdict(cfg), "request_rate": _json_float(cfg.request_rate), "model": model},
        "tokenizer": tokenizer.source,
        "approximate_prompt_lengths": isinstance(tokenizer, workloads.ApproxTokenizer),
        "metrics": metrics,
        "timeseries": throughput_timeseries(results, duration),
        "requests": [
            {
                "success": r.success,
                "error": r.error,
                "start_s": r.start,
                "ttft_s": r.ttft if r.success else None,
                "e2e_s": r.e2e,
                "itl_s": r.itl,
                "prompt_tokens": r.prompt_tokens,
                "completion_tokens": r.completion_tokens,
                "intended_prompt_len": r.intended_prompt_len,
                "output_len": r.output_len,
            }
            for r in results
        ],
    }
    return result


def run_benchmark(config: BenchConfig | dict) -> dict:
    """Run a benchmark and return the full result (config, metrics, per-request figures).
    Also writes the JSON / plot when the config asks. Callable from tests."""
    cfg = config if isinstance(config, BenchConfig) else BenchConfig(**config)
    result = asyncio.run(async_run_benchmark(cfg))
    if cfg.save_result or cfg.result_filename:
        path = cfg.result_filename or default_result_filename(result)
        with open(path, "wb") as f:
            f.write(orjson.dumps(result, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY))
        result["result_file"] = path
    if cfg.plot:
        from loadtest.plot import plot_result

        plot_result(result, cfg.plot)
    return result


def default_result_filename(result: dict) -> str:
    cfg = result["config"]
    rate = cfg["request_rate"]
    rate_s = "inf" if rate is None else f"{rate:g}"
    model = str(cfg["model"]).rsplit("/", 1)[-1]
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    return f"bench-{model}-{cfg['dataset_name']}-{rate_s}qps-c{cfg['max_concurrency'] or 'inf'}-{stamp}.json"


def _json_float(x: float) -> float | None:
    return None if math.isinf(x) or math.isnan(x) else x


# --------------------------------------------------------------------------- metrics


def _percentile(sorted_xs: list[float], p: float) -> float:
    """Linear-interpolated percentile (numpy's default) of a sorted list."""
    if not sorted_xs:
        return 0.0
    k = (len(sorted_xs) - 1) * p / 100.0
    lo = math.floor(k)
    hi = min(lo + 1, len(sorted_xs) - 1)
    return sorted_xs[lo] + (sorted_xs[hi] - sorted_xs[lo]) * (k - lo)


def _stats(name: str, values_s: list[float], out: dict) -> None:
    xs = sorted(v * 1000.0 for v in values_s)
    n = len(xs)
    mean = sum(xs) / n if n else 0.0
    out[f"mean_{name}_ms"] = mean
    out[f"median_{name}_ms"] = _percentile(xs, 50)
    out[f"std_{name}_ms"] = math.sqrt(sum((x - mean) ** 2 for x in xs) / n) if n else 0.0
    out[f"p90_{name}_ms"] = _percentile(xs, 90)
    out[f"p99_{name}_ms"] = _percentile(xs, 99)
    out[f"max_{name}_ms"] = xs[-1] if xs else 0.0


def _tpot(r: RequestResult) -> float | None:
    if r.completion_tokens and r.completion_tokens > 1:
        return (r.e2e - r.ttft) / (r.completion_tokens - 1)
    return None


def compute_metrics(results: list[RequestResult], duration: float, goodput: dict[str, float] | None = None) -> dict:
    ok = [r for r in results if r.success]
    failed = [r for r in results if not r.success]
    in_tok = sum(r.prompt_tokens or 0 for r in ok)
    out_tok = sum(r.completion_tokens or 0 for r in ok)
    tpots = [t for t in (_tpot(r) for r in ok) if t is not None]
    errors: dict[str, int] = {}
    for r in failed:
        key = r.error.split(":", 1)[0] if r.error.startswith(("HTTP ", "malformed")) else r.error[:80]
        errors[key] = errors.get(key, 0) + 1
    m: dict = {
        "num_prompts": len(results),
        "completed": len(ok),
        "failed": len(failed),
        "errors": errors,
        "requests_without_usage": sum(1 for r in ok if r.completion_tokens is None),
        "duration_s": duration,
        "total_input_tokens": in_tok,
        "total_output_tokens": out_tok,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_throughput": out_tok / duration if duration > 0 else 0.0,
        "total_token_throughput": (in_tok + out_tok) / duration if duration > 0 else 0.0,
    }
    _stats("ttft", [r.ttft for r in ok], m)
    _stats("tpot", tpots, m)
    _stats("itl", [x for r in ok for x in r.itl], m)
    _stats("e2el", [r.e2e for r in ok], m)
    if goodput:
        good = 0
        for r in ok:
            t = _tpot(r) or 0.0
            if "ttft" in goodput and r.ttft * 1000 > goodput["ttft"]:
                continue
            if "tpot" in goodput and t * 1000 > goodput["tpot"]:
                continue
            if "e2el" in goodput and r.e2e * 1000 > goodput["e2el"]:
                continue
            good += 1
        m["goodput_slo_ms"] = dict(goodput)
        m["good_requests"] = good
        m["request_goodput"] = good / duration if duration > 0 else 0.0
    return m


def throughput_timeseries(results: list[RequestResult], duration: float, bins: int = 50) -> dict:
    """Output tokens/s and finished requests/s per time bin. A request's usage count is
    spread over the times its text chunks arrived (the count itself comes from usage)."""
    width = max(duration / bins, 1e-3) if duration > 0 else 1.0
    nbins = max(1, math.ceil(duration / width)) if duration > 0 else 1
    tokens = [0.0] * nbins
    finished = [0] * nbins
    for r in results:
        if not r.success:
            continue
        end_bin = min(int((r.start + r.e2e) / width), nbins - 1)
        finished[end_bin] += 1
        if r.completion_tokens and r.chunk_times:
            share = r.completion_tokens / len(r.chunk_times)
            for t in r.chunk_times:
                tokens[min(int(t / width), nbins - 1)] += share
    return {
        "bin_s": width,
        "t_s": [i * width for i in range(nbins)],
        "output_tokens_per_s": [x / width for x in tokens],
        "requests_per_s": [x / width for x in finished],
    }


# --------------------------------------------------------------------------- output

_ROWS: list[tuple[str, str, str]] = [
    # (label, metric key, format)
    ("Successful requests", "completed", "d"),
    ("Failed requests", "failed", "d"),
    ("Benchmark duration (s)", "duration_s", ".2f"),
    ("Total input tokens", "total_input_tokens", "d"),
    ("Total generated tokens", "total_output_tokens", "d"),
    ("Request throughput (req/s)", "request_throughput", ".2f"),
    ("Request goodput (req/s)", "request_goodput", ".2f"),
    ("Output token throughput (tok/s)", "output_throughput", ".2f"),
    ("Total token throughput (tok/s)", "total_token_throughput", ".2f"),
]
_LAT = [("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
        ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")]


def _table_lines(metrics_list: list[dict], names: list[str]) -> list[str]:
    """The vllm-style table; several runs side by side (ratio = last / first)."""
    multi = len(metrics_list) > 1
    width = 42
    col = 14

    def fmt(v, f):
        if v is None:
            return "-".rjust(col)
        return format(v, f).rjust(col) if f != "d" else str(int(v)).rjust(col)

    def row(label, key, f):
        vals = [m.get(key) for m in metrics_list]
        if all(v is None for v in vals):
            return None
        line = f"{label:<{width}}" + "".join(fmt(v, f) for v in vals)
        if multi:
            a, b = vals[0], vals[-1]
            ratio = f"{b / a:.2f}x" if isinstance(a, (int, float)) and isinstance(b, (int, float)) and a else "-"
            line += ratio.rjust(col)
        return line

    total = width + col * (len(metrics_list) + (1 if multi else 0))
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=total, c="=")]
    if multi:
        lines.append(" " * width + "".join(n[-col + 1:].rjust(col) for n in names) + "ratio".rjust(col))
    for label, key, f in _ROWS:
        r = row(label, key, f)
        if r:
            lines.append(r)
    for key, title in _LAT:
        lines.append("{s:{c}^{n}}".format(s=f" {title} ", n=total, c="-"))
        for stat in ("mean", "median", "p90", "p99"):
            r = row(f"{stat.capitalize()} {key.upper()} (ms)", f"{stat}_{key}_ms", ".2f")
            if r:
                lines.append(r)
    lines.append("=" * total)
    return lines


def format_table(result: dict) -> str:
    m = result["metrics"]
    lines = _table_lines([m], ["run"])
    extra = [f"model: {result['config'].get('model')}   endpoint: {result['config'].get('endpoint')}",
             f"tokenizer: {result.get('tokenizer')}"]
    if result.get("approximate_prompt_lengths"):
        extra.append("NOTE: prompt lengths are approximate (no tokenizer available)")
    if m.get("errors"):
        extra.append("errors: " + ", ".join(f"{k} x{v}" for k, v in m["errors"].items()))
    if m.get("requests_without_usage"):
        extra.append(f"WARNING: {m['requests_without_usage']} requests had no usage; their tokens are not counted")
    return "\n".join(lines + extra)


def load_result(path: str) -> dict:
    """A saved result: ours ({"metrics": {...}, ...}) or `vllm bench serve --save-result`'s flat
    file (figures at the top level, "duration" in seconds), so a vLLM run can be compared as is."""
    with open(path, "rb") as f:
        data = orjson.loads(f.read())
    if not isinstance(data, dict):
        raise ValueError("not a saved benchmark result (expected a JSON object)")
    if isinstance(data.get("metrics"), dict):
        return data
    if "completed" not in data:
        raise ValueError("not a saved benchmark result (no 'metrics' and no 'completed')")
    m = {k: v for k, v in data.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    if "duration" in m:
        m.setdefault("duration_s", m["duration"])
    if "failed" not in m and isinstance(data.get("num_prompts"), int):
        m["failed"] = data["num_prompts"] - data["completed"]
    return {"metrics": m, "config": {k: data.get(k) for k in ("model_id", "backend", "endpoint_type")}}


def format_compare(a: dict, b: dict, names: tuple[str, str] = ("A", "B")) -> str:
    return "\n".join(_table_lines([a["metrics"], b["metrics"]], list(names)))


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
    parser = argparse.ArgumentParser(prog="python -m loadtest.bench", description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
