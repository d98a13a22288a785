"""Runs a soak: sends the planned mix at the asked concurrency, one request at a time per worker,
in a warm-up and a main phase, reading the server between them, and hands the lot to the summary.
"""
from __future__ import annotations

import asyncio
import logging
import time

import httpx

from pagedserve.loadtest import proctree
from pagedserve.loadtest.soak_config import SoakConfig
from pagedserve.loadtest.soak_mix import MIX, Outcome, Planned, check_full, check_stream, plan
from pagedserve.loadtest.soak_server import (
    LOOP_LAG_MAX,
    LagPoller,
    counter_delta,
    read_failure_counters,
    read_gauge,
    server_pid,
    wait_idle,
)
from pagedserve.loadtest.soak_summary import summarize
from pagedserve.loadtest.sse import SSEDecoder, StreamError

# The name the log lines have always carried (they came from loadtest/soak.py).
logger = logging.getLogger("pagedserve.loadtest.soak")


async def send(client: httpx.AsyncClient, p: Planned, timeout: float) -> Outcome:
    out = Outcome(p.index, p.kind)
    t0 = time.monotonic()
    try:
        await asyncio.wait_for(_send(client, p, out), timeout)
    except asyncio.TimeoutError:
        out.ok, out.error = False, f"no answer in {timeout:.0f} s (hang)"
    except (httpx.HTTPError, StreamError, ValueError) as e:
        out.ok, out.error = False, f"{type(e).__name__}: {e}"[:300]
    out.latency_s = time.monotonic() - t0
    if out.ok and out.status == 200:
        out.sequences = p.n
    return out


async def _send(client: httpx.AsyncClient, p: Planned, out: Outcome) -> None:
    kwargs = {"content": p.raw, "headers": {"content-type": "application/json"}} if p.raw is not None \
        else {"json": p.body}
    if p.accept_status is not None:  # hostile: served or refused, never a 5xx
        r = await client.post(p.path, **kwargs)
        out.status = r.status_code
        out.extra["hostile"] = p.note
        out.extra["hostile_size"] = p.size
        if r.status_code not in p.accept_status:
            out.ok, out.error = False, f"{p.note}: got {r.status_code} {r.text[:200]}"
            return
        body = r.json()
        out.ok = ("error" in body) == (r.status_code != 200)
        out.error = "" if out.ok else f"{p.note}: {r.status_code} with body {r.text[:200]}"
        return
    if not p.stream:
        r = await client.post(p.path, **kwargs)
        out.status = r.status_code
        if p.expect_status != 200:
            out.ok = r.status_code == p.expect_status and "error" in r.json()
            out.error = "" if out.ok else f"{p.note}: expected {p.expect_status}, got {r.status_code} {r.text[:200]}"
            return
        out.error = check_full(p, r.json()) if r.status_code == 200 else f"{r.status_code} {r.text[:200]}"
        out.ok = not out.error
        return
    async with client.stream("POST", p.path, **kwargs) as r:
        out.status = r.status_code
        if r.status_code != 200:
            out.error = f"{r.status_code} {(await r.aread())[:200]!r}"
            return
        if p.drop_after_events == 0:  # hang up right after the headers
            out.ok = out.aborted = True
            return
        decoder, finishes = SSEDecoder(), {}
        async for line in r.aiter_lines():
            event = decoder.feed(line)
            if event is None:
                continue
            if "error" in event:
                out.error = f"error event: {str(event['error'])[:200]}"
                return
            out.events += 1
            for c in event.get("choices") or []:
                if c.get("finish_reason"):
                    finishes[c["index"]] = c["finish_reason"]
            if p.drop_after_events is not None and out.events >= p.drop_after_events:
                # Leaving the block closes the connection mid-stream: an abort, unless the events
                # already held the end (a lagging client gets merged deltas, so a few events can
                # carry the whole stream; the server then counted it finished, not aborted).
                out.ok, out.aborted = True, not finishes
                return
        if p.drop_after_events is not None:
            out.error = f"a stream meant to be dropped ended after {out.events} events"
            return
        out.error = check_stream(p, finishes, decoder.done)
        out.ok = not out.error


def model_for(index: int, model: str, also: tuple[str, ...]) -> str:
    """The served name request ``index`` asks for: the base model and each of ``also`` in turn."""
    names = (model, *also)
    return names[index % len(names)]


async def _phase(cfg: SoakConfig, start: int, count: int, model: str, max_model_len: int,
                 outcomes: list[Outcome]) -> None:
    """Requests start..start+count at cfg.concurrency; the client and its connections are closed
    at the end so the server's fd count is read with no client attached."""
    limits = httpx.Limits(max_connections=cfg.concurrency, max_keepalive_connections=cfg.concurrency)
    timeout = httpx.Timeout(cfg.request_timeout, connect=30)
    next_index = iter(range(start, start + count))
    step = max(1, count // 10)

    async with httpx.AsyncClient(base_url=cfg.base_url, limits=limits, timeout=timeout) as client:
        async def worker() -> None:
            mix = {k: v for k, v in MIX.items() if k != "hostile"} if cfg.no_hostile else MIX
            for i in next_index:
                p = plan(i, seed=cfg.seed, model=model_for(i, model, cfg.also_models), max_model_len=max_model_len,
                         max_tokens=cfg.max_tokens, hostile_scale=cfg.hostile_scale, mix=mix)
                o = await send(client, p, cfg.request_timeout)
                outcomes.append(o)
                if not o.ok:
                    logger.warning("request %d (%s) failed: %s", i, p.kind, o.error)
                if cfg.progress and len(outcomes) % step == 0:
                    logger.info("%d requests done", len(outcomes))

        await asyncio.gather(*(worker() for _ in range(cfg.concurrency)))


async def _model_info(cfg: SoakConfig) -> tuple[str, int]:
    async with httpx.AsyncClient(base_url=cfg.base_url, timeout=30) as c:
        model = cfg.model or (await c.get("/v1/models")).json()["data"][0]["id"]
        if cfg.max_model_len:
            return model, cfg.max_model_len
        r = await c.post("/tokenize", json={"model": model, "prompt": "x"})
        return model, int(r.json().get("max_model_len") or 2048)


async def async_run_soak(cfg: SoakConfig) -> dict:
    model, max_model_len = await _model_info(cfg)
    pid = server_pid(cfg)
    if pid is None:
        logger.warning("no server pid (pass --server-pid): RSS and fd figures are left out")
    counters_before = await read_failure_counters(cfg.base_url)
    lag = LagPoller(cfg.base_url, cfg.lag_poll_s)
    lag.start()
    try:
        t0 = time.monotonic()
        warm_outcomes: list[Outcome] = []
        await _phase(cfg, 0, cfg.warmup, model, max_model_len, warm_outcomes)
        warm_gauges = await wait_idle(cfg.base_url, cfg.idle_timeout)
        warm = proctree.snapshot(pid) if pid else None
        t1 = time.monotonic()
        outcomes: list[Outcome] = []
        await _phase(cfg, cfg.warmup, cfg.requests, model, max_model_len, outcomes)
        t2 = time.monotonic()
        end_gauges = await wait_idle(cfg.base_url, cfg.idle_timeout)
        end = proctree.snapshot(pid) if pid else None
    finally:
        await lag.stop()
    counted = counter_delta(counters_before, await read_failure_counters(cfg.base_url))
    loop_lag = {"max_polled_s": lag.max_lag_s, "polls": lag.samples,
                "max_since_server_start_s": await read_gauge(cfg.base_url, LOOP_LAG_MAX)}
    return summarize(cfg, model, warm_outcomes, outcomes, warm_gauges, end_gauges, warm, end,
                     warmup_s=t1 - t0, run_s=t2 - t1, server_counted=counted, loop_lag=loop_lag)


def run_soak(cfg: SoakConfig) -> dict:
    """Callable from tests: the JSON summary as a dict."""
    return asyncio.run(async_run_soak(cfg))
