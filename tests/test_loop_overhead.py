"""benchmarks/loop_overhead.py (the batching loop's CPU per decode step, forward pass stubbed),
sim_device.py and http_itl.py run end to end at a small size and report consistent figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_loop_overhead_bench_runs(tmp_path):
    r = subprocess.run([sys.executable, "-m", "benchmarks.loop_overhead", "--requests", "8", "--new-tokens", "12",
                        "--repeats", "1", "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads((tmp_path / "loop_overhead.json").read_text())["results"]
    assert [(x["tokenizer"], x["requests"]) for x in res] == [(False, 8), (True, 8)]
    for x in res:
        assert x["output_tokens"] == 8 * 12  # the stub's picks reached every consumer
        assert x["decode_steps_timed"] >= 8  # one prefill step, then every request decodes
        assert x["us_per_step_median"] > 0
        # (the figures are rounded to 0.1 and 0.01 us: they may differ by 0.05 / 8 + 0.005)
        assert abs(x["us_per_request_step_median"] - x["us_per_step_median"] / 8) < 0.012
        assert "_build" in x["profile_tottime"] or "_build" in x["profile_cumulative"]
    assert (tmp_path / "log.txt").read_text().count("us/request-step") == 2


SMALL_BURST = ["--groups", "4", "--per-group", "4", "--system", "64", "--question", "16", "--new", "8",
               "--max-running", "8"]


def _run(module: str, *args: str) -> dict:
    r = subprocess.run([sys.executable, "-m", f"benchmarks.{module}", *args], cwd=ROOT, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads(r.stdout[r.stdout.index("{"):])


def test_sim_device_reports_idle_time_and_admission(tmp_path):
    """benchmarks/sim_device.py: the engine against simulated devices, at a small size."""
    res = _run("sim_device", *SMALL_BURST, "--dp", "2", "--step-ms", "2", "--token-us", "1",
               "--launch-us", "50", "--out", str(tmp_path))
    assert res["dp"] == 2 and res["routing"] == "cache_aware"
    # both simulated devices ran 8 decode steps at least (each replica's requests, 8 new tokens)
    assert 8 * 0.002 <= res["device_busy_s"] <= res["wall_s"]
    assert res["device_idle_s"] >= 0 and res["idle_gaps"] >= 0 and res["gc_full_collections"] >= 0
    sub = _run("sim_device", *SMALL_BURST, "--submit-only")
    assert sub["requests"] == 16 and sub["submit_s"] > 0
    assert len((tmp_path / "sim_device.jsonl").read_text().splitlines()) == 1


def test_dp_bound_is_consistent():
    """benchmarks/dp_bound.py: round robin does all of cache-aware's work and more."""
    res = _run("dp_bound")
    ca, rr = res["cache_aware"], res["round_robin"]
    assert ca["decode_linear_s"] == rr["decode_linear_s"]  # the same rows decode under both
    assert ca["prefill_s"] < rr["prefill_s"] and ca["decode_attention_s"] < rr["decode_attention_s"]
    assert abs(res["cache_aware_over_round_robin"] - rr["total_s"] / ca["total_s"]) < 0.001
    one = _run("dp_bound", "--groups", "2", "--per-group", "2")  # a prefix per replica either way
    assert one["cache_aware"]["prefill_s"] < one["round_robin"]["prefill_s"]


def test_mixed_load_reports_each_step_kind(tmp_path):
    """benchmarks/mixed_load.py at a tiny size on the CPU: with a prompt budget beside decodes,
    steps carry prompt tokens and decodes together, and every request's tokens arrive."""
    r = subprocess.run([sys.executable, "-m", "benchmarks.mixed_load", "--device", "cpu", "--prompts", "12",
                        "--concurrency", "6", "--input-len", "70", "--output-len", "5", "--out", str(tmp_path),
                        "--settings", "mixed_prefill_tokens=0,max_running_requests=4;"
                                      "mixed_prefill_tokens=64,max_running_requests=4",
                        "--profile", "1", "--profile-steps", "3"], cwd=ROOT, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    off, capped = json.loads((tmp_path / "mixed_load.json").read_text())["runs"]
    assert off["mixed_budget"] == 4096 and capped["mixed_budget"] == 64  # (0 on a CPU: no budget of its own)
    assert off["mixed_graph_tokens"] == capped["mixed_graph_tokens"] == 0  # (nothing captured on a CPU)
    for run in (off, capped):
        assert run["completed"] == 12 and run["itl_ms"]["p99"] >= run["itl_ms"]["p50"] > 0
        assert sum(k["steps"] for k in run["kinds"].values()) == run["steps"]
    mixed = [k for name, k in capped["kinds"].items() if name.startswith("mixed")]
    assert mixed and max(k["prompt_tokens_max"] for k in mixed) <= 64 and capped["profile"]["steps"] >= 3


def test_http_itl_bench_runs(tmp_path):
    """Both halves (HTTP through ``radixd bench``, the daemon's in-process engine) streamed
    every token: one gap per token after each request's first, in both."""
    r = subprocess.run([sys.executable, "-m", "benchmarks.http_itl", "--streams", "4", "--requests", "8", "--prompt",
                        "16", "--new", "6", "--step-ms", "2", "--rounds", "2", "--out", str(tmp_path)], cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    doc = json.loads((tmp_path / "http_itl.json").read_text())
    assert len(doc["rounds"]) == 2
    for row in doc["rounds"]:
        for half in ("http", "engine"):
            assert row[half]["gaps"] == 8 * (6 - 1), row
            assert 0 < row[half]["p50_ms"] <= row[half]["p99_ms"] <= row[half]["max_ms"]
            assert row[half]["output_tok_s"] > 0
        assert row["client_gc"]["collections"] >= 0  # the client's collections are reported
    assert set(doc["medians"]) == {"http", "engine"}
