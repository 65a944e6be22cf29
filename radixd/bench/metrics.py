"""The figures of one run, computed from its per-request records."""

from __future__ import annotations

import math

from radixd.bench.targets import Record

MAX_ERROR_MESSAGES = 5


def summary(values: list[float]) -> dict | None:
    """mean, median, p90, p95, p99, min, max, std of ``values`` (None when empty)."""
    if not values:
        return None
    import numpy as np

    a = np.asarray(values, dtype=float)
    p50, p90, p95, p99 = np.percentile(a, [50, 90, 95, 99])
    return {"mean": float(a.mean()), "median": float(p50), "p90": float(p90), "p95": float(p95),
            "p99": float(p99), "min": float(a.min()), "max": float(a.max()), "std": float(a.std()),
            "count": int(a.size)}


def figures(records: list[Record], duration_s: float, cache_before: dict | None = None,
            cache_after: dict | None = None) -> dict:
    """Throughputs, latency summaries, cache hit rate and errors. Token totals and latencies
    are over the requests that succeeded; failed ones are counted under ``errors``."""
    ok = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    duration_s = max(duration_s, 1e-9)
    output_tokens = sum(r.output_tokens for r in ok)
    usage_prompt = [r.usage_prompt_tokens for r in ok]
    # input tokens as the server counted them (chat template included) when every reply says so
    input_from_usage = bool(ok) and all(u is not None for u in usage_prompt)
    input_tokens = sum(usage_prompt) if input_from_usage else sum(r.prompt_tokens for r in ok)
    usage_completion = [r.usage_completion_tokens for r in ok]
    usage_cached = [r.usage_cached_tokens for r in ok]

    hit = None
    cache = {"source": None, "prompt_tokens": None, "cached_tokens": None}
    if cache_before is not None and cache_after is not None:
        prompt = cache_after["prompt_tokens"] - cache_before["prompt_tokens"]
        cached = cache_after["cached_tokens"] - cache_before["cached_tokens"]
        cache = {"source": cache_after["source"], "prompt_tokens": int(prompt), "cached_tokens": int(cached)}
        hit = cached / prompt if prompt > 0 else None
    usage_hit = None
    if input_from_usage and ok and all(c is not None for c in usage_cached) and sum(usage_prompt) > 0:
        usage_hit = sum(usage_cached) / sum(usage_prompt)

    by_status: dict[str, int] = {}
    for r in failed:
        key = str(r.status) if r.status is not None else "no response"
        by_status[key] = by_status.get(key, 0) + 1
    first: list[str] = []
    for r in failed:
        if r.error not in first:
            first.append(r.error)
        if len(first) == MAX_ERROR_MESSAGES:
            break

    return {
        "duration_s": duration_s,
        "requests": len(records),
        "completed": len(ok),
        "failed": len(failed),
        "input_tokens": input_tokens,
        "input_tokens_source": "server usage" if input_from_usage else "client count",
        "output_tokens": output_tokens,
        "usage_completion_tokens": sum(usage_completion) if ok and all(u is not None for u in usage_completion) else None,
        "request_throughput": len(ok) / duration_s,
        "input_token_throughput": input_tokens / duration_s,
        "output_token_throughput": output_tokens / duration_s,
        "total_token_throughput": (input_tokens + output_tokens) / duration_s,
        "concurrency": sum(r.e2e_ms for r in ok if r.e2e_ms is not None) / 1000 / duration_s,
        "ttft_ms": summary([r.ttft_ms for r in ok if r.ttft_ms is not None]),
        "itl_ms": summary([x for r in ok for x in r.itl_ms]),
        "tpot_ms": summary([t for r in ok if (t := r.tpot_ms) is not None]),
        "e2e_ms": summary([r.e2e_ms for r in ok if r.e2e_ms is not None]),
        "cache_hit_rate": hit,
        "cache": cache,
        "cache_hit_rate_usage": usage_hit,
        "errors": {"count": len(failed), "by_status": by_status, "first": first},
    }


# the figures ``compare`` puts side by side: (path, label, higher is better)
MAIN_FIGURES = [
    (("request_throughput",), "request throughput (req/s)", True),
    (("input_token_throughput",), "input token throughput (tok/s)", True),
    (("output_token_throughput",), "output token throughput (tok/s)", True),
    (("total_token_throughput",), "total token throughput (tok/s)", True),
    (("ttft_ms", "mean"), "TTFT mean (ms)", False),
    (("ttft_ms", "median"), "TTFT median (ms)", False),
    (("ttft_ms", "p99"), "TTFT p99 (ms)", False),
    (("itl_ms", "mean"), "ITL mean (ms)", False),
    (("itl_ms", "median"), "ITL median (ms)", False),
    (("itl_ms", "p95"), "ITL p95 (ms)", False),
    (("itl_ms", "p99"), "ITL p99 (ms)", False),
    (("tpot_ms", "median"), "TPOT median (ms)", False),
    (("e2e_ms", "mean"), "E2E mean (ms)", False),
    (("e2e_ms", "median"), "E2E median (ms)", False),
    (("e2e_ms", "p99"), "E2E p99 (ms)", False),
    (("cache_hit_rate",), "cache hit rate", True),
    (("failed",), "failed requests", False),
]


def lookup(figs: dict, path: tuple[str, ...]) -> float | None:
    v = figs
    for key in path:
        if not isinstance(v, dict):
            return None
        v = v.get(key)
    if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
        return float(v)
    return None
