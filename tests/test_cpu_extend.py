"""Prompt attention in radixd's C kernel on an AVX2 CPU (``cpu_kernels.extend``): every extend
of a step read through its slots where they lie, float32 queries over a pool of float32,
float16 or bfloat16, equal to attention over each request's gathered KV; the pool's stores
in the calling thread (``cpu_kernels.store_rows``) equal torch's; slots outside the pool are
refused before anything is read or written; the engine's greedy tokens on this path equal
transformers'."""

from __future__ import annotations

import asyncio

import pytest
import torch
import torch.nn.functional as F
from test_engine import assert_greedy_matches, assert_idle, collect, make_engine, prompts
from test_extend_groups import extend_step
from test_run_decode import DIM, HEADS, KV_HEADS, layout, make

from radixd.core import cpu_kernels
from radixd.core.attention.torch_backend import TorchAttention
from radixd.core.kv_pool import KVPool
from radixd.core.kv_quant import KVFormat

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture(autouse=True)
def needs_kernels():
    if cpu_kernels.library() is None or not cpu_kernels.avx2():
        pytest.skip("no AVX2 kernels here: prompts attend through torch's SDPA")


def random_step(g: torch.Generator, pool_slots: int, extends: list[tuple[int, int]]):
    """Slots (scattered through the pool) and meta for extends of (cached prefix, new rows)."""
    perm = torch.randperm(pool_slots, generator=g)
    slots, meta, row, off = [], [], 0, 0
    for p, e in extends:
        slots.append(perm[off : off + p + e])
        meta.append((row, e, p, off))
        row += e
        off += p + e
    return torch.cat(slots), torch.tensor(meta, dtype=torch.int64), row


def reference(q, k_buf, v_buf, slots, meta, scale):
    """Each extend's rows over its gathered slots, causal from its prefix on, in float64."""
    out = torch.empty(q.shape, dtype=torch.float64)
    for row, e, p, off in meta.tolist():
        idx = slots[off : off + p + e]
        k = k_buf[idx].double().transpose(0, 1)[None]
        v = v_buf[idx].double().transpose(0, 1)[None]
        qi = q[row : row + e].double().transpose(0, 1)[None]
        mask = torch.arange(p + e)[None, :] <= torch.arange(p, p + e)[:, None]
        out[row : row + e] = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, scale=scale,
                                                            enable_gqa=True)[0].transpose(0, 1)
    return out


@pytest.mark.parametrize("kv_dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (4, 4, 64), (8, 2, 128), (16, 1, 32), (6, 2, 16)])
def test_extend_equals_attention_over_each_requests_gathered_kv(kv_dtype, heads, kv_heads, dim):
    g = torch.Generator().manual_seed(heads * 1000 + dim)
    pool_slots = 2000
    k_buf = torch.randn(pool_slots, kv_heads, dim, generator=g).to(kv_dtype)
    v_buf = torch.randn(pool_slots, kv_heads, dim, generator=g).to(kv_dtype)
    # fresh prompts, chunks after a cached prefix, one-row extends, blocks of rows past the
    # kernel's 24 query vectors, a last block of one row
    slots, meta, t = random_step(g, pool_slots, [(0, 37), (100, 1), (5, 20), (300, 49), (0, 1), (17, 9), (0, 25)])
    q = torch.randn(t, heads, dim, generator=g)
    out = torch.full_like(q, float("nan"))
    cpu_kernels.extend(q, k_buf, v_buf, slots, meta, dim**-0.5, out)
    want = reference(q, k_buf, v_buf, slots, meta, dim**-0.5)
    torch.testing.assert_close(out.double(), want, atol=2e-6, rtol=2e-5)


def test_extend_reads_query_rows_apart_and_writes_only_its_rows():
    """q as the q/k/v projection leaves it (rows wider than its heads); rows of out outside
    the extends (a step's decode rows) are left as they were."""
    g = torch.Generator().manual_seed(3)
    k_buf, v_buf = torch.randn(500, 2, 32, generator=g), torch.randn(500, 2, 32, generator=g)
    slots, meta, t = random_step(g, 500, [(40, 6), (0, 5)])
    meta[1, 0] += 1  # row 6 between the two extends: not an extend's
    qkv = torch.randn(t + 1, (6 + 2 * 2) * 32, generator=g)
    q = qkv[:, : 6 * 32].view(t + 1, 6, 32)
    assert not q.is_contiguous()
    out = torch.zeros(t + 1, 6, 32)
    cpu_kernels.extend(q, k_buf, v_buf, slots, meta, 0.2, out)
    assert torch.equal(out[6], torch.zeros(6, 32))
    want = reference(q, k_buf, v_buf, slots, meta, 0.2)
    rows = [*range(6), *range(7, t + 1)]
    torch.testing.assert_close(out[rows].double(), want[rows], atol=2e-6, rtol=2e-5)


@pytest.mark.parametrize("kv_dtype", DTYPES)
def test_store_rows_equals_torchs_store(kv_dtype):
    g = torch.Generator().manual_seed(5)
    buf = torch.randn(300, 3, 64, generator=g).to(kv_dtype)
    want = buf.clone()
    qkv = torch.randn(20, (9 + 6) * 64, generator=g)
    v = qkv[:, 12 * 64 :].view(20, 3, 64)  # (rows apart, as the projection leaves them)
    loc = torch.randperm(300, generator=g)[:20]
    assert cpu_kernels.store_takes(v, buf)
    cpu_kernels.store_rows(buf, loc, v)
    want[loc] = v.to(kv_dtype)
    assert torch.equal(buf, want)


def test_slots_outside_the_pool_are_refused_before_anything_is_touched():
    k_buf, v_buf = torch.randn(100, 1, 16), torch.randn(100, 1, 16)
    q = torch.randn(4, 2, 16)
    out = torch.zeros_like(q)
    meta = torch.tensor([[0, 4, 2, 0]])
    with pytest.raises(ValueError, match="out of range"):
        cpu_kernels.extend(q, k_buf, v_buf, torch.tensor([1, 2, 3, 4, 100, 5]), meta, 0.25, out)
    with pytest.raises(ValueError, match="out of range"):  # rows past q
        cpu_kernels.extend(q, k_buf, v_buf, torch.arange(7), torch.tensor([[1, 4, 3, 0]]), 0.25, out)
    assert torch.equal(out, torch.zeros_like(q))
    before = k_buf.clone()
    with pytest.raises(ValueError, match="outside the pool"):
        cpu_kernels.store_rows(k_buf, torch.tensor([3, -1]), torch.randn(2, 1, 16))
    assert torch.equal(k_buf, before)


@pytest.mark.parametrize("kv_dtype", DTYPES)
def test_a_step_of_extends_on_the_kernel_equals_torchs_path(kv_dtype, monkeypatch):
    """Through the backend: chunks after cached prefixes (three sharing one), a decode row, a
    fresh prompt: the kernel's step equals torch's (its groups, SDPA alone, the decode kernel)."""
    pool = KVPool(num_layers=2, num_slots=1100, num_kv_heads=KV_HEADS, head_dim=DIM, max_rows=8, max_context_len=128,
                  dtype=torch.float32, device=torch.device("cpu"), kv_format=KVFormat(kv_dtype))
    attn = TorchAttention(pool, num_heads=HEADS, head_dim=DIM, scale=DIM**-0.5)
    layout(pool, 0)
    steps = [(0, 84, 6), (4, 32, 1), (1, 74, 5), (3, 60, 7), (2, 66, 4), (5, 0, 9)]
    got = extend_step(attn, steps)
    assert attn.cpu_extends is not None and not attn.extends and not attn.groups
    monkeypatch.setattr(cpu_kernels, "extend_takes", lambda *a: False)
    want = extend_step(attn, steps)
    assert attn.cpu_extends is None
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_window_layers_and_softcap_keep_torchs_path():
    windowed = make(windows=(8, 0))
    layout(windowed.pool, 1)
    extend_step(windowed, [(0, 80, 4), (1, 74, 3)])
    assert windowed.cpu_extends is None and len(windowed.extends) == 2
    capped = make(softcap=3.0)
    layout(capped.pool, 1)
    extend_step(capped, [(0, 80, 4)])
    assert capped.cpu_extends is None


async def test_engine_greedy_on_the_kernel_equals_transformers(tiny_models, monkeypatch):
    """Shared system prompts, small prefill chunks (a prompt's later chunks after its own
    earlier ones), requests arriving mid-flight: every prompt row through the kernel."""
    rows = []
    real = cpu_kernels.extend

    def spy(q, *args):
        rows.append(q.shape[0])
        return real(q, *args)

    monkeypatch.setattr(cpu_kernels, "extend", spy)
    path = tiny_models["llama"]
    eng = make_engine(path, chunked_prefill_size=16)
    try:
        system = prompts(1, 40, seed=21)[0]
        await collect(eng, system + [3], 1)
        ps = [system + q for q in prompts(3, 6, seed=22)] + prompts(2, 37, seed=23)
        outs = await asyncio.gather(*(collect(eng, p, 8) for p in ps))
        for p, got in zip(ps, outs, strict=True):
            assert_greedy_matches(path, p, got, 8)
        assert rows and max(rows) > 1
        await assert_idle(eng)
    finally:
        await eng.stop()
