"""benchmarks/scale_sim.py runs (its --quick mode) and its model orders the routers as the
measured loopback runs do: cache-aware hits more than prefix hash, which hits more than round
robin, and needs no more replicas for the same TTFT p99."""

from __future__ import annotations

import json

from benchmarks import scale_sim


def test_quick_run_orders_the_routers(tmp_path):
    out = tmp_path / "sim.json"
    assert scale_sim.main(["--quick", "--output", str(out)]) == 0
    res = json.loads(out.read_text())
    assert {(r["policy"], r["replicas"]) for r in res["runs"]} == {(p, n) for p in scale_sim.POLICIES for n in (4, 8)}
    for n in (4, 8):
        hit = {r["policy"]: r["hit_rate"] for r in res["runs"] if r["replicas"] == n}
        assert hit["cache_aware"] > hit["prefix_hash"] > hit["round_robin"]
    need = res["needed"]
    assert need["cache_aware"] <= need["prefix_hash"] <= need["round_robin"]
    assert all(0 <= r["ttft_p50_s"] <= r["ttft_p99_s"] for r in res["runs"])
