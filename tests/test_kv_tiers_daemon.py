"""A daemon restarted on the same disk tier serves a long prefix of its predecessor from disk:
the cache hit is reported, the time to first token is lower than the cold one, and the output
is unchanged. A real ``radixd`` subprocess on the default model."""

from __future__ import annotations

import json
import random
import re
import time

import httpx
import pytest
from conftest import Daemon

pytestmark = pytest.mark.slow

TOML = """
[model]
# converted weights: native ones multiply a prompt's last tokens with torch's int4 kernel when
# the rest comes from a tier (16 rows or fewer) and with a dequantized GEMM when computed
# whole, and the two round differently (this test compares the outputs of the two)
gguf_weights = "fp32"
[server]
port = 0
[memory]
kv_cache_tokens = 4096
[cache]
tiers = ["host", "disk"]
write_policy = "write_through"
[cache.disk]
path = "{path}"
"""


def stream_generate(url: str, ids: list[int], max_new: int = 8) -> tuple[list[int], float, int]:
    """Output ids, time to the first token (s) and the cached prompt tokens reported."""
    body = {"input_ids": ids, "stream": True, "sampling_params": {"max_new_tokens": max_new, "temperature": 0.0,
                                                                   "ignore_eos": True}}
    out: list[int] = []
    ttft, cached = None, 0
    t0 = time.perf_counter()
    with httpx.stream("POST", url + "/generate", json=body, timeout=300) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            event = json.loads(line[5:])
            ids_now = event.get("output_ids") or []
            if ids_now and ttft is None:
                ttft = time.perf_counter() - t0
            out = ids_now if len(ids_now) >= len(out) else out + ids_now
            cached = event.get("meta_info", {}).get("cached_tokens", cached) or cached
    assert ttft is not None
    return out, ttft, cached


def metric(url: str, name: str, tier: str) -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    m = re.search(rf'^{name}\{{tier="{tier}"\}} (\S+)$', text, re.M)
    assert m, f"{name} for {tier} not in /metrics"
    return float(m[1])


def test_restarted_daemon_serves_the_prefix_from_disk(tmp_path):
    kv = tmp_path / "kv"
    rng = random.Random(0)
    prompt = [rng.randrange(100, 40000) for _ in range(1500)]
    warm = [rng.randrange(100, 40000) for _ in range(20)]
    runs = []
    for i in range(2):
        (tmp_path / f"d{i}").mkdir()
        d = Daemon(tmp_path / f"d{i}", TOML.format(path=kv))
        try:
            stream_generate(d.url, warm, 2)  # first-request costs paid on an unrelated prompt
            # pages come from disk, directly or prefetched into the (new, empty) host tier first
            before = sum(metric(d.url, "radixd_cache_tier_tokens_loaded_total", t) for t in ("host", "disk"))
            out, ttft, cached = stream_generate(d.url, prompt)
            loaded = sum(metric(d.url, "radixd_cache_tier_tokens_loaded_total", t) for t in ("host", "disk")) - before
            runs.append((out, ttft, cached, loaded))
            print(f"daemon {i}: ttft {ttft * 1000:.0f} ms, cached {cached}, loaded from tiers {loaded:.0f}")
        finally:
            assert d.stop() == 0
        if i == 0:
            assert list(kv.glob("*/*.kv")), "the first daemon left no page files"
    (cold_out, cold_ttft, cold_cached, cold_loaded), (warm_out, warm_ttft, warm_cached, warm_loaded) = runs
    assert cold_cached == 0 and cold_loaded == 0
    assert warm_out == cold_out
    assert warm_cached == 1488 and warm_loaded == 1488  # 93 whole pages of the 1499 looked up
    assert warm_ttft < cold_ttft, (warm_ttft, cold_ttft)
