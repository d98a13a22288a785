"""Runs a `bench serve` benchmark: finds the model, builds the requests, sends them with the asked
concurrency and arrival shape, and assembles (and saves, when asked) the result.
"""
from __future__ import annotations

import asyncio
import math
import os
import random
import time
from dataclasses import asdict
from datetime import datetime

import httpx
import orjson

from pagedserve.loadtest import workloads
from pagedserve.loadtest.bench_config import BenchConfig, RequestResult
from pagedserve.loadtest.bench_metrics import compute_metrics, throughput_timeseries
from pagedserve.loadtest.bench_request import _headers, send_request


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


class PlotUnavailable(ValueError):
    """--plot cannot be drawn here; said before the run, not after it."""


def check_plot(path: str) -> None:
    """Whether a plot can be written to ``path``: matplotlib imports (the bench extra) and the
    folder exists. Checked before the run: otherwise the whole run is lost to an ImportError at
    its end (issue 40)."""
    try:
        import pagedserve.loadtest.plot  # noqa: F401 - imports matplotlib as the plot will
        from pagedserve import loadtest
    except ImportError as e:
        raise PlotUnavailable(f"--plot needs matplotlib ({e}): pip install 'pagedserve[bench]' "
                              "(or pip install matplotlib), or leave out --plot") from None
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise PlotUnavailable(f"--plot {path}: the folder {folder} does not exist")


def run_benchmark(config: BenchConfig | dict) -> dict:
    """Run a benchmark and return the full result (config, metrics, per-request figures).
    Also writes the JSON / plot when the config asks (a plot that cannot be drawn is a
    PlotUnavailable before the run). Callable from tests."""
    cfg = config if isinstance(config, BenchConfig) else BenchConfig(**config)
    if cfg.plot:
        check_plot(cfg.plot)
    result = asyncio.run(async_run_benchmark(cfg))
    if cfg.save_result or cfg.result_filename:
        path = cfg.result_filename or default_result_filename(result)
        with open(path, "wb") as f:
            f.write(orjson.dumps(result, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY))
        result["result_file"] = path
    if cfg.plot:
        from pagedserve.loadtest.plot import plot_result

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
