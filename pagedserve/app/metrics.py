"""Prometheus metrics, one CollectorRegistry per app (so tests can build several apps).

Engine-side figures (running / waiting requests, KV usage, prefix-cache and preemption counters,
engine deaths, worker restarts) are read from the engine at scrape time by a custom collector;
per-request figures (tokens, finish reasons, latencies) are recorded by the routes through
``RequestTracker``.

Failures are counted, not only successes (an operator must see them on a dashboard):

- ``request_success_total{finished_reason}``: one per sequence that ended: ``stop``, ``length``
  or ``abort`` (the client went away or cancelled; vLLM's label values).
- ``request_errors_total{reason}``: one per sequence the server failed: ``engine_error`` (the
  engine failed the request), ``engine_dead`` (the engine stopped under it), ``internal_error``.
- ``http_error_responses_total{status_code}``: every HTTP response with a status >= 400
  (4xx by code; 499 = a client that left before a non-streaming answer).
- ``request_overloaded_total``: requests refused with 503 + Retry-After because
  ``--max-waiting-requests`` were already waiting (also counted under status_code 503).
- ``event_loop_lag_seconds`` / ``event_loop_lag_max_seconds``: how late the event loop woke a
  task sleeping 50 ms, worst in the last 10 s / since start (app/loop_lag.py): a stalled loop
  stalls every stream and /health.
- ``engine_deaths_total`` (failures the engine did not recover from) / ``worker_restarts_total``
  (failures recovered by rebuilding the workers, ``--restart-workers``): from the engine.
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

if TYPE_CHECKING:
    from pagedserve.engine.client import EngineClient

logger = logging.getLogger(__name__)

PREFIX = "pagedserve:"

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
LATENCY_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0)


class EngineStatsCollector:
    """Reads the engine's stats at each scrape: gauges now, counters cumulative since start."""

    def __init__(self, engine: EngineClient, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def describe(self):  # registered without calling collect() (the engine may not be up yet)
        return []

    def collect(self):
        try:
            s = self.engine.stats()
        except Exception:  # a dead engine must not break /metrics
            logger.warning("pagedserve.engine.stats() failed; engine metrics omitted", exc_info=True)
            return
        labels = ["model_name"]
        value = [self.model_name]
        for name, doc, v in (
            ("num_requests_running", "Requests being computed on the device.", s.num_running),
            ("num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting),
            ("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).", s.kv_cache_usage),
        ):
            g = GaugeMetricFamily(PREFIX + name, doc, labels=labels)
            g.add_metric(value, float(v))
            yield g
        for name, doc, v in (
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
             s.prefix_cache_queries),
            ("prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_cache_hits),
            ("num_preemptions", "Requests preempted (recomputed later).", s.num_preemptions),
        ):
            c = CounterMetricFamily(PREFIX + name, doc, labels=labels)
            c.add_metric(value, float(v))
            yield c
        if s.max_lora:
            # vLLM's vllm:lora_requests_info: the adapters in the labels, the time of this reading
            # as the value.
            g = GaugeMetricFamily(PREFIX + "lora_requests_info", "Running and waiting LoRA adapters (names, "
                                  "comma-separated) and --max-loras.",
                                  labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
            g.add_metric([str(s.max_lora), ",".join(s.lora_running), ",".join(s.lora_waiting)], time.time())
            yield g
        yield from _spec_decode_metrics(s, labels, value)
        for name, doc, v in (
            ("engine_deaths", "Times the engine stopped on a failure it did not recover from "
             "(a worker died or hung, the loop crashed).", self.engine.num_deaths),
            ("worker_restarts", "Times the worker pool was rebuilt after a failure "
             "(--restart-workers).", s.num_worker_restarts),
        ):
            c = CounterMetricFamily(PREFIX + name, doc, labels=labels)
            c.add_metric(value, float(v))
            yield c


def _spec_decode_metrics(s, labels: list[str], value: list[str]):
    """Speculative decoding counters (vLLM's spec_decode_* names); always present, 0 when off."""
    for name, doc, v in (
        ("spec_decode_num_drafts", "Draft runs proposed (one per speculating sequence per step).",
         s.spec_decode_num_drafts),
        ("spec_decode_num_draft_tokens", "Draft tokens proposed.", s.spec_decode_num_draft_tokens),
        ("spec_decode_num_accepted_tokens", "Draft tokens accepted.", s.spec_decode_num_accepted_tokens),
    ):
        c = CounterMetricFamily(PREFIX + name, doc, labels=labels)
        c.add_metric(value, float(v))
        yield c
    c = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                            "Draft tokens accepted, by position in the draft run.", labels=labels + ["position"])
    for pos, v in enumerate(s.spec_decode_num_accepted_tokens_per_pos):
        c.add_metric(value + [str(pos)], float(v))
    yield c


class LoopLagCollector:
    def __init__(self, monitor: Any) -> None:
        self.monitor = monitor

    def describe(self):
        return []

    def collect(self):
        for name, doc, v in (
            ("event_loop_lag_seconds", "Worst lateness of a 50 ms sleep on the event loop in the last "
             "10 s (a block still in progress included): time every stream and /health stood still.",
             self.monitor.current()),
            ("event_loop_lag_max_seconds", "Worst lateness of a 50 ms sleep on the event loop since the "
             "server started.", self.monitor.max_since_start()),
        ):
            g = GaugeMetricFamily(PREFIX + name, doc)
            g.add_metric([], float(v))
            yield g


class ServerMetrics:
    def __init__(self, engine: EngineClient, model_name: str, per_replica: Any = None) -> None:
        """``per_replica``: the collector of each data-parallel replica's figures
        (app.replica_metrics), for an engine with replicas."""
        disable_created_metrics()  # the *_created samples only add noise to every scrape
        self.registry = CollectorRegistry()
        self.model_name = model_name
        r = self.registry
        self.registry.register(EngineStatsCollector(engine, model_name))
        from pagedserve.app.loop_lag import LoopLagMonitor

        self.loop_lag = LoopLagMonitor()  # started on the server's loop (serve, or the first request)
        self.registry.register(LoopLagCollector(self.loop_lag))
        if per_replica is not None:
            self.registry.register(per_replica)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens processed.",
                                     ["model_name"], registry=r).labels(model_name)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Tokens generated.",
                                         ["model_name"], registry=r).labels(model_name)
        self._success = Counter(PREFIX + "request_success", "Finished sequences by finish reason.",
                                ["model_name", "finished_reason"], registry=r)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time to first token.",
                              ["model_name"], buckets=TTFT_BUCKETS, registry=r).labels(model_name)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Time between output tokens.",
                             ["model_name"], buckets=ITL_BUCKETS, registry=r).labels(model_name)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Request latency, arrival to "
                             "last token.", ["model_name"], buckets=LATENCY_BUCKETS,
                             registry=r).labels(model_name)
        self.queue_time = Histogram(PREFIX + "request_queue_time_seconds", "Time from arrival to "
                                    "first scheduling.", ["model_name"], buckets=LATENCY_BUCKETS,
                                    registry=r).labels(model_name)
        self._errors = Counter(PREFIX + "request_errors", "Sequences the server failed, by reason "
                               "(engine_error, engine_dead, internal_error).",
                               ["model_name", "reason"], registry=r)
        self._http_errors = Counter(PREFIX + "http_error_responses", "HTTP responses with a status "
                                    ">= 400, by status code.", ["model_name", "status_code"],
                                    registry=r)
        self.overloaded = Counter(PREFIX + "request_overloaded", "Requests refused with 503 because "
                                  "too many were waiting (--max-waiting-requests).", ["model_name"],
                                  registry=r).labels(model_name)
        # The label sets always present (at 0) so dashboards and rate() see them from the start.
        for reason in ("stop", "length", "abort"):
            self._success.labels(model_name, reason)
        for reason in ("engine_error", "engine_dead", "internal_error"):
            self._errors.labels(model_name, reason)

    def success(self, reason: str) -> None:
        self._success.labels(self.model_name, reason).inc()

    def error(self, reason: str) -> None:
        self._errors.labels(self.model_name, reason).inc()

    def http_error(self, status: int) -> None:
        self._http_errors.labels(self.model_name, str(status)).inc()

    def refused(self, exc: BaseException) -> None:
        """A request the engine would not take: counted when the cause is too many waiting
        requests (a 503 while the workers restart is not an overload)."""
        from pagedserve.engine.errors import EngineOverloadedError, EngineRestartingError

        if isinstance(exc, EngineOverloadedError) and not isinstance(exc, EngineRestartingError):
            self.overloaded.inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def tracker(self) -> "RequestTracker":
        return RequestTracker(self)


class RequestTracker:
    """Latency bookkeeping for one engine request (one sequence of one prompt).

    Token times come from the engine (``CompletionOutput.token_times``, stamped when the step's
    output was processed), so a client that reads slowly, and gets several tokens merged into
    one delta, does not inflate TTFT or inter-token latency. Without engine stamps (a stand-in
    engine) the time the delta is read is the best estimate."""

    __slots__ = ("m", "arrival", "first", "last", "num_tokens", "done", "queue_observed")

    def __init__(self, metrics: ServerMetrics) -> None:
        self.m = metrics
        self.arrival = time.monotonic()
        self.first: float | None = None
        self.last: float | None = None
        self.num_tokens = 0
        self.done = False
        self.queue_observed = False

    def on_output(self, output: Any, num_new_tokens: int, token_times: list[float] | None = None) -> None:
        if not num_new_tokens:
            return
        if token_times is None or len(token_times) != num_new_tokens:
            token_times = [time.monotonic()] * num_new_tokens
        for t in token_times:
            if self.first is None:
                self.first = t
                self.m.ttft.observe(max(0.0, t - self.arrival))
                self._observe_queue(output)
            else:
                self.m.itl.observe(max(0.0, t - self.last))
            self.last = t
        self.num_tokens += num_new_tokens

    def _observe_queue(self, output: Any) -> None:
        metrics = output.metrics
        if metrics is not None and metrics.first_scheduled_time is not None:
            self.m.queue_time.observe(max(0.0, metrics.first_scheduled_time - metrics.arrival_time))
            self.queue_observed = True

    def finish(self, finish_reason: str | None, error_reason: str = "internal_error") -> None:
        """``finish_reason``: stop / length / abort, or error (then ``error_reason`` says which)."""
        if self.done:
            return
        self.done = True
        # A request that ran to its end is timed to its last token as the engine produced it.
        end = self.last if finish_reason in ("stop", "length") and self.last is not None else time.monotonic()
        self.m.e2e.observe(max(0.0, end - self.arrival))
        if not self.queue_observed and self.first is not None:
            # Without engine timestamps, the best bound on queueing is the time to first token.
            self.m.queue_time.observe(self.first - self.arrival)
        if finish_reason in ("stop", "length", "abort"):
            self.m.success(finish_reason)
        elif finish_reason == "error":
            self.m.error(error_reason)


class HTTPErrorCounter:
    """ASGI middleware: counts every response with status >= 400 by code, whichever layer made
    it (auth, routing, validation, the routes)."""

    def __init__(self, app: Any, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if not self.metrics.loop_lag.running:  # a server built without `serve` (tests, embedding)
            self.metrics.loop_lag.start()

        async def counting_send(message: dict) -> None:
            if message["type"] == "http.response.start" and message["status"] >= 400:
                self.metrics.http_error(message["status"])
            await send(message)

        await self.app(scope, receive, counting_send)
