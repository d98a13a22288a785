"""Locust load test for any OpenAI-compatible server (pagedserve, vLLM, llama.cpp).

Each simulated user sends streaming chat / completion requests built by loadtest.workloads
(prompts sized with the server's /tokenize when it has one), reads the SSE stream to the
end and reports, next to the request totals, its own entries:

    TTFT   time to first content token, one per request
    ITL    gap between content events, one per gap
    TPOT   (end-to-end - TTFT) / (completion_tokens - 1), tokens from the server's usage

A request fails on a non-200, a malformed event, a dropped connection or a stream
without ``data: [DONE]``.

Headless run (64 requests at most, 16 users, 60 s at most, CSV + HTML report):

    locust -f loadtest/locustfile.py --headless -H http://127.0.0.1:8000 \\
        -u 16 -r 16 -t 60s --max-requests 64 \\
        --prompt-len 256 --output-len 128 --ignore-eos \\
        --endpoint-mix chat:1,completions:1 --csv results/locust --html results/locust.html

Options (each also from the environment variable in brackets):
  --model NAME            [LOCUST_MODEL]         default: the server's first model
  --api-key KEY           [OPENAI_API_KEY]
  --prompt-len N          [LOCUST_PROMPT_LEN]    prompt tokens (mean)
  --output-len N          [LOCUST_OUTPUT_LEN]    max_tokens (mean)
  --len-range-ratio R     [LOCUST_LEN_RANGE_RATIO] lengths uniform in mean*(1±R)
  --prefix-len N          [LOCUST_PREFIX_LEN]    >0: every prompt shares an N-token prefix
  --stream on|off         [LOCUST_STREAM]
  --endpoint-mix SPEC     [LOCUST_ENDPOINT_MIX]  e.g. chat:3,completions:1
  --ignore-eos            [LOCUST_IGNORE_EOS]
  --temperature T         [LOCUST_TEMPERATURE]
  --num-prompts N         [LOCUST_NUM_PROMPTS]   size of the prompt pool users draw from
  --tokenizer PATH        [LOCUST_TOKENIZER]     local tokenizer instead of the server's /tokenize
  --max-requests N        [LOCUST_MAX_REQUESTS]  stop the run after N requests (0 = no bound)
  --seed N                [LOCUST_SEED]
"""
from __future__ import annotations

import logging
import os
import random
import sys
import time

import gevent
import httpx
from locust import HttpUser, constant, events, task
from locust.exception import StopUser
from locust.stats import CSV_STATS_INTERVAL_SEC

try:
    from pagedserve.loadtest import workloads
    from pagedserve.loadtest.sse import SSEDecoder, StreamError
except ImportError:  # run from a checkout without the package installed
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from pagedserve.loadtest import workloads
    from pagedserve.loadtest.sse import SSEDecoder, StreamError

logger = logging.getLogger(__name__)

ENDPOINTS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


@events.init_command_line_parser.add_listener
def _add_options(parser) -> None:
    g = parser.add_argument_group("pagedserve workload")
    g.add_argument("--model", env_var="LOCUST_MODEL", default="", help="model name (default: server's first)")
    g.add_argument("--api-key", env_var="OPENAI_API_KEY", default="", help="bearer token")
    g.add_argument("--prompt-len", env_var="LOCUST_PROMPT_LEN", type=int, default=128)
    g.add_argument("--output-len", env_var="LOCUST_OUTPUT_LEN", type=int, default=64)
    g.add_argument("--len-range-ratio", env_var="LOCUST_LEN_RANGE_RATIO", type=float, default=0.0)
    g.add_argument("--prefix-len", env_var="LOCUST_PREFIX_LEN", type=int, default=0)
    g.add_argument("--stream", env_var="LOCUST_STREAM", choices=["on", "off"], default="on")
    g.add_argument("--endpoint-mix", env_var="LOCUST_ENDPOINT_MIX", default="chat:1,completions:1")
    g.add_argument("--ignore-eos", env_var="LOCUST_IGNORE_EOS", action="store_true", default=False)
    g.add_argument("--temperature", env_var="LOCUST_TEMPERATURE", type=float, default=0.0)
    g.add_argument("--num-prompts", env_var="LOCUST_NUM_PROMPTS", type=int, default=64)
    g.add_argument("--tokenizer", env_var="LOCUST_TOKENIZER", default="")
    g.add_argument("--max-requests", env_var="LOCUST_MAX_REQUESTS", type=int, default=0)
    g.add_argument("--seed", env_var="LOCUST_SEED", type=int, default=0)


def parse_mix(spec: str) -> list[tuple[str, float]]:
    out = []
    for part in spec.split(","):
        name, _, weight = part.strip().partition(":")
        if name not in ENDPOINTS:
            raise ValueError(f"--endpoint-mix: unknown endpoint {name!r} (use chat, completions)")
        out.append((name, float(weight or 1)))
    if not out or sum(w for _, w in out) <= 0:
        raise ValueError("--endpoint-mix needs at least one positive weight")
    return out


class _Shared:
    """Per-process run state: the prompt pool, the model, the request budget."""

    model: str = ""
    pool: list[workloads.SampleRequest] = []
    mix: list[tuple[str, float]] = []
    started = 0
    finished = 0


@events.test_start.add_listener
def _prepare(environment, **_kw) -> None:
    opts = environment.parsed_options
    host = (environment.host or "").rstrip("/")
    headers = {"Authorization": f"Bearer {opts.api_key}"} if opts.api_key else {}
    _Shared.mix = parse_mix(opts.endpoint_mix)
    _Shared.model = opts.model
    if not _Shared.model:
        r = httpx.get(f"{host}/v1/models", headers=headers, timeout=30)
        r.raise_for_status()
        _Shared.model = r.json()["data"][0]["id"]
    tok = workloads.load_tokenizer(opts.tokenizer or None, host, _Shared.model, headers)
    common = dict(input_len=opts.prompt_len, output_len=opts.output_len,
                  range_ratio=opts.len_range_ratio, seed=opts.seed)
    if opts.prefix_len > 0:
        _Shared.pool = workloads.build_requests("prefix", tok, opts.num_prompts, prefix_len=opts.prefix_len, **common)
    else:
        _Shared.pool = workloads.build_requests("random", tok, opts.num_prompts, **common)
    if hasattr(tok, "close"):
        tok.close()
    _Shared.started = _Shared.finished = 0
    logger.info("model %s, %d prompts, tokenizer %s", _Shared.model, len(_Shared.pool), tok.source)


class StreamFailure(Exception):
    pass


class LLMUser(HttpUser):
    wait_time = constant(0)

    def on_start(self) -> None:
        opts = self.environment.parsed_options
        self.opts = opts
        self.headers = {"Authorization": f"Bearer {opts.api_key}"} if opts.api_key else {}
        self.rng = random.Random()

    def _fire(self, request_type: str, name: str, ms: float) -> None:
        self.environment.events.request.fire(
            request_type=request_type, name=name, response_time=ms, response_length=0,
            exception=None, context={},
        )

    @task
    def generate(self) -> None:
        max_requests = self.opts.max_requests
        if max_requests and _Shared.started >= max_requests:
            raise StopUser()
        _Shared.started += 1
        kind = self.rng.choices([k for k, _ in _Shared.mix], weights=[w for _, w in _Shared.mix])[0]
        req = self.rng.choice(_Shared.pool)
        try:
            if self.opts.stream == "on":
                self._streaming(kind, req)
            else:
                self._plain(kind, req)
        finally:
            _Shared.finished += 1
            if max_requests and _Shared.finished >= max_requests and self.environment.runner is not None:
                # The --csv writer refreshes its files every CSV_STATS_INTERVAL_SEC and not at
                # shutdown: wait one refresh so the files hold the final figures.
                gevent.spawn_later(CSV_STATS_INTERVAL_SEC + 0.5, self.environment.runner.quit)

    def _body(self, kind: str, req: workloads.SampleRequest, stream: bool) -> dict:
        body = {"model": _Shared.model, "max_tokens": req.output_len, "temperature": self.opts.temperature,
                "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        if kind == "chat":
            body["messages"] = req.chat_messages()
        else:
            body["prompt"] = req.completion_prompt()
        if self.opts.ignore_eos:
            body["ignore_eos"] = True
        return body

    def _streaming(self, kind: str, req: workloads.SampleRequest) -> None:
        path = ENDPOINTS[kind]
        start = time.perf_counter()
        with self.client.post(path, json=self._body(kind, req, True), headers=self.headers, stream=True,
                              catch_response=True, name=path) as resp:
            ttft = None
            itls: list[float] = []
            last = start
            usage = None
            nbytes = 0
            sse = SSEDecoder()
            try:
                if resp.status_code != 200:
                    raise StreamFailure(f"HTTP {resp.status_code}: {resp.text[:200]}")
                for raw in resp.iter_lines():
                    nbytes += len(raw) + 1
                    event = sse.feed(raw.decode("utf-8", "replace"))
                    if event is None:
                        continue
                    if not isinstance(event.get("choices"), list):
                        raise StreamFailure(f"malformed event: {str(event)[:120]}")
                    if event.get("usage"):
                        usage = event["usage"]
                    text = ""
                    for ch in event["choices"]:
                        text += ((ch.get("delta") or {}).get("content") or "") if kind == "chat" else (ch.get("text") or "")
                    if text:
                        now = time.perf_counter()
                        if ttft is None:
                            ttft = now - start
                        else:
                            itls.append(now - last)
                        last = now
                sse.finish()
            except (StreamFailure, StreamError) as e:
                resp.request_meta["response_time"] = (time.perf_counter() - start) * 1000
                resp.failure(str(e))
                return
            except Exception as e:  # dropped connection, broken chunking, ...
                resp.request_meta["response_time"] = (time.perf_counter() - start) * 1000
                resp.failure(f"{type(e).__name__}: {e}"[:300])
                return
            e2e = time.perf_counter() - start
            resp.request_meta["response_time"] = e2e * 1000
            resp.request_meta["response_length"] = nbytes
            resp.success()
        name = kind
        if ttft is not None:
            self._fire("TTFT", name, ttft * 1000)
        for gap in itls:
            self._fire("ITL", name, gap * 1000)
        n = int((usage or {}).get("completion_tokens") or 0)
        if ttft is not None and n > 1:
            self._fire("TPOT", name, (e2e - ttft) * 1000 / (n - 1))

    def _plain(self, kind: str, req: workloads.SampleRequest) -> None:
        path = ENDPOINTS[kind]
        with self.client.post(path, json=self._body(kind, req, False), headers=self.headers,
                              catch_response=True, name=path) as resp:
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}: {resp.text[:200]}")
                return
            try:
                body = resp.json()
                if not body.get("choices"):
                    raise ValueError("no choices")
            except ValueError as e:
                resp.failure(f"malformed body: {e}")
                return
            resp.success()

