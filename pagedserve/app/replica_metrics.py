"""/metrics per data-parallel replica (--data-parallel-size N > 1).

The totals keep their usual names (``pagedserve:num_requests_running`` etc., from
app.metrics.EngineStatsCollector: the replicas' figures added up), so dashboards built for one
engine keep working. Each replica's own figures come under ``pagedserve:replica_<name>`` with a
``replica`` label ("0", "1", ...): separate names, so ``sum()`` over a family never counts a
request twice. Also per replica: ``replica_up`` (1 while it takes requests), the requests the
router sent it and how many of those for a prefix it holds; and the router's own cost
(``router_decisions_total``, ``router_decision_seconds_total``: their ratio is the mean time
a routing decision takes).
"""
from __future__ import annotations

import logging
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pagedserve.app.metrics import PREFIX
from pagedserve.engine.replicas import ReplicatedEngine

logger = logging.getLogger(__name__)

_GAUGES = (
    ("num_requests_running", "Requests being computed on the replica.", "num_running"),
    ("num_requests_waiting", "Requests waiting on the replica.", "num_waiting"),
    ("kv_cache_usage_perc", "Fraction of the replica's KV-cache blocks in use (0-1).", "kv_cache_usage"),
)
_COUNTERS = (
    ("prefix_cache_queries", "Prompt tokens the replica looked up in its prefix cache.", "prefix_cache_queries"),
    ("prefix_cache_hits", "Prompt tokens found in the replica's prefix cache.", "prefix_cache_hits"),
    ("num_preemptions", "Requests the replica preempted.", "num_preemptions"),
    ("worker_restarts", "Times the replica's worker pool was rebuilt.", "num_worker_restarts"),
)


class ReplicaStatsCollector:
    """Reads engine.replicas.ReplicatedEngine at scrape time (app.server registers it for one)."""

    def __init__(self, engine: ReplicatedEngine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def describe(self):
        return []

    def collect(self):
        e = self.engine
        try:
            stats = e.replica_stats()
            states = e.replica_states()
        except Exception:  # a broken replica must not break /metrics
            logger.warning("replica stats failed; per-replica metrics omitted", exc_info=True)
            return
        labels = ["model_name", "replica"]
        rows = [[self.model_name, str(i)] for i in range(len(stats))]

        def family(kind, name, doc, values):
            f = kind(PREFIX + "replica_" + name, doc, labels=labels)
            for row, v in zip(rows, values):
                if v is not None:
                    f.add_metric(row, float(v))
            return f

        yield family(GaugeMetricFamily, "up", "1 while the replica takes requests, else 0 (dead or "
                     "restarting its workers).", [1 if s == "ok" else 0 for s in states])
        for name, doc, attr in _GAUGES:
            yield family(GaugeMetricFamily, name, doc, [getattr(s, attr) if s else None for s in stats])
        for name, doc, attr in _COUNTERS:
            yield family(CounterMetricFamily, name, doc, [getattr(s, attr) if s else None for s in stats])
        yield family(CounterMetricFamily, "engine_deaths", "Times the replica's engine stopped on a "
                     "failure.", [r.num_deaths for r in e.replicas])
        yield family(CounterMetricFamily, "requests_routed", "Requests the router sent to the replica.",
                     e.num_routed)
        yield family(CounterMetricFamily, "requests_prefix_routed", "Requests sent to the replica "
                     "because it holds (part of) their prompt prefix.", e.num_prefix_routed)
        c = CounterMetricFamily(PREFIX + "router_decisions", "Routing decisions made.", labels=["model_name"])
        c.add_metric([self.model_name], float(e.num_decisions))
        yield c
        c = CounterMetricFamily(PREFIX + "router_decision_seconds", "Time spent choosing replicas "
                                "(prefix hashing included).", labels=["model_name"])
        c.add_metric([self.model_name], e.decision_ns / 1e9)
        yield c
