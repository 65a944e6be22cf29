"""CPU decode attention that reads KV in place, radixd's C kernel (``cpu_kernels.decode``) and
the pool's runs (``run_decode``, where no C compiler is): the same output as the gather path
of the torch backend, with shared prefixes, private runs, short runs, windows and a soft-cap
(which keep the gather path); the engine's greedy tokens on each equal transformers'."""

from __future__ import annotations

import asyncio
from unittest import mock

import pytest
import torch
from test_engine import assert_greedy_matches, assert_idle, collect, make_engine, prompts

from radixd.core import cpu_kernels
from radixd.core.attention import run_decode
from radixd.core.attention.torch_backend import TorchAttention
from radixd.core.forward_batch import ForwardBatch
from radixd.core.kv_pool import KVPool

HEADS, KV_HEADS, DIM = 6, 2, 16


def layout(pool: KVPool, seed: int) -> list[int]:
    """Table rows: 0-2 share a 70-slot run (row 0 continues it further), 3 has a private
    run then scattered slots, 4 only scattered slots, 5 a run too short to be read in place.
    Returns each request's length (its newest token's slot included)."""
    g = torch.Generator().manual_seed(seed)
    table = pool.req_to_token
    scattered = (torch.randperm(400, generator=g) + 600).tolist()
    def take(n):
        return [scattered.pop() for _ in range(n)]
    shared = list(range(1, 71))
    rows = [shared + list(range(71, 91)) + take(5), shared + take(9), shared + take(1),
            list(range(200, 260)) + take(7), take(33), list(range(300, 310)) + take(4)]
    for r, slots in enumerate(rows):
        table[r, : len(slots)] = torch.tensor(slots)
    for k, v in zip(pool.k_buffers, pool.v_buffers, strict=True):
        k.copy_(torch.randn(k.shape, generator=g))
        v.copy_(torch.randn(v.shape, generator=g))
    return [len(s) for s in rows]


def decode(attn: TorchAttention, lens: list[int], path: str, layer: int = 0) -> torch.Tensor:
    """One decode step's attention on ``path``: "kernel" (the C kernel), "runs" or "gather"."""
    pool = attn.pool
    b = len(lens)
    loc = pool.req_to_token[torch.arange(b), torch.tensor(lens) - 1].clone()
    batch = ForwardBatch(input_ids=torch.zeros(b, dtype=torch.int64), positions=torch.tensor(lens) - 1,
                         out_cache_loc=loc, rows=list(range(b)), prefix_lens=[n - 1 for n in lens],
                         extend_lens=[1] * b)
    with mock.patch.object(cpu_kernels, "takes", return_value=path == "kernel"):
        attn.begin(batch)
    if path == "kernel":
        assert (attn.decode_lens is not None) == (not attn.softcap) and attn.decode_runs is None
    elif path == "runs":
        assert (attn.decode_runs is not None) == (not attn.softcap) and attn.decode_lens is None
    else:
        attn.decode_runs = attn.decode_lens = None
    g = torch.Generator().manual_seed(layer)
    q, k, v = (torch.randn(b, h, DIM, generator=g).to(pool.dtype) for h in (HEADS, KV_HEADS, KV_HEADS))
    return attn.forward(q, k, v, layer, batch.positions, lambda pos, q, k: (q, k))


def make(windows=(), softcap=0.0, dtype=torch.float32) -> TorchAttention:
    pool = KVPool(num_layers=2, num_slots=1100, num_kv_heads=KV_HEADS, head_dim=DIM, max_rows=8, max_context_len=128,
                  dtype=dtype, device=torch.device("cpu"))
    return TorchAttention(pool, num_heads=HEADS, head_dim=DIM, scale=DIM**-0.5, windows=windows, softcap=softcap)


def test_plan_reads_shared_and_private_runs_in_place():
    attn = make()
    lens = layout(attn.pool, 0)
    kv_idx = torch.zeros(len(lens), max(lens), dtype=torch.int64)
    for b, n in enumerate(lens):
        kv_idx[b, :n] = attn.pool.req_to_token[b, :n]
    p = run_decode.plan(kv_idx, lens, torch.float32)
    assert [(s.start, s.length, s.members) for s in p.segments] == [(1, 70, [0, 1, 2]), (200, 60, [3])]
    # the tails: row 0 from position 70 on, 2 only its newest token, 4 and 5 whole
    assert p.tail_idx.shape[1] == max(lens[0] - 70, lens[4], lens[5])
    assert (p.tail_mask[2, 0, 0] == 0).sum() == 1


@pytest.mark.parametrize("path", ["kernel", "runs"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_in_place_paths_match_the_gather_path(dtype, path):
    attn = make(dtype=dtype)
    lens = layout(attn.pool, 1)
    for layer in range(2):
        got = decode(attn, lens, path, layer=layer)
        want = decode(attn, lens, "gather", layer=layer)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)


@pytest.mark.parametrize("path", ["kernel", "runs"])
def test_window_layers_and_softcap_keep_the_gather_path(path):
    attn = make(windows=(0, 16))
    lens = layout(attn.pool, 2)
    torch.testing.assert_close(decode(attn, lens, path, layer=1), decode(attn, lens, "gather", layer=1))
    torch.testing.assert_close(decode(attn, lens, path, layer=0), decode(attn, lens, "gather", layer=0),
                               atol=1e-5, rtol=1e-5)
    capped = make(softcap=3.0)
    lens = layout(capped.pool, 3)
    decode(capped, lens, path)  # asserts neither in-place path was planned


def test_no_run_long_enough_plans_nothing():
    lens = [5, 9]
    kv_idx = torch.tensor([[1, 2, 3, 4, 5, 0, 0, 0, 0], list(range(10, 19))])
    assert run_decode.plan(kv_idx, lens, torch.float32) is None
    assert run_decode.plan(torch.tensor([[4]]), [1], torch.float32, min_run=0) is None  # one token
    p = run_decode.plan(kv_idx, lens, torch.float32, min_run=4)
    assert [(s.start, s.length) for s in p.segments] == [(1, 4), (10, 8)]


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "runs"])
async def test_engine_decodes_shared_prefixes_in_place_and_matches_transformers(tiny_models, monkeypatch, kernel):
    shared_members = []
    kernel_calls = []
    real_plan, real_decode = run_decode.plan, cpu_kernels.decode

    def spy(*args, **kw):
        p = real_plan(*args, **kw)
        if p is not None:
            shared_members.extend(len(s.members) for s in p.segments)
        return p

    def spy_kernel(q, *args):
        kernel_calls.append(q.shape[0])
        return real_decode(q, *args)

    monkeypatch.setattr("radixd.core.attention.torch_backend.run_plan", spy)
    monkeypatch.setattr(cpu_kernels, "decode", spy_kernel)
    if not kernel:
        monkeypatch.setattr(cpu_kernels, "takes", lambda *a: False)
    path = tiny_models["llama"]
    eng = make_engine(path)
    try:
        system = prompts(1, 70, seed=5)[0]
        await collect(eng, system + [3], 1)  # the system prompt into the cache
        ps = [system + q for q in prompts(3, 4, seed=6)] + prompts(1, 50, seed=7)
        outs = await asyncio.gather(*(collect(eng, p, 8) for p in ps))
        for p, got in zip(ps, outs, strict=True):
            assert_greedy_matches(path, p, got, 8)
        if kernel:
            assert max(kernel_calls) == 4 and not shared_members  # all four decodes of a layer in one call
        else:
            assert max(shared_members) == 3 and not kernel_calls
        await assert_idle(eng)
    finally:
        await eng.stop()


def test_freed_slots_come_back_in_order():
    """Requests that decoded side by side free interleaved slots; the next prompt still gets
    one run of consecutive slots (what decode reads in place) once the freed slots are taken."""
    from radixd.core.kv_pool import SlotAllocator

    alloc = SlotAllocator(65)
    prompts = [alloc.alloc(8) for _ in range(4)]                          # slots 1..32
    decodes = [torch.cat([alloc.alloc(1) for _ in range(4)]) for _ in range(8)]  # 33..64, 4 apart per request
    for i in range(4):  # each request frees its prompt and its decode slots, in its own order
        alloc.free(torch.cat([prompts[i], *(d[i : i + 1] for d in decodes)]))
    got = alloc.alloc(40)
    assert torch.equal(got, torch.arange(1, 41))
