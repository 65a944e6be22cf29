"""CPU extend attention through torch, where radixd's C kernel does not take the step (a bf16
model, no C compiler, no AVX2): requests sharing a cached prefix (``torch_backend._group_extends``)
attend in one SDPA over the prefix's KV, read once, and each member's own KV under a mask,
equal to each request attended alone; the engine's greedy tokens with such steps equal
transformers'. (The C kernel's path: ``test_cpu_extend``.)"""

from __future__ import annotations

import asyncio

import pytest
import torch
from test_engine import assert_greedy_matches, assert_idle, collect, make_engine, prompts
from test_run_decode import DIM, HEADS, KV_HEADS, layout, make

from radixd.core import cpu_kernels
from radixd.core.attention import torch_backend
from radixd.core.forward_batch import ForwardBatch


@pytest.fixture(autouse=True)
def torch_extends(monkeypatch):
    """Every extend on torch's path (the C kernel would take the float32 ones)."""
    monkeypatch.setattr(cpu_kernels, "extend_takes", lambda *a: False)


def extend_step(attn, steps: list[tuple[int, int, int]], layer: int = 0) -> torch.Tensor:
    """Attention of one step of (row, cached prefix, new tokens) over ``layout``'s table."""
    pool = attn.pool
    rows = [r for r, _, _ in steps]
    loc = torch.cat([pool.req_to_token[r, p : p + e] for r, p, e in steps])
    positions = torch.cat([torch.arange(p, p + e) for _, p, e in steps])
    batch = ForwardBatch(input_ids=torch.zeros(loc.numel(), dtype=torch.int64), positions=positions,
                         out_cache_loc=loc, rows=rows, prefix_lens=[p for _, p, _ in steps],
                         extend_lens=[e for _, _, e in steps])
    attn.begin(batch)
    g = torch.Generator().manual_seed(layer)
    t = loc.numel()
    q, k, v = (torch.randn(t, h, DIM, generator=g).to(pool.model_dtype) for h in (HEADS, KV_HEADS, KV_HEADS))
    return attn.forward(q, k, v, layer, positions, lambda pos, q, k: (q, k))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_requests_sharing_a_prefix_attend_together_as_alone(dtype, monkeypatch):
    attn = make(dtype=dtype)
    layout(attn.pool, 0)  # rows 0-2 begin with the same 70 slots; 3 and 4 do not
    # rows 0 and 1 cached past the shared slots (their own cached parts differ), row 2 within
    # them; row 3 alone; row 4 a decode; row 5 a fresh prompt (nothing cached)
    steps = [(0, 84, 6), (4, 32, 1), (1, 74, 5), (3, 60, 7), (2, 66, 4), (5, 0, 9)]
    grouped = extend_step(attn, steps)
    assert len(attn.groups) == 1 and len(attn.extends) == 2  # rows 0-2 together; 3 and 5 alone
    q_rows, kv_idx, mask = attn.groups[0]
    assert q_rows.numel() == 6 + 5 + 4 and kv_idx.numel() == 66 + (90 - 66) + (79 - 66) + (70 - 66)
    assert mask.shape[-2:] == (15, kv_idx.numel())
    monkeypatch.setattr(torch_backend, "SHARED_MIN", 10**9)  # each alone
    alone = extend_step(attn, steps)
    assert not attn.groups
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(grouped.float(), alone.float(), atol=tol, rtol=tol)


def test_short_shared_runs_and_windows_attend_alone():
    attn = make()
    layout(attn.pool, 1)
    extend_step(attn, [(0, 10, 4), (1, 12, 3)])  # 10 shared cached slots: under SHARED_MIN
    assert not attn.groups and len(attn.extends) == 2
    windowed = make(windows=(8, 0))
    layout(windowed.pool, 1)
    extend_step(windowed, [(0, 80, 4), (1, 74, 3)])
    assert not windowed.groups  # (a window narrows each member's mask: kept per request)


async def test_engine_greedy_with_grouped_extends_equals_transformers(tiny_models, monkeypatch):
    calls = []
    real = torch_backend._group_extends

    def spy(extends, device):
        alone, groups = real(extends, device)
        calls.append(len(groups))
        return alone, groups

    monkeypatch.setattr(torch_backend, "_group_extends", spy)
    path = tiny_models["llama"]
    eng = make_engine(path)
    try:
        system = prompts(1, 40, seed=11)[0]
        await collect(eng, system + [3], 1)  # the system prompt into the cache
        ps = [system + q for q in prompts(3, 6, seed=12)]
        outs = await asyncio.gather(*(collect(eng, p, 6) for p in ps))
        for p, got in zip(ps, outs, strict=True):
            assert_greedy_matches(path, p, got, 6)
        assert max(calls) == 1  # the three extends of one step in one group
        await assert_idle(eng)
    finally:
        await eng.stop()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_prompt_with_nothing_cached_attends_causally_to_its_own_kv(dtype):
    attn = make(dtype=dtype)
    layout(attn.pool, 2)
    got = extend_step(attn, [(5, 0, 9), (3, 0, 13)])
    g = torch.Generator().manual_seed(0)  # (extend_step's q, k, v)
    q, k, v = (torch.randn(22, h, DIM, generator=g).to(dtype).float() for h in (HEADS, KV_HEADS, KV_HEADS))
    for rows in (slice(0, 9), slice(9, 22)):
        qi, ki, vi = q[rows], k[rows].repeat_interleave(HEADS // KV_HEADS, 1), v[rows].repeat_interleave(HEADS // KV_HEADS, 1)
        scores = torch.einsum("qhd,khd->hqk", qi, ki) * DIM**-0.5
        n = qi.shape[0]
        scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
        want = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vi)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got[rows].float(), want, atol=tol, rtol=tol)
    # the K/V went into the pool all the same
    torch.testing.assert_close(attn.pool.k_buffers[0][attn.pool.req_to_token[5, :9]].float(), k[:9])
