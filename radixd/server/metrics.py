"""Prometheus metrics of one server, in its own registry (no process-global state)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily

from radixd.server.engine_load import LoadReader

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class _EngineCollector:
    """Gauges read from the engine at scrape time (radixd's, then vLLM's and SGLang's names)."""

    def __init__(self, engine, load: LoadReader):
        self.engine = engine
        self.load = load

    def collect(self):
        st = self.engine.stats()
        for name, doc, value in (
            ("radixd_running_requests", "Requests in the running batch.", st["running"]),
            ("radixd_queued_requests", "Requests waiting to be admitted.", st["waiting"]),
            ("radixd_kv_usage_ratio", "Fraction of KV slots not free (in use or cached).", st["kv_usage"]),
            ("radixd_kv_slots_total", "KV slots in the pool.", st["kv"]["total"]),
            ("radixd_kv_slots_cached", "KV slots held by the radix cache.", st["kv"]["evictable"] + st["kv"]["locked"]),
            ("radixd_cache_hit_rate", "Prompt tokens served from the radix cache / prompt tokens.", st["cache_hit_rate"]),
            ("radixd_slow_consumer_aborts", "Calls aborted because their outputs were left unread past "
             "server.stream_buffer.", st["slow_consumer_aborts"]),
        ):
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], float(value))
            yield g
        replicas = st.get("replicas")
        if replicas:  # dp_size > 1: the same gauges per replica
            for name, doc, key in (
                ("radixd_replica_running_requests", "Requests in a replica's running batch.", "running"),
                ("radixd_replica_queued_requests", "Requests waiting for admission on a replica.", "waiting"),
                ("radixd_replica_kv_usage_ratio", "Fraction of a replica's KV slots not free.", "kv_usage"),
                ("radixd_replica_cache_hit_rate", "A replica's prompt tokens served from its cache / prompt tokens.",
                 "cache_hit_rate"),
            ):
                g = GaugeMetricFamily(name, doc, labels=["replica"])
                for i, per in enumerate(replicas):
                    g.add_metric([str(i)], float(per[key]))
                yield g
        yield from _tier_metrics(st.get("cache_tiers") or {})
        yield from self.load.families()
        if "spec_verifies" in st:  # speculative decoding is on
            yield from _spec_metrics(st)


SPEC_COUNTERS = (
    ("spec_verifies", "radixd_spec_verifies", "Verify entries run: a request checking its drafts in a step."),
    ("spec_draft_tokens", "radixd_spec_draft_tokens", "Drafted tokens verified."),
    ("spec_accepted_tokens", "radixd_spec_accepted_tokens", "Drafted tokens accepted."),
    # token trees (speculative.eagle_topk > 1)
    ("spec_tree_verifies", "radixd_spec_tree_verifies", "Verify entries of a token tree that branches."),
    ("spec_branch_accepted_tokens", "radixd_spec_branch_accepted_tokens",
     "Accepted tree nodes that were not their parent's first child (a chain would have missed them)."),
)


def _spec_metrics(st: dict):
    """Speculative decoding's counters, and since start: the share of drafted tokens accepted
    and the tokens a verify entry yields on average (its accepted drafts and the model's own)."""
    for key, name, doc in SPEC_COUNTERS:
        if key not in st:
            continue
        c = CounterMetricFamily(name, doc)
        c.add_metric([], float(st[key]))
        yield c
    v, d, a = st["spec_verifies"], st["spec_draft_tokens"], st["spec_accepted_tokens"]
    for name, doc, value in (
        ("radixd_spec_accept_rate", "Drafted tokens accepted / drafted tokens, since start.", a / d if d else 0.0),
        ("radixd_spec_accept_length", "Tokens per verify entry (accepted drafts and the model's own), since start.",
         (a + v) / v if v else 0.0),
    ):
        g = GaugeMetricFamily(name, doc)
        g.add_metric([], value)
        yield g


TIER_COUNTERS = (
    ("hits", "radixd_cache_tier_hits", "Pages loaded back into the KV pool from the tier."),
    ("tokens_loaded", "radixd_cache_tier_tokens_loaded", "Prompt tokens loaded from the tier instead of computed."),
    ("bytes_loaded", "radixd_cache_tier_loaded_bytes", "Bytes of KV loaded from the tier."),
    ("stores", "radixd_cache_tier_stores", "Pages written to the tier."),
    ("bytes_stored", "radixd_cache_tier_stored_bytes", "Bytes of KV written to the tier."),
    ("evictions", "radixd_cache_tier_evictions", "Pages the tier dropped for room."),
    ("prefetched", "radixd_cache_tier_prefetched", "Pages read from the tier ahead of need into host memory."),
    ("misses", "radixd_cache_tier_misses", "Pages looked for in the tier and not found."),
    ("errors", "radixd_cache_tier_errors", "Failed tier operations (unreachable, write failed, full): misses."),
    ("corrupt", "radixd_cache_tier_corrupt_pages", "Pages that failed their checksum or identity check: misses."),
)
TIER_GAUGES = (
    ("used_bytes", "radixd_cache_tier_used_bytes", "Bytes held by the tier."),
    ("capacity_bytes", "radixd_cache_tier_capacity_bytes", "The tier's size limit in bytes (0: none known)."),
)


def _tier_metrics(tiers: dict):
    """Per-tier counters, gauges and the load latency (a summary: count and sum)."""
    if not tiers:
        return
    for key, name, doc in TIER_COUNTERS:
        c = CounterMetricFamily(name, doc, labels=["tier"])
        for tier, st in tiers.items():
            c.add_metric([tier], float(st[key]))
        yield c
    for key, name, doc in TIER_GAUGES:
        g = GaugeMetricFamily(name, doc, labels=["tier"])
        for tier, st in tiers.items():
            g.add_metric([tier], float(st[key]))
        yield g
    s = SummaryMetricFamily("radixd_cache_tier_load_seconds", "Time to load a page from the tier.", labels=["tier"])
    for tier, st in tiers.items():
        s.add_metric([tier], count_value=float(st["hits"]), sum_value=float(st["load_seconds"]))
    yield s


class Metrics:
    def __init__(self, engine, model_name: str = ""):
        self.load = LoadReader(engine, model_name, engine.config.kv_events_block_size)
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
        self.plugin_faults = Counter("radixd_plugin_faults", "Plugin hook calls that raised or overran "
                                     "plugins.hook_timeout_s.", ["plugin", "hook", "kind"], registry=r)
        self.slow_clients = Counter("radixd_slow_clients", "Responses ended because a write to the client "
                                    "blocked past server.send_timeout_s.", registry=r)
        self.preemptions = Counter("radixd_preemptions", "Requests preempted for KV memory.", registry=r)
        r.register(_EngineCollector(engine, self.load))
