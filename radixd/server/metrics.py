"""Prometheus metrics of one server, in its own registry (no process-global state)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class _EngineCollector:
    """Gauges read from the engine at scrape time."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        st = self.engine.stats()
        for name, doc, value in (
            ("radixd_running_requests", "Requests in the running batch.", st["running"]),
            ("radixd_queued_requests", "Requests waiting to be admitted.", st["waiting"]),
            ("radixd_kv_usage_ratio", "Fraction of KV slots not free (in use or cached).", st["kv_usage"]),
            ("radixd_kv_slots_total", "KV slots in the pool.", st["kv"]["total"]),
            ("radixd_kv_slots_cached", "KV slots held by the radix cache.", st["kv"]["evictable"] + st["kv"]["locked"]),
            ("radixd_cache_hit_rate", "Prompt tokens served from the radix cache / prompt tokens.", st["cache_hit_rate"]),
        ):
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], float(value))
            yield g


class Metrics:
    def __init__(self, engine):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("radixd_requests", "Finished HTTP requests by route and status.",
                                ["route", "status"], registry=r)
        self.prompt_tokens = Counter("radixd_prompt_tokens", "Prompt tokens of generation requests.", registry=r)
        self.generation_tokens = Counter("radixd_generation_tokens", "Generated tokens.", registry=r)
        self.cached_tokens = Counter("radixd_cached_prompt_tokens", "Prompt tokens served from the cache.", registry=r)
        self.ttft = Histogram("radixd_time_to_first_token_seconds", "Time to first token.",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("radixd_inter_token_latency_seconds", "Time between streamed tokens.",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("radixd_e2e_request_latency_seconds", "Request latency, end to end.",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.preemptions = Counter("radixd_preemptions", "Requests preempted for KV memory.", registry=r)
        r.register(_EngineCollector(engine))
