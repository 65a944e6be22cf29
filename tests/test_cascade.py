"""Cascade decoding's plan: which requests of a decode batch share a prefix of KV slots."""

from __future__ import annotations

import torch

from radixd.core import cascade
from radixd.core.cascade import CHUNK, SharedPrefixes, chain, plan


def chains_for(prefixes: list[tuple[int, int]], seed: int = 0) -> list[list[int]]:
    """Chains of requests given as (prefix id, shared chunks); distinct slots elsewhere."""
    out = []
    for k, (pid, n) in enumerate(prefixes):
        out.append([1000 * pid + i for i in range(n)] + [10**6 + 100 * k + i for i in range(3)])
    return out


def test_chain_takes_the_last_slot_of_each_whole_chunk():
    slots = torch.arange(1000, 1000 + 300)
    assert chain(slots, 300) == [1000 + CHUNK - 1 + CHUNK * i for i in range(300 // CHUNK)]
    assert chain(slots, CHUNK - 1) == []


def test_requests_sharing_a_prefix_form_one_item_each_group():
    chains = chains_for([(1, 32), (2, 32), (1, 32), (2, 32), (1, 32), (3, 32)])
    sh = plan(chains, rows=[10, 11, 12, 13, 14, 15], per_item=16)
    assert sh is not None
    got = sorted(zip(sh.item_lens, map(sorted, sh.members), strict=True))
    assert got == [(32 * CHUNK, [0, 2, 4]), (32 * CHUNK, [1, 3])]
    assert sh.shares == [32 * CHUNK] * 5 + [0]  # prefix 3 has one request: no item
    for row, mem in zip(sh.item_rows, sh.members, strict=True):
        assert row in [10 + b for b in mem]


def test_items_hold_at_most_per_item_requests():
    chains = chains_for([(1, 8)] * 7)
    sh = plan(chains, rows=list(range(7)), per_item=3)
    assert sorted(len(m) for m in sh.members) == [3, 3]  # the seventh is alone: no item
    assert all(len(m) >= 2 for m in sh.members)
    assert sum(s > 0 for s in sh.shares) == sum(len(m) for m in sh.members)


def test_short_or_absent_sharing_plans_nothing():
    assert plan(chains_for([(1, cascade.MIN_CHUNKS - 1)] * 4), rows=[0, 1, 2, 3], per_item=16) is None
    assert plan(chains_for([(1, 8), (2, 8), (3, 8)]), rows=[0, 1, 2], per_item=16) is None
    assert plan(chains_for([(1, 8)]), rows=[0], per_item=16) is None


def test_a_member_never_shortens_its_items_prefix():
    # requests 0 and 1 share 10 chunks; request 2 shares only the first 5 of them
    a = list(range(10)) + [50]
    b = list(range(10)) + [60]
    c = list(range(5)) + [70, 71, 72, 73, 74, 75]
    sh = plan([a, b, c], rows=[0, 1, 2], per_item=16)
    assert sh.item_lens == [10 * CHUNK] and sorted(sh.members[0]) == [0, 1]
    assert sh.shares == [10 * CHUNK, 10 * CHUNK, 0]


def test_members_matrix_and_parts():
    sh = SharedPrefixes(shares=[256, 0, 256, 320, 320], item_rows=[4, 7], item_lens=[256, 320],
                        members=[[0, 2], [3, 4]])
    assert sh.parts(5) == [5, 0, 5, 5, 5]
    out = sh.fill_members(torch.full((3, 4), 99, dtype=torch.int64))
    assert out.tolist() == [[0, 3, -1, -1], [2, 4, -1, -1], [-1, -1, -1, -1]]


def _builder():
    from types import SimpleNamespace

    from radixd.core.batch_builder import BatchBuilder

    return BatchBuilder(eos_token_ids=(), max_top_logprobs=0, constraints=None, stats=SimpleNamespace())


def test_scheduler_reuses_the_plan_while_its_inputs_hold():
    from types import SimpleNamespace

    from radixd.core.kv_handle import KVHandle

    builder = _builder()
    chain_a = list(range(100, 105))
    reqs = [SimpleNamespace(kv=KVHandle()) for _ in range(3)]
    for r, c in zip(reqs, (chain_a, list(chain_a), [1, 2, 3, 4, 5]), strict=True):
        r.kv.share_chain, r.kv.cached_len = c, 5 * CHUNK  # (chains of five whole chunks)
    first = builder.shared_prefixes(reqs, [0, 1, 2], 16)
    assert first is not None and first.members == [[0, 1]]
    assert builder.shared_prefixes(reqs, [0, 1, 2], 16) is first          # nothing changed
    assert builder.shared_prefixes(reqs, [0, 1, 5], 16) is not first      # a row moved
    reqs[2].kv.share_chain = list(chain_a)                                 # a chain changed
    again = builder.shared_prefixes(reqs, [0, 1, 5], 16)
    assert again.members == [[0, 1, 2]] and again.item_rows == [0]
    assert builder.shared_prefixes(reqs[:2], [0, 1], 16).members == [[0, 1]]  # fewer requests


def test_chain_follows_cached_len_when_slots_stay():
    """A rolled-back decode step lowers cached_len without replacing the slots: the chain is
    recomputed for the shorter cached prefix."""
    from types import SimpleNamespace

    from radixd.core.kv_handle import KVHandle

    builder = _builder()
    slots = torch.arange(1000, 1000 + 5 * CHUNK)
    reqs = [SimpleNamespace(kv=KVHandle()) for _ in range(2)]
    for r in reqs:
        r.kv.slots, r.kv.cached_len = slots, 5 * CHUNK
    assert builder.shared_prefixes(reqs, [0, 1], 16).item_lens == [5 * CHUNK]
    for r in reqs:
        r.kv.cached_len = 5 * CHUNK - 1  # one token less: four whole chunks
    assert builder.shared_prefixes(reqs, [0, 1], 16).item_lens == [4 * CHUNK]


def test_graph_block_rows_of_items():
    """A cascade graph's host block: each request's share and split count, each item's row
    and length, the members matrix; unused places zero (members -1)."""
    from types import SimpleNamespace

    from radixd.core.attention.triton_backend import TritonAttention
    from radixd.core.cuda_graph import ILEN, IROW, MEM, PARTS, SHARE, DecodeGraphs

    attn = SimpleNamespace(prefix_splits=lambda n: 3)
    attn.item_rows = lambda sh: TritonAttention.item_rows(attn, sh)
    sh = SharedPrefixes(shares=[256, 0, 256], item_rows=[7], item_lens=[256], members=[[0, 2]])
    staged = torch.full((MEM + 2, 4), 99, dtype=torch.int64)
    DecodeGraphs._stage_items(SimpleNamespace(attn=attn), staged, sh)
    assert staged[SHARE].tolist() == [256, 0, 256, 0] and staged[PARTS].tolist() == [3, 0, 3, 0]
    assert staged[IROW].tolist() == [7, 0, 0, 0] and staged[ILEN].tolist() == [256, 0, 0, 0]
    assert staged[MEM:].tolist() == [[0, -1, -1, -1], [2, -1, -1, -1]]
