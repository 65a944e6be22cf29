"""Prefill/decode disaggregation's parts without daemons: the byte ranges of a transfer, the
decode side's reserved slots in the KV accounting, SGLang's bootstrap routes, the Mooncake
backend moving bytes between two engines on loopback."""

from __future__ import annotations

import pytest
import torch
from starlette.testclient import TestClient

from radixd.core.config import EngineConfig
from radixd.core.disagg import PoolLayout, transfer_ranges
from radixd.core.kv_manager import KVManager
from radixd.core.kv_pool import RowAllocator, SlotAllocator
from radixd.core.radix_cache import RadixCache
from radixd.core.scheduler_interface import SchedulerStats
from radixd.server.bootstrap import RankTable, build_bootstrap_app


def test_transfer_ranges_merge_runs_consecutive_on_both_sides():
    src = PoolLayout(bases=(1000, 5000), item_lens=(8, 8), num_slots=100)
    dst = PoolLayout(bases=(20000, 90000), item_lens=(8, 8), num_slots=50)
    srcs, dsts, lens = transfer_ranges(src, torch.tensor([3, 4, 5, 9, 10]), dst, torch.tensor([7, 8, 20, 21, 22]))
    # runs: (3,4 -> 7,8), (5 -> 20), (9,10 -> 21,22), for each of the two buffers
    assert lens == [16, 8, 16] * 2
    assert srcs == [1000 + 3 * 8, 1000 + 5 * 8, 1000 + 9 * 8, 5000 + 3 * 8, 5000 + 5 * 8, 5000 + 9 * 8]
    assert dsts == [20000 + 7 * 8, 20000 + 20 * 8, 20000 + 21 * 8, 90000 + 7 * 8, 90000 + 20 * 8, 90000 + 21 * 8]


def test_transfer_ranges_refuse_what_cannot_be_exchanged():
    a = PoolLayout(bases=(0,), item_lens=(8,), num_slots=10)
    with pytest.raises(ValueError, match="layouts differ"):
        transfer_ranges(a, torch.tensor([1]), PoolLayout(bases=(0,), item_lens=(4,), num_slots=10), torch.tensor([1]))
    with pytest.raises(ValueError, match="2 KV slots to send into 1"):
        transfer_ranges(a, torch.tensor([1, 2]), a, torch.tensor([1]))
    with pytest.raises(ValueError, match="out of range"):
        transfer_ranges(a, torch.tensor([1]), a, torch.tensor([10]))
    with pytest.raises(ValueError, match="out of range"):  # slot 0 is the padding sink
        transfer_ranges(a, torch.tensor([1]), a, torch.tensor([0]))


def kv_manager(slots: int = 64) -> KVManager:
    alloc = SlotAllocator(slots + 1)
    return KVManager(EngineConfig(), allocator=alloc, rows=RowAllocator(4), cache=RadixCache(alloc), tiers=None,
                     stats=SchedulerStats())


def test_reserved_slots_are_accounted_until_cached_or_returned():
    m = kv_manager()
    key, slots = m.reserve(10)
    acc = m.accounting([])
    assert acc["reserved"] == 10 and acc["free"] == 54
    m.check_accounting([])
    m.received(key, list(range(10)))
    acc = m.accounting([])
    assert acc["reserved"] == 0 and acc["evictable"] == 10
    assert m.cache.match_prefix(list(range(10))).slots.tolist() == slots.tolist()
    m.check_accounting([])
    # a prefix cached meanwhile keeps the tree's slots; ours of it go back to the free list
    key, slots = m.reserve(12)
    m.received(key, list(range(12)))
    acc = m.accounting([])
    assert acc["evictable"] == 12 and acc["free"] == 52
    m.check_accounting([])
    key, _ = m.reserve(5)
    m.unreserve(key)
    assert m.accounting([])["free"] == 52
    m.check_accounting([])


def test_reserve_evicts_and_refuses_without_room():
    m = kv_manager(16)
    key, slots = m.reserve(16)
    m.received(key, list(range(16)))  # the whole pool cached, unlocked
    key, _ = m.reserve(8)  # eviction makes room (the cached node goes whole)
    assert m.accounting([])["reserved"] == 8
    assert m.reserve(9) is None
    m.unreserve(key)
    m.check_accounting([])


RANK = {"attn_tp_size": 1, "attn_tp_rank": 0, "attn_cp_size": 1, "attn_cp_rank": 0, "attn_dp_size": 1,
        "attn_dp_rank": 0, "pp_size": 1, "pp_rank": 0, "system_dp_size": 1, "system_dp_rank": 0,
        "rank_ip": "10.0.0.1", "rank_port": 7000, "page_size": 1, "kv_cache_dtype": "bfloat16",
        "prefill_http_port": 30000}
ROUTE = "/route?prefill_dp_rank={0}&prefill_cp_rank={0}&target_tp_rank={0}&target_pp_rank={0}"


def test_bootstrap_routes_as_sglang_answers_them():
    c = TestClient(build_bootstrap_app(RankTable(), rooms=None))
    assert c.get("/health").text == "OK"
    assert c.get("/route?prefill_dp_rank=0").status_code == 400
    assert c.get(ROUTE.format(-1)).status_code == 503  # nothing registered yet
    assert c.put("/route", json={"role": "Prefill"}).status_code == 400
    assert c.put("/route", json=RANK).text == "OK"
    info = c.get(ROUTE.format(-1)).json()
    assert info["page_size"] == 1 and info["kv_cache_dtype"] == "bfloat16" and info["dp_size"] == 1
    assert info["prefill_http_port"] == 30000 and info["follow_bootstrap_room"] is True
    assert c.get(ROUTE.format(0)).json() == {"rank_ip": "10.0.0.1", "rank_port": 7000}
    assert c.get(ROUTE.format(1)).status_code == 404
    assert c.post("/register_dp_rank", json={"bootstrap_room": 42, "dp_rank": 0}).text == "OK"
    assert c.post("/query_dp_ranks", json={"bootstrap_rooms": [42, 7]}).json() == {"42": 0}


def test_mooncake_moves_kv_between_two_engines():
    pytest.importorskip("mooncake.engine", reason="the Mooncake transfer engine is not installed")
    from radixd.plugins.mooncake import MooncakeTransport

    k_src, v_src = torch.randn(32, 2, 4), torch.randn(32, 2, 4)
    k_dst, v_dst = torch.zeros(16, 2, 4), torch.zeros(16, 2, 4)
    src = PoolLayout((k_src.data_ptr(), v_src.data_ptr()), (32, 32), 32)
    dst = PoolLayout((k_dst.data_ptr(), v_dst.data_ptr()), (32, 32), 16)
    a, b = MooncakeTransport("127.0.0.1", {}), MooncakeTransport("127.0.0.1", {})
    try:
        a.register(src.buffers())
        b.register(dst.buffers())
        s, d = torch.tensor([5, 6, 7, 20]), torch.tensor([1, 2, 9, 10])
        a.write(b.session_id, *transfer_ranges(src, s, dst, d))
        assert torch.equal(k_dst[d], k_src[s]) and torch.equal(v_dst[d], v_src[s])
        assert not k_dst[3:9].any()
    finally:
        a.close()
        b.close()


def test_benchmark_quick(tmp_path, monkeypatch):
    """benchmarks/pd.py's in-process logic (the H200 preset's) at toy size: two engines, the KV
    copied between them, the same greedy tokens as one engine."""
    import json
    import sys

    from benchmarks import pd

    monkeypatch.setattr(sys, "argv", ["pd", "--quick", "--out", str(tmp_path)])
    assert pd.main() == 0
    doc = json.loads((tmp_path / "pd.json").read_text())
    assert doc["same_tokens"] and doc["pd"]["transfer_GB"] >= 0
    assert doc["colocated"]["itl_p99_ms"] is not None and doc["pd"]["long_ttft_p50_ms"] is not None


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")])])
async def test_copy_kv_between_two_engines(tiny_models, device):
    """The in-process transfer: a prompt computed by one engine, its KV copied into slots the
    other reserved, cached there; the second engine computes one position and decodes the
    same greedy tokens as the first alone."""
    from radixd import Engine, SamplingParams
    from radixd.core import disagg

    kw = dict(model=str(tiny_models["llama"]), kv_cache_tokens=512, device=device)
    a, b = Engine(**kw), Engine(**kw)
    ids = list(range(5, 45))
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    try:
        want = [t async for o in a.generate(input_ids=ids, params=greedy) for t in o.token_ids]
        node, src = disagg.hold(a, ids)
        key, dst = disagg.reserve(b, len(ids))
        assert disagg.copy_kv(a, src, b, dst) == len(ids) * disagg.PoolLayout.of(b).item_lens[0] * 2 * len(
            b.worker.pool.k_buffers)
        disagg.let_go(a, node)
        disagg.received(b, key, ids)
        outs = [o async for o in b.generate(input_ids=ids, params=greedy)]
        assert [t for o in outs for t in o.token_ids] == want
        assert outs[-1].cached_tokens == len(ids) - 1
        a.check_accounting()
        b.check_accounting()
    finally:
        await a.stop()
        await b.stop()
