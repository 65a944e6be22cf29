"""benchmarks/cpu_peers.py: its --quick mode runs radixd through every workload with the same
client the peers get, and the ratios the issue names come out of the runs' medians."""

from __future__ import annotations

import json
import os

import pytest

from benchmarks import cpu_peers
from radixd.bench.targets import HttpTarget
from radixd.bench.workloads import RequestSpec


def test_ratios_from_medians():
    runs = [{"server": s, "workload": w, "req_s": q, "tpot_p50_ms": t, "ttft_p50_ms": 1.0}
            for s, w, q, t in [("radixd", "shared", 3.0, 40.0), ("radixd", "shared", 2.0, 60.0),
                               ("vllm", "shared", 2.0, 80.0), ("radixd", "random", 1.2, 50.0),
                               ("vllm", "random", 1.0, 90.0), ("llama", "single", 1.0, 20.0),
                               ("radixd", "single", 0.5, 30.0)]]
    r = cpu_peers.summary(runs)
    assert r["medians"]["radixd"]["shared"]["req_s"] == 2.5
    assert r["ratios"] == {"req_s_shared_vs_vllm": 1.25, "req_s_random_vs_vllm": 1.2,
                           "tpot_shared_over_llama_single": 2.5, "tpot_random_over_llama_single": 2.5,
                           "tpot_single_over_llama_single": 1.5}


def test_ratios_against_vllm_in_bf16_apart():
    runs = [{"server": s, "workload": "shared", "req_s": q, "tpot_p50_ms": 1.0, "ttft_p50_ms": 1.0}
            for s, q in [("radixd", 3.0), ("vllm", 2.0), ("vllm-bf16", 4.0)]]
    assert cpu_peers.summary(runs)["ratios"] == {"req_s_shared_vs_vllm": 1.5, "req_s_shared_vs_vllm_bf16": 0.75}


def test_min_tokens_only_when_asked():
    spec = RequestSpec(input_ids=[1, 2], output_len=7, messages=[{"role": "user", "content": "hi"}])
    path, body = HttpTarget("http://x", "chat", min_tokens=True)._body(spec, True)
    assert path == "/v1/chat/completions" and body["min_tokens"] == 7 and body["ignore_eos"] is True
    assert "min_tokens" not in HttpTarget("http://x", "completions")._body(spec, True)[1]


def test_peers_need_their_environments():
    with pytest.raises(SystemExit):
        cpu_peers.main(["--servers", "radixd,vllm"])
    with pytest.raises(SystemExit):
        cpu_peers.main(["--servers", "vllm-bf16"])
    with pytest.raises(SystemExit):  # (not KEY=VALUE)
        cpu_peers.main(["--servers", "radixd", "--radixd-env", "RADIXD_CPU_ACT_BITS"])


def test_radixd_env_reaches_radixd_alone(tmp_path, monkeypatch):
    seen = {}

    class Fake:
        def __init__(self, name, argv, env, port, workdir):
            seen[name] = env

    monkeypatch.setattr(cpu_peers, "Server", Fake)
    cpu_peers.start_radixd(tmp_path, [], "auto", {"RADIXD_CPU_ACT_BITS": "8"})
    assert seen["radixd"]["RADIXD_CPU_ACT_BITS"] == "8"
    cpu_peers.start_radixd(tmp_path, [], "auto")
    assert seen["radixd"].get("RADIXD_CPU_ACT_BITS") == os.environ.get("RADIXD_CPU_ACT_BITS")


@pytest.mark.slow
def test_quick_run_on_the_default_model(tmp_path):
    out = tmp_path / "peers.json"
    # one workload: each is a client process of its own, and the others differ only in flags
    assert cpu_peers.main(["--quick", "--workloads", "shared", "--radixd-kv-cache-dtype", "float16",
                           "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["config"]["radixd_kv_cache_dtype"] == "float16"  # (the server's pool: a float32 model's K/V in 16 bits)
    assert [(r["server"], r["workload"]) for r in doc["runs"]] == [("radixd", "shared")]
    run = doc["runs"][0]
    assert run["completed"] == 4 and run["failed"] == 0 and run["output_tokens"] == 16
    assert run["cache_hit_rate"] > 0  # the shared prefixes were served from the cache
    assert doc["medians"]["radixd"]["shared"]["req_s"] == run["req_s"]
