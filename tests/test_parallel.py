"""Several workers in one process, on CPU: data-parallel replicas behind the cache-aware (or
round-robin) router, and tensor parallel shards whose greedy tokens equal one worker's."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from radixd import Engine, SamplingParams
from radixd.core.assembly import check_parallel as _check_parallel
from radixd.core.config import EngineConfig
from radixd.core.errors import ConfigError
from radixd.core.model_loader import read_config
from radixd.core.router import BLOCK, PrefixIndex, Router, prefix_hashes
from radixd.core.tensor_parallel import shard_config, shard_tensor
from radixd.settings import settings_from_dict

GREEDY = dict(temperature=0.0, ignore_eos=True)


def make_engine(path, **kw) -> Engine:
    kw.setdefault("kv_cache_tokens", 2048)
    kw.setdefault("device", "cpu")
    kw.setdefault("dtype", "float32")
    eng = Engine(model=str(path), **kw)
    eng.step_hook = lambda step: eng.check_accounting()
    return eng


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, 256) for _ in range(n)]


async def run(eng: Engine, prompt: list[int], max_new: int = 4, **params) -> tuple[int, list[int]]:
    """(replica that served it, generated tokens)."""
    sub = eng.submit(input_ids=prompt, params=SamplingParams(max_new_tokens=max_new, **{**GREEDY, **params}))
    toks: list[int] = []
    async for out in sub:
        toks += out.token_ids
    return sub.replica, toks


def assert_idle(eng: Engine) -> None:
    eng.check_accounting()
    for rep in eng.replicas:
        acc = rep.scheduler.accounting()
        assert acc["private"] == 0 and acc["locked"] == 0
        assert acc["free"] + acc["evictable"] == acc["total"]


# ------------------------------------------------------------------------ routing


async def test_cache_aware_routing_keeps_a_prefix_on_one_replica(tiny_models):
    eng = make_engine(tiny_models["llama"], dp_size=2)
    try:
        sys_a, sys_b = tokens(64, 1), tokens(64, 2)
        # a burst (the followers are routed before the first request's KV exists), in an
        # order that round robin would split: a a a a a a b b b b b b
        jobs = [run(eng, sys + tokens(8, 100 + i)) for sys in (sys_a, sys_b) for i in range(6)]
        served = await asyncio.gather(*jobs)
        on_a = {rep for rep, _ in served[:6]}
        on_b = {rep for rep, _ in served[6:]}
        assert len(on_a) == 1 and len(on_b) == 1, served
        assert on_a != on_b, "two unrelated prefixes should land on different replicas"
        st = eng.stats()
        assert st["routing"]["routed"] == [6, 6]
        # each prefix was computed once, on its replica; the other replica never saw it
        ra, rb = eng.replicas[on_a.pop()], eng.replicas[on_b.pop()]
        assert ra.cache.peek_prefix_len(sys_a) == 64 and rb.cache.peek_prefix_len(sys_a) == 0
        assert rb.cache.peek_prefix_len(sys_b) == 64 and ra.cache.peek_prefix_len(sys_b) == 0
        assert st["cache_hit_tokens"] >= 2 * 5 * 64 - 2 * BLOCK  # the followers' prefixes were hits
        assert_idle(eng)
    finally:
        await eng.stop()


async def test_cache_aware_routing_spreads_unrelated_requests(tiny_models):
    eng = make_engine(tiny_models["llama"], dp_size=2)
    try:
        served = await asyncio.gather(*(run(eng, tokens(40, 10 + i)) for i in range(8)))
        assert sorted(rep for rep, _ in served) == [0] * 4 + [1] * 4
        st = eng.stats()
        assert st["routing"]["by_room"] == 8 and st["routing"]["by_prefix"] == 0
        for per in st["replicas"]:
            assert per["cache_queried_tokens"] == 4 * 40
        assert_idle(eng)
    finally:
        await eng.stop()


async def test_balance_threshold_overrides_the_prefix(tiny_models):
    """Threshold 0: a replica already busier than the other gets no more requests, prefix
    or not; a large threshold keeps them all with the prefix."""
    shared = tokens(48, 5)
    for threshold, expect_both in ((0, True), (100, False)):
        eng = make_engine(tiny_models["llama"], dp_size=2, routing_balance_threshold=threshold)
        try:
            served = await asyncio.gather(*(run(eng, shared + tokens(8, 50 + i)) for i in range(6)))
            used = {rep for rep, _ in served}
            assert (used == {0, 1}) if expect_both else (len(used) == 1), (threshold, served)
            assert_idle(eng)
        finally:
            await eng.stop()


async def test_round_robin_alternates(tiny_models):
    eng = make_engine(tiny_models["llama"], dp_size=2, routing="round_robin")
    try:
        shared = tokens(48, 7)
        order = []
        for i in range(5):  # one at a time: the same prefix still alternates
            rep, _ = await run(eng, shared + tokens(4, i))
            order.append(rep)
        assert order == [0, 1, 0, 1, 0]
        assert eng.stats()["routing"] == {"policy": "round_robin", "routed": [3, 2], "by_prefix": 0, "by_load": 0,
                                             "by_room": 0}
    finally:
        await eng.stop()


async def test_n_samples_stay_on_one_replica(tiny_models):
    eng = make_engine(tiny_models["llama"], dp_size=2)
    try:
        sub = eng.submit(input_ids=tokens(40, 3), params=SamplingParams(max_new_tokens=5, n=3, temperature=0.8, seed=1))
        outs = [o async for o in sub]
        assert sorted(o.index for o in outs if o.finished) == [0, 1, 2]
        per = eng.stats()["replicas"]
        other = per[1 - sub.replica]
        assert other["cache_queried_tokens"] == 0 and other["steps"] == 0
        assert per[sub.replica]["decode_tokens"] > 0
        assert_idle(eng)
    finally:
        await eng.stop()


async def test_dp_matches_one_replica_and_accounting_holds_under_pressure(tiny_models):
    """Greedy tokens do not depend on the replica; small pools force preemption on each."""
    path = tiny_models["qwen2"]
    prompts = [tokens(30 + 3 * i, 20 + i) for i in range(10)]
    single = make_engine(path, kv_cache_tokens=200)
    try:
        want = await asyncio.gather(*(run(single, p, 24) for p in prompts))
    finally:
        await single.stop()
    eng = make_engine(path, dp_size=2, kv_cache_tokens=200)
    try:
        got = await asyncio.gather(*(run(eng, p, 24) for p in prompts))
        assert [t for _, t in got] == [t for _, t in want]
        st = eng.stats()
        assert {rep for rep, _ in got} == {0, 1}
        assert st["preemptions"] == sum(p["preemptions"] for p in st["replicas"]) > 0
        assert st["kv"]["total"] == 2 * single.allocator.total
        assert st["decode_tokens"] == sum(p["decode_tokens"] for p in st["replicas"])
        assert_idle(eng)
    finally:
        await eng.stop()


async def test_abort_and_flush_reach_every_replica(tiny_models):
    eng = make_engine(tiny_models["llama"], dp_size=2)
    try:
        subs = [eng.submit(input_ids=tokens(40, 60 + i), params=SamplingParams(max_new_tokens=400, **GREEDY))
                for i in range(4)]
        assert {s.replica for s in subs} == {0, 1}
        firsts = [await s.__anext__() for s in subs]  # every request is running
        assert all(not f.finished for f in firsts)
        assert eng.abort_all() == 4
        for s in subs:
            last = [o async for o in s][-1]
            assert last.finished and last.finish_reason == "abort"
        assert_idle(eng)
        assert all(rep.cache.total_size > 0 for rep in eng.replicas)
        assert eng.flush_cache()
        assert all(rep.cache.total_size == 0 for rep in eng.replicas)
        assert all(len(index) == 0 for index in eng.router.indexes)
    finally:
        await eng.stop()


def test_prefix_index_matches_whole_blocks_and_forgets_the_oldest():
    a, b = tokens(40, 1), tokens(40, 2)
    index = PrefixIndex(capacity_blocks=3)
    index.insert(prefix_hashes(a))             # 2 blocks
    assert index.match(prefix_hashes(a + [1, 2])) == 2
    assert index.match(prefix_hashes(a[:20] + b)) == 1
    index.insert(prefix_hashes(b))             # 2 more: a's deeper block goes first
    assert len(index) == 3
    assert index.match(prefix_hashes(a)) == 1 and index.match(prefix_hashes(b)) == 2


def test_router_prefers_the_prefix_unless_too_busy():
    loads = [0, 0]
    router = Router(2, policy="cache_aware", balance_threshold=2, capacity_tokens=4096, loads=lambda: loads)
    p = tokens(64, 9)
    first = router.pick(p)
    loads[first] += 1
    for _ in range(2):
        assert router.pick(p + [7]) == first
        loads[first] += 1
    assert loads[first] - loads[1 - first] == 3
    assert router.pick(p + [8]) == 1 - first  # over the threshold: the least-loaded one


def test_router_ratio_lets_a_busy_prefix_replica_keep_its_prefix():
    """Over the threshold but within the ratio: the prefix wins; over both: the least loaded."""
    loads = [0, 0]
    router = Router(2, policy="cache_aware", balance_threshold=2, balance_ratio=1.5, capacity_tokens=4096,
                    loads=lambda: loads)
    p = tokens(64, 9)
    first = router.pick(p)
    loads[:] = [0, 0]
    loads[first], loads[1 - first] = 14, 10     # 4 over (> 2) but 1.4x (<= 1.5x)
    assert router.pick(p + [1]) == first
    loads[first] = 16                           # 6 over and 1.6x
    assert router.pick(p + [2]) == 1 - first
    assert router.stats()["by_prefix"] == 1 and router.stats()["by_load"] == 1


def test_router_keeps_a_bursts_groups_whole_and_balanced():
    """A shuffled burst of 16 groups x 8 requests (a system prompt each): every group on one
    replica, 8 groups each. New prefixes go to the replica that has fewer, whatever the
    queues hold when each first arrives."""
    rng = random.Random(5)  # (routing new prefixes by load split 4 of these groups)
    systems = [tokens(96, 100 + g) for g in range(16)]
    burst = [(g, systems[g] + [rng.randrange(1000) for _ in range(12)]) for g in range(16) for _ in range(8)]
    rng.shuffle(burst)
    loads = [0, 0]
    router = Router(2, policy="cache_aware", balance_threshold=4, balance_ratio=1.25, capacity_tokens=1 << 20,
                    loads=lambda: loads)
    where: dict[int, set[int]] = {}
    for g, ids in burst:
        i = router.pick(ids)
        loads[i] += 1
        where.setdefault(g, set()).add(i)
    assert all(len(reps) == 1 for reps in where.values()), where
    assert loads == [64, 64]
    st = router.stats()
    assert st["by_room"] == 16 and st["by_prefix"] == 112 and st["by_load"] == 0


# ------------------------------------------------------------------------ tensor parallel


@pytest.mark.parametrize("arch", ["llama", "llama-tied", "qwen2", "qwen3"])
async def test_tp2_gives_the_tp1_tokens(tiny_models, arch):
    path = tiny_models[arch]
    prompts = [tokens(20 + 7 * i, 30 + i) for i in range(4)]

    async def greedy(**kw):
        eng = make_engine(path, **kw)
        try:
            outs = await asyncio.gather(*(collect_logprobs(eng, p) for p in prompts))
            assert_idle(eng)
            return outs
        finally:
            await eng.stop()

    one = await greedy()
    two = await greedy(tp_size=2)
    for (t1, lp1), (t2, lp2) in zip(one, two, strict=True):
        assert t1 == t2
        assert torch.allclose(torch.tensor(lp1), torch.tensor(lp2), atol=1e-4)


async def test_tp_greedy_steps_sample_on_every_shard(tiny_models):
    """An all-greedy step leaves each shard its own copy of the picks (the next step reads
    them without a copy between devices); a step with a random draw is sampled by shard 0."""
    eng = make_engine(tiny_models["llama"], tp_size=2)
    worker = eng.replicas[0].worker
    seen = []
    launch = worker.launch

    def spy(batch, prev=None):
        picks = launch(batch, prev)
        seen.append((batch.sampling.all_greedy, picks.shard_tokens))
        return picks

    worker.launch = spy
    try:
        greedy = await collect_logprobs(eng, tokens(20, 5))
        sampled = [t async for out in eng.generate(input_ids=tokens(20, 6), params=SamplingParams(
            max_new_tokens=6, temperature=0.8, seed=3, ignore_eos=True)) for t in out.token_ids]
    finally:
        await eng.stop()
    assert len(greedy[0]) == 16 and len(sampled) == 6
    assert {all_greedy for all_greedy, _ in seen} == {True, False}
    for all_greedy, shard_tokens in seen:
        if all_greedy:
            assert len(shard_tokens) == 2 and torch.equal(shard_tokens[0], shard_tokens[1])
        else:
            assert shard_tokens is None


async def collect_logprobs(eng: Engine, prompt: list[int]) -> tuple[list[int], list[float]]:
    toks, lps = [], []
    async for out in eng.generate(input_ids=prompt, params=SamplingParams(max_new_tokens=16, logprobs=True, **GREEDY)):
        toks += out.token_ids
        lps += [lp.logprob for lp in out.logprobs or []]
    return toks, lps


async def test_tp_shards_hold_their_heads_and_dp_tp_combine(tiny_models):
    path = tiny_models["llama"]  # 4 heads, 2 KV heads (GQA)
    eng = make_engine(path, dp_size=2, tp_size=2)
    try:
        assert [len(rep.worker.shards) for rep in eng.replicas] == [2, 2]
        shard = eng.replicas[0].worker.shards[1]
        assert shard.pool.k_buffers[0].shape[1] == 1  # one of the two KV heads
        assert shard.model.layers[0].self_attn.num_heads == 2
        prompts = [tokens(24, 70 + i) for i in range(4)]
        got = await asyncio.gather(*(run(eng, p, 10) for p in prompts))
        assert {rep for rep, _ in got} == {0, 1}
        assert_idle(eng)
    finally:
        await eng.stop()
    single = make_engine(path)
    try:
        want = await asyncio.gather(*(run(single, p, 10) for p in prompts))
    finally:
        await single.stop()
    assert [t for _, t in got] == [t for _, t in want]


def test_shards_sum_to_the_whole_layer(tiny_models):
    """Column-parallel q/k/v and gate/up, row-parallel o/down: the shards' partial outputs
    of a projection sum to the unsplit one."""
    cfg = read_config(tiny_models["qwen2"])
    w_qkv = torch.randn(cfg.num_heads * cfg.head_dim + 2 * cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size)
    w_o = torch.randn(cfg.hidden_size, cfg.num_heads * cfg.head_dim)
    x = torch.randn(3, cfg.hidden_size)
    parts = [shard_tensor("layers.0.self_attn.qkv_proj.weight", w_qkv, cfg, r, 2) for r in range(2)]
    part_cfg = shard_config(cfg, 2)
    assert parts[0].shape[0] == part_cfg.num_heads * cfg.head_dim + 2 * part_cfg.num_kv_heads * cfg.head_dim
    q_full = (x @ w_qkv.T)[:, : cfg.num_heads * cfg.head_dim]
    q_parts = torch.cat([(x @ p.T)[:, : part_cfg.num_heads * cfg.head_dim] for p in parts], dim=1)
    assert torch.allclose(q_full, q_parts, atol=1e-5)
    o_parts = [shard_tensor("layers.0.self_attn.o_proj.weight", w_o, cfg, r, 2) for r in range(2)]
    h = torch.randn(3, cfg.num_heads * cfg.head_dim)
    halves = h.chunk(2, dim=1)
    assert torch.allclose(h @ w_o.T, sum(hh @ o.T for hh, o in zip(halves, o_parts, strict=True)), atol=1e-4)


# ------------------------------------------------------------------------ configuration


def test_parallel_settings_are_checked(tiny_models):
    with pytest.raises(ConfigError) as e:
        EngineConfig(dp_size=0)
    assert e.value.key == "dp_size"
    with pytest.raises(ConfigError) as e:
        EngineConfig(routing="random")
    assert e.value.key == "routing" and "round_robin" in str(e.value)
    with pytest.raises(ConfigError) as e:
        settings_from_dict({"parallel": {"tp_size": 0}})
    assert e.value.key == "parallel.tp_size"
    with pytest.raises(ConfigError) as e:
        EngineConfig(routing_balance_ratio=0.5)
    assert e.value.key == "routing_balance_ratio" and ">= 1" in str(e.value)
    with pytest.raises(ConfigError) as e:
        settings_from_dict({"parallel": {"routing_balance_ratio": 0.9}})
    assert e.value.key == "parallel.routing_balance_ratio"
    s = settings_from_dict({"parallel": {"dp_size": 2, "routing": "round_robin", "routing_balance_ratio": 2}})
    cfg = s.engine_config()
    assert cfg.dp_size == 2 and cfg.routing == "round_robin" and cfg.routing_balance_ratio == 2.0
    with pytest.raises(ConfigError) as e:  # 3 does not divide 2 KV heads
        make_engine(tiny_models["llama"], tp_size=3)
    assert e.value.key == "tp_size" and "KV heads (2)" in str(e.value)


def test_more_gpus_than_visible_is_refused(tiny_models, monkeypatch):
    cfg = read_config(tiny_models["llama"])
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    _check_parallel(EngineConfig(dp_size=2), cfg, torch.device("cuda"))
    with pytest.raises(ConfigError) as e:
        _check_parallel(EngineConfig(dp_size=2, tp_size=2), cfg, torch.device("cuda"))
    assert e.value.key == "dp_size" and "<= 2" in str(e.value)


# ------------------------------------------------------------------------ the GPU script's logic


def test_multi_gpu_bench_runs_on_cpu(tmp_path):
    """benchmarks/multi_gpu_bench.py end to end with tiny shapes on CPU workers (what the 2-GPU
    run does, small): every figure is there and tp=2 reproduces tp=1's greedy tokens."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    r = subprocess.run([sys.executable, "-m", "benchmarks.multi_gpu_bench", "--out", str(tmp_path), "--device", "cpu",
                        "--dp-workloads", "shared_prefix,prefix_pressure,bench_shared_prefix", "--timeline"],
                       cwd=Path(__file__).resolve().parent.parent, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads((tmp_path / "multi_gpu.json").read_text())
    assert (tmp_path / "log.txt").read_text().count("== ") >= 3
    dp, tp = res["sections"]["dp"], res["sections"]["tp"]
    for name in ("shared_prefix", "prefix_pressure", "bench_shared_prefix"):
        c = dp[name]
        for run in ("one_gpu", "dp2_cache_aware", "dp2_round_robin"):
            assert c[run]["out_tok_s"] > 0 and 0.0 <= c[run]["hit_rate"] <= 1.0
        assert sum(c["dp2_cache_aware"]["routed"]) == c["dp2_cache_aware"]["requests"]
        for run in ("dp2_cache_aware", "dp2_round_robin"):  # each replica's steps, seen from the host
            tl = c[run]["timeline"]
            assert len(tl) == 2 and sum(t["decode_steps"] + t["prefill_steps"] for t in tl) == c[run]["steps"]
            assert all(0 <= t["first_launch_s"] <= t["end_s"] <= c[run]["seconds"] + 0.01
                       and t["host_launch_ms_per_step"] > 0 for t in tl)
            assert c[run]["loop_cpu_share"] > 0 and c[run]["gc_full_collections"] >= 0
        assert c["dp2_over_one_gpu"] > 0 and "cache_aware_over_round_robin" in c
    # cache-aware keeps each prefix on one replica: never fewer hits than round robin
    assert dp["shared_prefix"]["dp2_cache_aware"]["hit_rate"] >= dp["shared_prefix"]["dp2_round_robin"]["hit_rate"]
    assert tp["tp1"]["decode_tok_s"] > 0 and tp["tp2"]["decode_tok_s"] > 0
    assert all(c["equal_prefix"] == c["steps"] for c in tp["greedy_tp2_vs_tp1"])


def test_multi_gpu_bench_shared_prefix_is_radixd_benchs_default():
    """The dp section's bench_shared_prefix at full size is `radixd bench`'s shared-prefix
    workload with its defaults."""
    from types import SimpleNamespace

    from benchmarks import multi_gpu_bench as mod
    from radixd.bench.workloads import build

    class WordTokenizer:  # one token per word
        vocab: dict[str, int] = {}

        def __call__(self, text, add_special_tokens=False):
            return SimpleNamespace(input_ids=[self.vocab.setdefault(w, len(self.vocab)) for w in text.split()])

        def decode(self, ids):
            words = {i: w for w, i in self.vocab.items()}
            return " ".join(words[i] for i in ids)

    cfg = build("shared-prefix", WordTokenizer(), seed=0).config
    full = mod.BENCH_SHARED["full"]
    assert (cfg["groups"], cfg["prompts_per_group"], cfg["system_len"], cfg["question_len"]) == (
        full["groups"], full["per_group"], full["system"], full["question"])
    assert cfg["output_len"] == [full["new"], full["new"]]


async def test_metrics_report_each_replica(tiny_models):
    from prometheus_client import generate_latest

    from radixd.server.metrics import Metrics

    eng = make_engine(tiny_models["llama"], dp_size=2)
    try:
        shared = tokens(48, 8)
        await asyncio.gather(*(run(eng, shared + tokens(8, 80 + i)) for i in range(3)))
        text = generate_latest(Metrics(eng).registry).decode()
        st = eng.stats()
        busy = next(i for i, per in enumerate(st["replicas"]) if per["cache_queried_tokens"])
        assert f'radixd_replica_cache_hit_rate{{replica="{busy}"}} {st["replicas"][busy]["cache_hit_rate"]}' in text
        assert f'radixd_replica_cache_hit_rate{{replica="{1 - busy}"}} 0.0' in text
        assert f'radixd_cache_hit_rate {st["cache_hit_rate"]}' in text
    finally:
        await eng.stop()


@pytest.mark.parametrize("tp", [1, 2])
async def test_a_failed_step_fails_its_requests_not_the_engine(tiny_models, tp):
    """A forward pass raising (tp=2: on one shard, which releases the others from the
    barrier) fails that step's requests; the KV it never computed is not left in the radix
    cache, so the same prompt again gets the tokens of an engine that never failed."""
    path = tiny_models["llama"]
    eng = make_engine(path, tp_size=tp)
    target = eng.worker.shards[1] if tp == 2 else eng.worker
    name = "forward" if tp == 2 else "launch"
    real = getattr(target, name)
    calls = {"n": 0}

    def flaky(batch, prev=None):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("device broke")
        return real(batch, prev)

    setattr(target, name, flaky)
    prompt = tokens(40, 2)
    try:
        with pytest.raises(RuntimeError, match="device broke"):
            await asyncio.wait_for(run(eng, prompt, 6), timeout=60)
        assert_idle(eng)
        assert eng.cache.peek_prefix_len(prompt) == 0
        _, got = await asyncio.wait_for(run(eng, prompt, 6), timeout=60)
        assert calls["n"] > 1
        assert_idle(eng)
    finally:
        await eng.stop()
    single = make_engine(path)
    try:
        _, want = await run(single, prompt, 6)
    finally:
        await single.stop()
    assert got == want


# ------------------------------------------------------------------------ the daemon


def test_daemon_serves_with_two_replicas(tiny_models, tmp_path):
    """``[parallel] dp_size = 2`` through radixd.toml: requests are served, /health passes,
    /server_info and /metrics show both replicas, and the pools are idle afterwards."""
    import httpx
    from conftest import Daemon

    toml = f"""
[server]
port = 0
[model]
path = "{tiny_models['llama']}"
device = "cpu"
[memory]
kv_cache_tokens = 2048
[parallel]
dp_size = 2
"""
    d = Daemon(tmp_path, toml)
    try:
        with httpx.Client(base_url=d.url, timeout=60) as http:
            prompt = tokens(40, 90)
            for i in range(4):
                r = http.post("/generate", json={"input_ids": prompt + [2 + i], "sampling_params": {
                    "max_new_tokens": 4, "temperature": 0}})
                assert r.status_code == 200, r.text
            assert http.get("/health").status_code == 200
            stats = http.get("/server_info").json()["stats"]
            assert len(stats["replicas"]) == 2 and sum(stats["routing"]["routed"]) == 5  # + /health's
            assert stats["kv"]["locked"] == 0 and stats["kv"]["private"] == 0
            metrics = http.get("/metrics").text
            assert 'radixd_replica_running_requests{replica="1"}' in metrics
    finally:
        assert d.stop() == 0
