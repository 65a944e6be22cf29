"""The daemon's load as gateways read it: SGLang's ``GET /v1/loads`` body (what SGLang's
gateway ``smg`` polls for its load-aware policies) and the Prometheus gauges of the model-server
protocol of Kubernetes' Gateway API Inference Extension, under vLLM's names (``vllm:``, which
llm-d's endpoint picker scrapes by default) and SGLang's (``sglang:``).

One ``ReplicaLoad`` per replica (a vLLM "engine", an SGLang DP rank), read from
``Engine.stats()`` at call time; ``LoadReader`` is owned by the server's ``Metrics`` and read by
the handlers of the event loop only. Used tokens are those running requests hold (locked in the
radix tree or private to them), not the cache's evictable ones: that is vLLM's
``kv_cache_usage_perc`` (a cached block nobody references is free) and SGLang's
``token_usage``. radixd's pool is token-granular; ``cache_config_info`` reports it in blocks
of ``block_size`` tokens, the unit radixd's KV-cache events use (``[kv_events] block_size``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import UTC, datetime

from prometheus_client.core import GaugeMetricFamily

from radixd import __version__
from radixd.server.errors import ApiError

# SGLang's /v1/loads sections; radixd reports the "core" figures, the others have nothing to say
LOAD_SECTIONS = ("core", "memory", "spec", "lora", "disagg", "queues", "all")


@dataclass
class ReplicaLoad:
    rank: int
    running: int
    waiting: int
    used_tokens: int
    total_tokens: int
    cache_hit_rate: float
    gen_throughput: float   # generated tokens per second since the previous reading

    @property
    def token_usage(self) -> float:
        return self.used_tokens / self.total_tokens if self.total_tokens else 0.0


class LoadReader:
    """Per-replica load figures. The generation rate is taken over at least a second: each
    replica's generated-token counter is remembered with the rate last computed from it."""

    def __init__(self, engine, model_name: str, block_size: int):
        self.engine = engine
        self.model_name = model_name
        self.block_size = block_size
        self._last: dict[int, tuple[float, int, float]] = {}  # rank -> (when, tokens, rate)

    def replicas(self) -> list[ReplicaLoad]:
        st = self.engine.stats()
        now = time.monotonic()
        out = []
        for rank, per in enumerate(st.get("replicas") or [st]):
            kv = per["kv"]
            tokens = per["decode_tokens"]
            then, before, rate = self._last.get(rank, (now, tokens, 0.0))
            if now - then >= 1.0:
                rate = (tokens - before) / (now - then)
            if now - then >= 1.0 or rank not in self._last:
                self._last[rank] = (now, tokens, rate)
            out.append(ReplicaLoad(rank=rank, running=per["running"], waiting=per["waiting"],
                                   used_tokens=kv["locked"] + kv["private"], total_tokens=kv["total"],
                                   cache_hit_rate=per["cache_hit_rate"], gen_throughput=rate))
        return out

    def loads_body(self, max_running: int) -> dict:
        """SGLang's ``/v1/loads`` answer: one entry per DP rank, and their sums."""
        loads = [{
            "dp_rank": r.rank, "num_running_reqs": r.running, "num_waiting_reqs": r.waiting,
            "num_total_reqs": r.running + r.waiting, "num_used_tokens": r.used_tokens,
            "max_total_num_tokens": r.total_tokens, "token_usage": round(r.token_usage, 6),
            "gen_throughput": round(r.gen_throughput, 3), "cache_hit_rate": round(r.cache_hit_rate, 6),
            "max_running_requests": max_running,
        } for r in self.replicas()]
        total = sum(x["max_total_num_tokens"] for x in loads)
        used = sum(x["num_used_tokens"] for x in loads)
        return {
            "timestamp": datetime.now(UTC).isoformat(), "version": __version__, "dp_rank_count": len(loads),
            "loads": loads,
            "aggregate": {"total_running_reqs": sum(x["num_running_reqs"] for x in loads),
                          "total_waiting_reqs": sum(x["num_waiting_reqs"] for x in loads),
                          "total_reqs": sum(x["num_total_reqs"] for x in loads),
                          "avg_token_usage": used / total if total else 0.0,
                          "avg_throughput": sum(x["gen_throughput"] for x in loads) / len(loads)},
        }

    def families(self):
        """The ``vllm:`` and ``sglang:`` gauge families, one sample per replica."""
        reps = self.replicas()
        engine_labels = ["model_name", "engine"]  # vLLM's: an engine is one data-parallel rank
        sglang_labels = ["model_name", "dp_rank"]
        yield from self._gauges(reps, engine_labels, (
            ("vllm:num_requests_running", "Number of requests in model execution batches.", lambda r: r.running),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", lambda r: r.waiting),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", lambda r: r.token_usage),
        ))
        info = GaugeMetricFamily("vllm:cache_config_info", "Information of the KV cache configuration.",
                                 labels=["block_size", "num_gpu_blocks", "enable_prefix_caching", "cache_dtype",
                                         "engine"])
        for r in reps:
            info.add_metric([str(self.block_size), str(r.total_tokens // self.block_size),
                             str(self.engine.config.radix_cache), self.engine.config.kv_cache_dtype,
                             str(r.rank)], 1.0)
        yield info
        yield from self._gauges(reps, sglang_labels, (
            ("sglang:num_running_reqs", "The number of running requests.", lambda r: r.running),
            ("sglang:num_queue_reqs", "The number of requests in the waiting queue.", lambda r: r.waiting),
            ("sglang:num_used_tokens", "The number of used tokens.", lambda r: r.used_tokens),
            ("sglang:max_total_num_tokens", "Maximum total number of tokens in the KV pool.", lambda r: r.total_tokens),
            ("sglang:token_usage", "The token usage.", lambda r: r.token_usage),
            ("sglang:cache_hit_rate", "The prefix cache hit rate.", lambda r: r.cache_hit_rate),
            ("sglang:gen_throughput", "The generation throughput (token/s).", lambda r: r.gen_throughput),
        ))
        info = GaugeMetricFamily("sglang:cache_config_info", "Information of the KV cache configuration.",
                                 labels=["page_size", "num_pages", "model_name", "dp_rank"])
        for r in reps:
            info.add_metric([str(self.block_size), str(r.total_tokens // self.block_size), self.model_name,
                             str(r.rank)], 1.0)
        yield info

    def _gauges(self, reps, labels: list[str], table):
        """One gauge family per (name, doc, value of a replica) row, a sample per replica
        labelled (model name, its rank)."""
        for name, doc, value in table:
            g = GaugeMetricFamily(name, doc, labels=labels)
            for r in reps:
                g.add_metric([self.model_name, str(r.rank)], float(value(r)))
            yield g


def check_include(include: str | None) -> None:
    """``include`` of ``/v1/loads``: comma-separated section names (SGLang refuses others)."""
    for part in (include or "").split(","):
        if part.strip() and part.strip() not in LOAD_SECTIONS:
            raise ApiError(400, f"'include' names an unknown section {part.strip()!r} (one of "
                                f"{', '.join(LOAD_SECTIONS)})", param="include")
