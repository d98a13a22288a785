"""One streamed request of `bench serve`: the payload, and the timing of its chunks; every
failure is recorded in its RequestResult, never raised, so one broken request cannot end a run.
"""
from __future__ import annotations

import time

import httpx

from pagedserve.loadtest import workloads
from pagedserve.loadtest.bench_config import BenchConfig, RequestResult
from pagedserve.loadtest.sse import SSEDecoder, StreamError


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
