"""Triton radix-attention kernels against the torch reference: on CPU through the Triton
interpreter at small shapes (CI), and on a GPU at real shapes (``-m gpu``)."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
import triton

from radixd.core.attention import triton_kernels
from radixd.core.attention.triton_kernels import (
    build_kv_indices,
    decode_attention,
    extend_attention,
)

GPU = torch.cuda.is_available()
DEV = "cuda" if GPU else "cpu"


def make_pool(num_slots, hkv, d, dtype, seq_lens, seed):
    """A pool with random K/V and table rows pointing at scattered (shuffled) slots."""
    g = torch.Generator().manual_seed(seed)
    kb = torch.randn(num_slots, hkv, d, generator=g).to(DEV, dtype)
    vb = torch.randn(num_slots, hkv, d, generator=g).to(DEV, dtype)
    table = torch.zeros(len(seq_lens) + 2, max(seq_lens) + 5, dtype=torch.int64)
    perm = torch.randperm(num_slots - 1, generator=g) + 1
    rows = list(range(len(seq_lens) + 2))
    random.Random(seed).shuffle(rows)
    rows = rows[: len(seq_lens)]
    off = 0
    for r, n in zip(rows, seq_lens, strict=True):
        table[r, :n] = perm[off : off + n]
        off += n
    return kb, vb, table.to(DEV), torch.tensor(rows, device=DEV)


def ref_attention(q, kb, vb, idx, q_pos, scale):
    """float64 SDPA over gathered K/V; query i sees keys at positions <= q_pos[i]."""
    k = kb[idx].double().transpose(0, 1)[None]
    v = vb[idx].double().transpose(0, 1)[None]
    mask = torch.arange(idx.numel(), device=q.device)[None, :] <= q_pos[:, None]
    return F.scaled_dot_product_attention(q.double().transpose(0, 1)[None], k, v, attn_mask=mask, scale=scale,
                                          enable_gqa=True)[0].transpose(0, 1)


def rel_err(a, b):
    return float((a.double() - b).norm() / b.norm())


KV_SCALES = (0.5, 2.0)  # an fp8 pool's K and V scales in these tests (not 1.0, so both must be applied)


def as_kv(kb, vb, kv: str | None):
    """The pool the kernels read (``kv``: None, or an fp8 ``kv_cache_dtype``: ``kb``/``vb``
    quantized with ``KV_SCALES``), the reference's float32 view of it, and the kernels'
    scale arguments."""
    if kv is None:
        return (kb, vb), (kb, vb), {}
    from radixd.core.kv_quant import FP8_DTYPES, dequantize, quantize

    dt = FP8_DTYPES[kv]
    ks, vs = KV_SCALES
    q8 = (quantize(kb, ks, dt), quantize(vb, vs, dt))
    return q8, (dequantize(q8[0], ks, torch.float32), dequantize(q8[1], vs, torch.float32)), \
        {"k_scale": ks, "v_scale": vs}


SMALL = [(4, 2, 32, [1, 7, 64, 65, 130]), (8, 8, 64, [3, 33, 100])]
REAL = [(32, 8, 128, [1, 17, 512, 2048, 4097, 300, 64, 1000]), (9, 3, 64, [1, 511, 8192, 100])]
TOL = 1e-5 if not GPU else 2e-2  # fp32 interpreter vs bf16 on the GPU


@pytest.mark.parametrize("heads,kv_heads,dim,seq_lens", REAL if GPU else SMALL)
@pytest.mark.parametrize("splits", [1, 4, 32])
def test_decode_matches_reference(heads, kv_heads, dim, seq_lens, splits):
    check_decode(heads, kv_heads, dim, seq_lens, splits)


@pytest.mark.parametrize("splits,kv", [(1, "fp8_e5m2"), (4, "fp8_e4m3")])
def test_decode_reads_an_fp8_pool(splits, kv):
    """fp8 K/V (scales 0.5 and 2.0) read in place: the reference over the dequantized pool."""
    check_decode(*(REAL if GPU else SMALL)[0], splits, kv)


@pytest.mark.parametrize("heads,kv_heads,dim,seq_lens", REAL[:1] if GPU else [(4, 2, 32, [1, 7, 130])])
@pytest.mark.parametrize("splits", [4, 32])
@pytest.mark.parametrize("pdl", [False, pytest.param(True, marks=pytest.mark.gpu)])
def test_decode_merged_in_stage_one_equals_two_stages(heads, kv_heads, dim, seq_lens, splits, pdl):
    """``merge_in_kernel``: the last split program of each (request, KV head) merges them (no
    stage 2): the two-stage output (float sums in another order: within a rounding of the
    output's dtype), splits with no key among them (1- and 7-token sequences); the counters
    left at 0, so a second call on the same counters (a graph's replay) gives the same."""
    if pdl and not (GPU and torch.cuda.get_device_capability()[0] >= 9):
        pytest.skip("programmatic dependent launch needs a GPU of compute capability 9.0")
    dtype = torch.bfloat16 if GPU else torch.float32
    kb, vb, table, rows = make_pool(sum(seq_lens) + 11, kv_heads, dim, dtype, seq_lens, seed=splits)
    q = torch.randn(len(seq_lens), heads, dim, device=DEV).to(dtype)
    lens = torch.tensor(seq_lens, device=DEV)
    want = decode_attention(q, kb, vb, table, rows, lens, dim**-0.5, num_splits=splits, pdl=pdl)
    counters = torch.zeros(len(seq_lens), kv_heads, dtype=torch.int32, device=DEV)
    for _ in range(2):
        out = torch.full_like(q, float("nan"))
        decode_attention(q, kb, vb, table, rows, lens, dim**-0.5, num_splits=splits, out=out, pdl=pdl,
                         merge_in_kernel=True, counters=counters)
        assert int(counters.abs().sum()) == 0
        torch.testing.assert_close(out, want, rtol=1e-6 if not GPU else 8e-3, atol=1e-6 if not GPU else 1e-3)


def check_decode(heads, kv_heads, dim, seq_lens, splits, kv=None, fp8_dot=False, tol=None):
    dtype = torch.bfloat16 if GPU else torch.float32
    kb, vb, table, rows = make_pool(sum(seq_lens) + 11, kv_heads, dim, dtype, seq_lens, seed=heads + splits)
    (kb, vb), (rk, rv), scales = as_kv(kb, vb, kv)
    q = torch.randn(len(seq_lens), heads, dim, device=DEV).to(dtype)
    lens = torch.tensor(seq_lens, device=DEV)
    out = torch.full_like(q, float("nan"))  # poisoned: every element must be written
    decode_attention(q, kb, vb, table, rows, lens, dim**-0.5, num_splits=splits, out=out, fp8_dot=fp8_dot, **scales)
    assert not out.isnan().any()
    errs = []
    for b, n in enumerate(seq_lens):
        idx = table[rows[b], :n]
        ref = ref_attention(q[b][None], rk, rv, idx, torch.tensor([n - 1], device=DEV), dim**-0.5)[0]
        errs.append(rel_err(out[b], ref))
    assert max(errs) < (tol or TOL), errs
    return max(errs)


def make_shared_pool(kv_heads, dim, dtype, groups, seed):
    """A pool whose table rows share prefixes: ``groups`` lists (shared length, [own lengths]);
    each group's rows point at the same slots for the shared part, then at their own."""
    g = torch.Generator().manual_seed(seed)
    total = sum(s + sum(own) for s, own in groups) + 7
    kb = torch.randn(total, kv_heads, dim, generator=g).to(DEV, dtype)
    vb = torch.randn(total, kv_heads, dim, generator=g).to(DEV, dtype)
    perm = (torch.randperm(total - 1, generator=g) + 1).tolist()
    n_rows = sum(len(own) for _, own in groups)
    width = max(s + max(own) for s, own in groups) + 3
    table = torch.zeros(n_rows + 1, width, dtype=torch.int64)
    rows, seq_lens = [], []
    for shared, own in groups:
        prefix = [perm.pop() for _ in range(shared)]
        for n in own:
            r = len(rows) + 1
            table[r, : shared + n] = torch.tensor(prefix + [perm.pop() for _ in range(n)])
            rows.append(r)
            seq_lens.append(shared + n)
    return kb, vb, table.to(DEV), rows, seq_lens


CASCADE_GROUPS = {
    # (kv heads, heads, dim): (shared length, own lengths of its members) per group; a group
    # of one is a request in no item
    "small": (2, 4, 32, [(128, [1, 5, 70]), (64, [3, 3]), (0, [40]), (200, [1, 9])]),
    "real": (8, 32, 128, [(2048, [1, 128, 300, 17]), (1024, [64] * 20), (0, [700]), (512, [1, 2])]),
}


@pytest.mark.parametrize("case", ["real"] if GPU else ["small"])
@pytest.mark.parametrize("splits,kv", [(1, None), (2, None), (1, "fp8_e4m3")])
def test_cascade_decode_matches_plain_decode(case, splits, kv):
    """Each item's members read the shared prefix once; every request's output equals plain
    split-KV decoding of its whole sequence (and the float64 reference)."""
    check_cascade(case, splits, kv)


def check_cascade(case, splits, kv=None):
    from radixd.core.attention.triton_kernels import cascade_decode_attention, prefix_members

    kv_heads, heads, dim, groups = CASCADE_GROUPS[case]
    dtype = torch.bfloat16 if GPU else torch.float32
    kb, vb, table, rows, seq_lens = make_shared_pool(kv_heads, dim, dtype, groups, seed=splits)
    (kb, vb), (rk, rv), scales = as_kv(kb, vb, kv)
    B = len(rows)
    per_item = prefix_members(heads // kv_heads)
    shares = [0] * B
    items = []  # (row, shared length, members)
    b = 0
    for shared, own in groups:
        mem = list(range(b, b + len(own)))
        b += len(own)
        if shared and len(mem) > 1:
            for k in range(0, len(mem), per_item):  # a group larger than an item: several items
                items.append((rows[mem[k]], shared, mem[k : k + per_item]))
            for m in mem:
                shares[m] = shared
    n_slots = len(items) + 3  # unused item slots (length 0) must be skipped
    members = torch.full((per_item, n_slots), -1, dtype=torch.int64)
    for i, (_, _, mem) in enumerate(items):
        members[: len(mem), i] = torch.tensor(mem)
    item_rows = torch.tensor([r for r, _, _ in items] + [0] * 3, device=DEV)
    item_lens = torch.tensor([n for _, n, _ in items] + [0] * 3, device=DEV)
    q = torch.randn(B, heads, dim, device=DEV).to(dtype)
    rows_t, lens_t = torch.tensor(rows, device=DEV), torch.tensor(seq_lens, device=DEV)
    scale = dim**-0.5
    out = torch.full_like(q, float("nan"))
    # items read in 1 to 4 splits (the grid's 4): each item's split count from its first member
    parts = [0] * B
    for i, (_, _, mem) in enumerate(items):
        for m in mem:
            parts[m] = 1 + i % 4
    cascade_decode_attention(q, kb, vb, table, rows_t, lens_t, scale, torch.tensor(shares, device=DEV),
                             torch.tensor(parts, device=DEV), item_rows, item_lens, members.to(DEV),
                             num_splits=splits, prefix_splits=4, out=out, **scales)
    assert not out.isnan().any()
    plain = decode_attention(q, kb, vb, table, rows_t, lens_t, scale, num_splits=splits, **scales)
    for b in range(B):
        idx = table[rows[b], : seq_lens[b]]
        ref = ref_attention(q[b][None], rk, rv, idx, torch.tensor([seq_lens[b] - 1], device=DEV), scale)[0]
        assert rel_err(out[b], ref) < TOL, b
        assert rel_err(out[b], plain[b].double()) < TOL, b


EXTEND_TILES = [None, (16, 16, 4, 2, False), (16, 16, 4, 2, True)] + (
    [c for c in triton_kernels.EXTEND_CONFIGS if len(c) < 6 or c[5] == 1] if GPU else [])  # (packs: below)


@pytest.mark.parametrize("config", EXTEND_TILES, ids=str)
@pytest.mark.parametrize("heads,kv_heads,dim,seq_lens", REAL if GPU else SMALL)
def test_extend_matches_reference(heads, kv_heads, dim, seq_lens, config):
    check_extend(heads, kv_heads, dim, seq_lens, config)


# Query heads packed into a program's rows (PACK): a group of 4 on the CPU, the 8B shape's on the GPU
PACKED_TILES = [(16, 16, 4, 2, True, 2), (16, 16, 4, 2, False, 4)] + (
    [c for c in triton_kernels.EXTEND_CONFIGS if len(c) > 5 and c[5] > 1] if GPU else [])


@pytest.mark.parametrize("config", PACKED_TILES, ids=str)
def test_extend_with_packed_heads_matches_reference(config):
    check_extend(*(REAL[0] if GPU else (8, 2, 32, [1, 7, 64, 65, 130])), config)


def test_extend_refuses_a_pack_that_does_not_divide_the_group():
    q = torch.zeros(4, 6, 16, device=DEV)
    kb = torch.zeros(8, 2, 16, device=DEV)
    one = torch.ones(1, dtype=torch.int64, device=DEV)
    with pytest.raises(ValueError, match="pack of 2 query heads must divide the group"):
        extend_attention(q, kb, kb, torch.zeros(1, 8, dtype=torch.int64, device=DEV), one * 0, one * 0, one * 4,
                         one * 0, 4, 0.25, config=(16, 16, 4, 2, True, 2))


@pytest.mark.parametrize("config,kv", [(None, "fp8_e5m2"), ((16, 16, 4, 2, True), "fp8_e4m3")], ids=str)
def test_extend_reads_an_fp8_pool(config, kv):
    check_extend(*(REAL if GPU else SMALL)[0], config, kv)


def check_extend(heads, kv_heads, dim, seq_lens, config, kv=None):
    dtype = torch.bfloat16 if GPU else torch.float32
    kb, vb, table, rows = make_pool(sum(seq_lens) + 11, kv_heads, dim, dtype, seq_lens, seed=dim)
    (kb, vb), (rk, rv), scales = as_kv(kb, vb, kv)
    rng = random.Random(dim)
    ext = [rng.randint(1, n) for n in seq_lens]  # the last `ext` tokens are new, the rest cached
    prefix = [n - e for n, e in zip(seq_lens, ext, strict=True)]
    starts = [sum(ext[:i]) for i in range(len(ext))]
    q = torch.randn(sum(ext), heads, dim, device=DEV).to(dtype)
    out = torch.full_like(q, float("nan"))
    t = lambda xs: torch.tensor(xs, device=DEV)  # noqa: E731
    extend_attention(q, kb, vb, table, rows, t(prefix), t(ext), t(starts), max(ext), dim**-0.5, out=out, config=config,
                     **scales)
    assert not out.isnan().any()
    for i, (p, e) in enumerate(zip(prefix, ext, strict=True)):
        idx = table[rows[i], : p + e]
        ref = ref_attention(q[starts[i] : starts[i] + e], rk, rv, idx, torch.arange(p, p + e, device=DEV), dim**-0.5)
        assert rel_err(out[starts[i] : starts[i] + e], ref) < TOL


def test_build_kv_indices():
    seq_lens = [3, 1, 40, 7]
    _, _, table, rows = make_pool(60, 1, 8, torch.float32, seq_lens, seed=3)
    indptr, idx = build_kv_indices(table, rows, torch.tensor(seq_lens, device=DEV))
    assert indptr.tolist() == [0, 3, 4, 44, 51]
    want = torch.cat([table[r, :n] for r, n in zip(rows.tolist(), seq_lens, strict=True)])
    assert torch.equal(idx, want)


@pytest.mark.parametrize("arch,merge", [("llama", False), ("qwen3", False), ("llama", True)])
async def test_engine_with_triton_backend_matches_transformers(tiny_models, arch, merge):
    """The whole engine on the triton backend: greedy tokens equal transformers' (fp32);
    also with decode attention's splits merged in its first kernel (``decode_merge_in_kernel``,
    its counters back at 0 after every step)."""
    from test_engine import assert_greedy_matches, collect, prompts

    from radixd import Engine

    path = tiny_models[arch]
    eng = Engine(model=str(path), kv_cache_tokens=1024, attention_backend="triton", dtype="float32",
                 chunked_prefill_size=16, decode_merge_in_kernel=merge)
    counters = eng.worker.attn.counters
    assert (counters is not None) == merge

    def hook(step):
        eng.check_accounting()
        assert counters is None or int(counters.abs().sum()) == 0

    eng.step_hook = hook
    try:
        import asyncio

        ps = prompts(2, 20, seed=12)
        outs = await asyncio.gather(*(collect(eng, p, 6) for p in ps))
        for p, got in zip(ps, outs, strict=True):
            assert_greedy_matches(path, p, got, 6)
    finally:
        await eng.stop()


async def test_decode_merge_in_kernel_refused_off_the_triton_backend(tiny_models):
    from radixd import Engine
    from radixd.core.errors import ConfigError

    with pytest.raises(ConfigError, match="decode_merge_in_kernel"):
        Engine(model=str(tiny_models["llama"]), kv_cache_tokens=256, attention_backend="torch",
               decode_merge_in_kernel=True)
    eng = Engine(model=str(tiny_models["llama"]), kv_cache_tokens=256, attention_backend="torch",
                 decode_merge_in_kernel=False)  # (asks for nothing)
    await eng.stop()


async def test_engine_mixed_steps_on_triton_backend_match_transformers(tiny_models, monkeypatch):
    """Prompts arriving while others decode, in chunks of 8 tokens: steps carry decodes beside
    prompt chunks (the decode kernel for the former); greedy tokens equal transformers'."""
    import asyncio

    from test_engine import assert_greedy_matches, collect, prompts

    from radixd import Engine
    from radixd.core.attention import triton_backend

    monkeypatch.setattr(triton_backend, "MIXED_DECODE_ROWS", 1)
    path = tiny_models["llama"]
    eng = Engine(model=str(path), kv_cache_tokens=1024, attention_backend="triton", dtype="float32",
                 chunked_prefill_size=8, max_prefill_tokens=8)
    mixed = []
    eng.step_hook = lambda step: (eng.check_accounting(), mixed.append(
        1 in step.batch.extend_lens and max(step.batch.extend_lens) > 1))
    ps = prompts(3, 21, seed=4)
    try:
        first = asyncio.ensure_future(collect(eng, ps[0], 12))
        while len(mixed) < 4:  # until the first request decodes (its prompt is three chunks)
            await asyncio.sleep(0.01)
        outs = [await first, *await asyncio.gather(*(collect(eng, p, 4) for p in ps[1:]))]
    finally:
        await eng.stop()
    assert sum(mixed) >= 2
    for p, got, n in zip(ps, outs, (12, 4, 4), strict=True):
        assert_greedy_matches(path, p, got, n)


async def test_engine_decodes_shared_prefixes_in_cascade(tiny_models):
    """Requests sharing a 260-token system prompt decode in cascade (one item, the prefix read
    once per step); their greedy tokens equal transformers' (fp32)."""
    import asyncio
    import random

    from test_engine import assert_greedy_matches, collect

    from radixd import Engine

    path = tiny_models["llama"]
    rng = random.Random(3)
    system = [rng.randrange(2, 256) for _ in range(260)]
    ps = [system + [rng.randrange(2, 256) for _ in range(5 + i)] for i in range(3)]
    eng = Engine(model=str(path), kv_cache_tokens=2048, attention_backend="triton", dtype="float32")
    items = []
    eng.step_hook = lambda step: (eng.check_accounting(), step.batch.shared and items.append(step.batch.shared))
    try:
        outs = await asyncio.gather(*(collect(eng, p, 5) for p in ps))
    finally:
        await eng.stop()
    assert items, "no decode step ran in cascade"
    # one item of every request in the step (the prefix rounded down to whole 64-token chunks)
    assert all(sh.item_lens == [256] and sorted(sh.members[0]) == list(range(len(sh.shares))) for sh in items)
    assert any(len(sh.shares) == 3 for sh in items)
    # the same requests decoding step after step reuse one plan (built once, not per step)
    assert len({id(sh) for sh in items}) < len(items)
    for p, got in zip(ps, outs, strict=True):
        assert_greedy_matches(path, p, got, 5)


# ------------------------------------------------------------------------ fused element-wise ops


@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rmsnorm_kernel(with_residual):
    from radixd.core.triton_ops import add_rmsnorm

    dtype = torch.bfloat16 if GPU else torch.float32
    dim = 4096 if GPU else 96
    x = torch.randn(37, dim, device=DEV).to(dtype)
    w = torch.randn(dim, device=DEV).to(dtype)
    res = torch.randn(37, dim, device=DEV).to(dtype) if with_residual else None
    ref_sum = (x.double() + res.double()) if with_residual else x.double()
    ref = ref_sum * torch.rsqrt(ref_sum.pow(2).mean(-1, keepdim=True) + 1e-5) * w.double()
    out, new_res = add_rmsnorm(x, w, 1e-5, res.clone() if with_residual else None, use_triton=True)
    assert rel_err(out, ref) < (2e-2 if GPU else 1e-5)
    assert rel_err(new_res, ref_sum) < (1e-2 if GPU else 1e-6)


def test_silu_mul_kernel():
    from radixd.core.triton_ops import silu_mul

    dtype = torch.bfloat16 if GPU else torch.float32
    x = torch.randn(9, 2 * (14336 if GPU else 1100), device=DEV).to(dtype)
    gate, up = x.double().chunk(2, dim=-1)
    ref = F.silu(gate) * up
    assert rel_err(silu_mul(x, use_triton=True), ref) < (2e-2 if GPU else 1e-5)


@pytest.mark.parametrize("n,k,bias", [(37, 96, False), (5, 4096, True), (33, 3072, False)] if not GPU else
                         [(6144, 4096, False), (4096, 7168, False), (3072, 4096, True), (1536, 576, True)])
def test_gemv_kernel(n, k, bias):
    from radixd.core.triton_ops import gemv, gemv_tiles

    dtype = torch.bfloat16 if GPU else torch.float32
    g = torch.Generator().manual_seed(n + k)
    x = torch.randn(1, k, generator=g).to(DEV, dtype)
    w = torch.randn(n, k, generator=g).to(DEV, dtype)
    b = torch.randn(n, generator=g).to(DEV, dtype) if bias else None
    ref = F.linear(x.double(), w.double(), b.double() if bias else None)
    out = gemv(x, w, b)
    assert out.shape == (1, n) and out.dtype == dtype
    assert rel_err(out, ref) < (1e-2 if GPU else 1e-6)
    assert gemv_tiles(k)[1] in (1024, 2048) or k < 1024


@pytest.mark.parametrize("inter,k", [(37, 96), (300, 2048)] if not GPU else [(14336, 4096), (7168, 4096), (1536, 576)])
def test_gemv_silu_mul_kernel(inter, k):
    from radixd.core.triton_ops import gemv_silu_mul

    dtype = torch.bfloat16 if GPU else torch.float32
    g = torch.Generator().manual_seed(inter)
    x = torch.randn(1, k, generator=g).to(DEV, dtype)
    w = (torch.randn(2 * inter, k, generator=g) / k**0.5).to(DEV, dtype)
    gate, up = F.linear(x.double(), w.double()).chunk(2, dim=-1)
    out = gemv_silu_mul(x, w)
    assert out.shape == (1, inter) and out.dtype == dtype
    assert rel_err(out, F.silu(gate) * up) < (2e-2 if GPU else 1e-6)


@pytest.mark.parametrize("heads,kv_heads,dim,k,bias", [(4, 2, 16, 96, False), (3, 1, 32, 64, True)] if not GPU else
                         [(32, 8, 128, 4096, False), (16, 4, 128, 4096, False), (14, 2, 64, 896, True)])
def test_gemv_rope_store_kernel(heads, kv_heads, dim, k, bias):
    from radixd.core.models.layers import Rotary
    from radixd.core.triton_ops import gemv_rope_store

    dtype = torch.bfloat16 if GPU else torch.float32
    g = torch.Generator().manual_seed(heads * dim)
    n = (heads + 2 * kv_heads) * dim
    x = torch.randn(1, k, generator=g).to(DEV, dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(DEV, dtype)
    b = torch.randn(n, generator=g).to(DEV, dtype) if bias else None
    rot = Rotary(dim, 4096, 500000.0, None).to(DEV)
    pos = torch.tensor([1234], device=DEV)
    loc = torch.tensor([7], device=DEV)
    qkv = F.linear(x.double(), w.double(), b.double() if bias else None)
    q, kk, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    ref_q, ref_k = rot(pos, q.view(1, heads, dim), kk.view(1, kv_heads, dim))
    kb = torch.zeros(10, kv_heads, dim, device=DEV, dtype=dtype)
    vb = torch.zeros_like(kb)
    out = gemv_rope_store(x, w, b, pos, rot.cos, rot.sin, kb, vb, loc, num_heads=heads)
    tol = 2e-2 if GPU else 1e-6
    assert out.shape == (1, heads, dim)
    assert rel_err(out, ref_q) < tol
    assert rel_err(kb[7], ref_k[0]) < tol
    assert rel_err(vb[7], v.view(kv_heads, dim)) < tol
    kb[7] = 0
    vb[7] = 0
    assert not kb.any() and not vb.any()  # only the token's slot is written


def test_one_row_paths_fuse_only_for_one_cuda_row(monkeypatch):
    from radixd.core import triton_ops
    from radixd.core.models.layers import GatedMLP

    calls = []
    monkeypatch.setattr(triton_ops, "gemv_silu_mul", lambda x, w: calls.append(x.shape) or triton_ops.silu_mul(F.linear(x, w)))
    mlp = GatedMLP(64, 48).to(DEV, torch.bfloat16 if GPU else torch.float32)
    for rows in (1, 3):
        x = torch.randn(rows, 64, device=DEV).to(mlp.down_proj.weight.dtype)
        gate, up = F.linear(x, mlp.gate_up_proj.weight).chunk(2, dim=-1)
        assert torch.allclose(mlp(x), F.linear(F.silu(gate) * up, mlp.down_proj.weight), rtol=2e-2, atol=2e-2)
    assert calls == ([(1, 64)] if GPU else [])
    mlp.kernels = triton_ops.KernelChoice(fuse_one_row=False)
    calls.clear()
    mlp(torch.randn(1, 64, device=DEV).to(mlp.down_proj.weight.dtype))
    assert calls == []


@pytest.mark.parametrize("vocab", [7, 4096, 5000, 128256])
def test_argmax_rows_kernel(vocab):
    from radixd.core.triton_ops import argmax_rows

    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(5, vocab, generator=g).to(DEV)
    x[1, vocab // 2] = x[1, vocab - 1] = 50.0  # a tie: the first index wins, as in torch
    x[2, :] = -1.0                              # all equal
    x[3, 0] = float("-inf")
    got = argmax_rows(x, use_triton=True)
    assert got.dtype == torch.int64
    assert torch.equal(got, x.argmax(dim=-1))
    assert int(got[1]) == vocab // 2 and int(got[2]) == 0


def test_linear_uses_gemv_for_one_cuda_row(monkeypatch):
    from radixd.core import triton_ops

    calls = []
    monkeypatch.setattr(triton_ops, "gemv", lambda x, w, b=None: calls.append(x.shape) or F.linear(x, w, b))
    monkeypatch.setattr(triton_ops, "rows_linear", lambda x, w, b=None, **kw: calls.append(("rows", *x.shape)) or F.linear(x, w, b))
    monkeypatch.setattr(triton_ops, "rows_tiles", lambda m, n, k, **kw: (32, 64, 4, 2, 1))  # (as if measured)
    layer = torch.nn.Linear(64, 32, bias=False).to(DEV, torch.bfloat16 if GPU else torch.float32)
    for rows in (1, 3, triton_ops.ROWS_MAX_M + 1):
        x = torch.randn(rows, 64, device=DEV).to(layer.weight.dtype)
        assert torch.equal(triton_ops.linear(x, layer), layer(x))
    # one CUDA row of a 16-bit model takes the GEMV, a few the rows kernel; CPU and many rows
    # use the module
    assert calls == ([(1, 64), ("rows", 3, 64)] if GPU else [])
    calls.clear()
    triton_ops.linear(torch.randn(3, 64, device=DEV).to(layer.weight.dtype), layer,
                      triton_ops.KernelChoice(rows_kernel=False))
    assert calls == []


def test_rows_tiles_come_from_the_measured_table(monkeypatch):
    from radixd.core import triton_ops

    table = {"4096x14336": {"16": [64, 128, 4, 4, 4], "64": [64, 256, 4, 3, 2], "128": None},
             "14336x4096 silu": {"4": [128, 128, 4, 3, 1]}}
    monkeypatch.setattr(triton_ops, "_tuned_rows", lambda device: table)
    cpu = torch.device("cpu")
    assert triton_ops.rows_tiles(2, 4096, 14336, device=cpu) == (64, 128, 4, 4, 4)
    assert triton_ops.rows_tiles(16, 4096, 14336, device=cpu) == (64, 128, 4, 4, 4)
    assert triton_ops.rows_tiles(17, 4096, 14336, device=cpu) == (64, 256, 4, 3, 2)  # next measured bucket up
    assert triton_ops.rows_tiles(100, 4096, 14336, device=cpu) is None  # cuBLAS was as fast there
    assert triton_ops.rows_tiles(4, 14336, 4096, silu=True, device=cpu) == (128, 128, 4, 3, 1)
    assert triton_ops.rows_tiles(5, 14336, 4096, silu=True, device=cpu) is None  # beyond the measured rows
    assert triton_ops.rows_tiles(4, 14336, 4096, device=cpu) is None  # the plain product was not measured
    assert triton_ops.rows_tiles(4, 4096, 4096, device=cpu) is None  # nor this shape
    assert triton_ops.rows_tiles(triton_ops.ROWS_MAX_M + 1, 4096, 14336, device=cpu) is None


def test_tuned_rows_table_is_well_formed():
    import json

    from radixd.core import triton_ops

    table = json.loads(triton_ops.ROWS_TUNED.read_text())
    assert table, "no GPU measured"
    for gpu, shapes in table.items():
        for key, buckets in shapes.items():
            n, k = map(int, key.split()[0].split("x"))
            assert key == triton_ops.rows_shape_key(n, k, key.endswith(" silu")), (gpu, key)
            for m, tiles in buckets.items():
                assert 1 < int(m) <= triton_ops.ROWS_MAX_M, (gpu, key, m)
                assert tiles is None or (len(tiles) == 5 and all(t > 0 for t in tiles)), (gpu, key, m, tiles)


ROWS_CASES = ([(3, 37, 96, False, False), (17, 40, 64, True, False), (5, 24, 80, False, True), (2, 70, 48, False, False)]
              if not GPU else
              [(2, 6144, 4096, False, False), (17, 4096, 4096, True, False), (64, 14336, 4096, False, True),
               (128, 4096, 14336, False, False), (33, 1536, 576, True, False), (64, 2048, 4096, False, True)])


@pytest.mark.parametrize("m,n,k,bias,silu", ROWS_CASES)
def test_rows_linear_kernel(m, n, k, bias, silu):
    from radixd.core import triton_ops
    from radixd.core.triton_ops import rows_linear

    dtype = torch.bfloat16 if GPU else torch.float32
    g = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, k, generator=g).to(DEV, dtype)
    w = (torch.randn(2 * n if silu else n, k, generator=g) / k**0.5).to(DEV, dtype)
    b = torch.randn(n, generator=g).to(DEV, dtype) if bias else None
    ref = F.linear(x.double(), w.double(), b.double() if bias else None)
    if silu:
        gate, up = ref.chunk(2, dim=-1)
        ref = F.silu(gate) * up
    out = torch.full((m + 1, n), float("nan"), device=DEV, dtype=dtype)  # a wider buffer: rows past m untouched
    got = rows_linear(x, w, b, silu=silu, out=out[:m])
    assert got.shape == (m, n) and got.dtype == dtype
    assert rel_err(got, ref) < (2e-2 if GPU else 1e-6)
    assert out[m].isnan().all()
    # K split over programs (the last of a tile's programs sums the slices), uneven K
    # slices and tiles smaller than the rows (through the interpreter)
    for tiles in [(64, 128, 4, 3, 4), (32, 256, 4, 3, 3)] if GPU else [(16, 32, 4, 1, 1), (16, 32, 4, 1, 3)]:
        bn, split = tiles[0], tiles[4]
        if -(-n // bn) * split * (2 if silu else 1) * bn * max(16, triton.next_power_of_2(m)) > triton_ops.ROWS_SCRATCH:
            with pytest.raises(ValueError, match="no split-K scratch"):  # asked for, so not silently unsplit
                rows_linear(x, w, b, silu=silu, tiles=tiles)
            continue
        got = rows_linear(x, w, b, silu=silu, tiles=tiles)
        assert rel_err(got, ref) < (2e-2 if GPU else 1e-6), tiles
        for _, count in triton_ops._rows_scratch.values():
            assert not count.any()  # the arrival counters are back to zero for the next launch
        again = rows_linear(x, w, b, silu=silu, tiles=tiles)
        assert torch.equal(again, got)  # the same sum whichever program of a tile finishes last


def test_rope_store_kernel():
    from radixd.core.models.layers import Rotary
    from radixd.core.triton_ops import rope_store

    dtype = torch.bfloat16 if GPU else torch.float32
    T, H, Hkv, D = 11, 8, 2, 64
    rot = Rotary(D, 4096, 500000.0, None).to(DEV)
    qkv = torch.randn(T, (H + 2 * Hkv) * D, device=DEV).to(dtype)
    q, k, v = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)  # strided views, as in the model
    q, k, v = q.view(T, H, D), k.view(T, Hkv, D), v.view(T, Hkv, D)
    pos = torch.randint(0, 4000, (T,), device=DEV)
    ref_q, ref_k = rot(pos, q.double(), k.double())
    kb = torch.zeros(50, Hkv, D, device=DEV, dtype=dtype)
    vb = torch.zeros_like(kb)
    loc = torch.randperm(49, device=DEV)[:T] + 1
    q_in = q.clone()
    rope_store(q_in, k, v, pos, rot.cos, rot.sin, kb, vb, loc)
    tol = 1e-2 if GPU else 1e-6
    assert rel_err(q_in, ref_q) < tol
    assert rel_err(kb[loc], ref_k) < tol
    assert torch.equal(vb[loc], v)
    untouched = torch.ones(50, dtype=torch.bool, device=DEV)
    untouched[loc] = False
    assert not kb[untouched].any() and not vb[untouched].any()
    q_out = torch.full((T, H, D), float("nan"), device=DEV, dtype=dtype)  # (contiguous, poisoned)
    q_kept = q.clone()
    rope_store(q, k, v, pos, rot.cos, rot.sin, kb, vb, loc, q_out=q_out)
    assert torch.equal(q_out, q_in) and torch.equal(q, q_kept)  # rotated into q_out, q left as it was


def test_rope_store_applies_the_qk_norms():
    """``rope_store(qk_norm=...)``: each q and k head RMS-normalised (Qwen3's norms) and then
    rotated, as ``RMSNorm`` then the plain ``rope_store`` give them; v untouched."""
    from radixd.core.models.layers import RMSNorm, Rotary
    from radixd.core.triton_ops import rope_store

    dtype = torch.bfloat16 if GPU else torch.float32
    T, H, Hkv, D = 5, 4, 2, 32
    rot = Rotary(D, 4096, 1e6, None).to(DEV)
    qn, kn = RMSNorm(D, 1e-6).to(DEV, dtype), RMSNorm(D, 1e-6).to(DEV, dtype)
    with torch.no_grad():
        qn.weight.copy_(torch.rand(D) + 0.5)
        kn.weight.copy_(torch.rand(D) + 0.5)
    qkv = (torch.randn(T, (H + 2 * Hkv) * D) * 3).to(DEV, dtype)
    q, k, v = (a.view(T, -1, D) for a in qkv.split([H * D, Hkv * D, Hkv * D], dim=-1))
    pos = torch.randint(0, 4000, (T,), device=DEV)
    loc = torch.randperm(20, device=DEV)[:T] + 1
    bufs = [torch.zeros(21, Hkv, D, device=DEV, dtype=dtype) for _ in range(4)]
    q_ref = qn(q).contiguous()
    rope_store(q_ref, kn(k), v, pos, rot.cos, rot.sin, bufs[0], bufs[1], loc)
    q_in = q.clone()
    rope_store(q_in, k, v, pos, rot.cos, rot.sin, bufs[2], bufs[3], loc, qk_norm=(qn.weight, kn.weight, 1e-6))
    tol = 1e-2 if GPU else 1e-6
    assert rel_err(q_in, q_ref) < tol and rel_err(bufs[2], bufs[0]) < tol
    assert torch.equal(bufs[3], bufs[1])


def test_decode_splits_fill_the_device():
    from radixd.core.attention.triton_backend import MAX_SPLITS, MIN_SPLITS, decode_splits

    assert decode_splits(1, 8, 132) == MAX_SPLITS  # one request: as many splits as allowed
    assert decode_splits(4, 8, 132) == 16  # 4 x 8 x 16 = 512 programs >= 2 x 132
    assert decode_splits(64, 8, 132) == MIN_SPLITS == 1  # 512 programs: no split
    for b in (1, 2, 3, 5, 16, 100):
        s = decode_splits(b, 2, 132)
        assert MIN_SPLITS <= s <= MAX_SPLITS and s & (s - 1) == 0


FUSED_STEPS = {
    # name: (prefixes, new tokens) of a step's extends, and its fused calls at MIN_TOKENS 8
    # as (fresh, joined, split, rest, exact) with table rows = positions
    "fresh runs": ([0, 0, 0, 0], [12, 12, 12, 9], ([(0, 2, 12), (24, 1, 12), (36, 1, 9)], [], [], [], False)),
    "exact shapes": ([0, 0, 0], [16, 16, 8], ([(0, 2, 16), (32, 1, 8)], [], [], [], True)),
    "all kinds": ([0, 3, 0, 30, 0, 8], [12, 12, 9, 10, 3, 40],
                  ([(0, 1, 12), (24, 1, 9)], [(12, 12, 1, 3), (46, 40, 5, 8)], [(33, 10, 3, 30)], [4], False)),
}


@pytest.mark.parametrize("in_order", [True, False])
@pytest.mark.parametrize("case", FUSED_STEPS)
def test_long_extends_attend_in_fused_kernels(case, in_order, monkeypatch):
    """With ``dense_prefill``, a step's long extends attend in the fused kernels (cuDNN's; on
    the CPU the flash kernel) and the short ones in the extend kernel, in one step: fresh
    prompts in power-of-two batches of a run of one length, a chunk after a short prefix in
    one causal call led by zero rows, after a longer one in two calls merged by log-sum-exp;
    K/V read from the pool as views where the slots ascend, else gathered; q rotated into a
    contiguous copy, or in place (strided, as projected) where every call has an exact-shape
    plan. Rows equal the torch backend's; with the option off every extend takes the extend
    kernel."""
    from radixd.core.attention import dense_prefill, make_backend, triton_backend
    from radixd.core.forward_batch import ForwardBatch
    from radixd.core.kv_pool import KVPool
    from radixd.core.models.layers import Rotary

    prefix, extend_lens, calls = FUSED_STEPS[case]
    heads, kv_heads, dim = 4, 2, 32
    dtype = torch.bfloat16 if GPU else torch.float32  # (CUDA's fused path is for 16-bit pools)
    b = len(extend_lens)
    pool = KVPool(num_layers=1, num_slots=256, num_kv_heads=kv_heads, head_dim=dim, max_rows=b + 1,
                  max_context_len=64, dtype=dtype, device=torch.device(DEV))
    g = torch.Generator().manual_seed(8)
    slots = torch.arange(1, 256) if in_order else torch.randperm(255, generator=g) + 1
    off, locs, pos = 0, [], []
    for i in range(b):  # (prefixes first, then the step's new tokens: in order, the step's slots ascend)
        pool.req_to_token[i, :prefix[i]] = slots[off : off + prefix[i]].to(DEV)
        off += prefix[i]
    for i in range(b):
        n = extend_lens[i]
        pool.req_to_token[i, prefix[i] : prefix[i] + n] = slots[off : off + n].to(DEV)
        locs.append(slots[off : off + n])
        pos.append(torch.arange(prefix[i], prefix[i] + n))
        off += n
    pool.k_buffers[0].copy_(torch.randn(pool.k_buffers[0].shape, generator=g))
    pool.v_buffers[0].copy_(torch.randn(pool.v_buffers[0].shape, generator=g))
    t = sum(extend_lens)
    fb = ForwardBatch(input_ids=torch.zeros(t, dtype=torch.int64), positions=torch.cat(pos),
                      out_cache_loc=torch.cat(locs), rows=list(range(b)), prefix_lens=prefix, extend_lens=extend_lens)
    qkv = torch.randn(t, (heads + 2 * kv_heads) * dim, generator=g, dtype=dtype)
    rotary = Rotary(dim, 64, 10000.0, None).to(DEV)
    monkeypatch.setattr(dense_prefill, "MIN_TOKENS", 8)
    monkeypatch.setattr(dense_prefill, "CALL_FLOPS", 0.0)  # (these tiny steps: fused calls whatever their work)

    def projected():  # (strided views of a fresh q/k/v projection's output, as the model passes them)
        q, k, v = qkv.clone().to(DEV).split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
        return q.view(t, heads, dim), k.view(t, kv_heads, dim), v.view(t, kv_heads, dim)

    extends = []
    plain = triton_backend.extend_attention
    monkeypatch.setattr(triton_backend, "extend_attention",
                        lambda *a, **kw: extends.append(a[6].tolist()) or plain(*a, **kw))
    outs, steps = {}, {}
    for name, on in (("torch", True), ("triton", True), ("kernel", False)):
        attn = make_backend("torch" if name == "torch" else "triton", pool, num_heads=heads, head_dim=dim,
                            scale=dim**-0.5, dense_prefill=on)
        attn.warm_up()
        attn.begin(fb)
        steps[name] = getattr(attn, "dense", None)
        q, k, v = projected()
        outs[name] = attn.forward(q, k, v, 0, fb.positions.to(DEV), rotary).cpu()
        if name == "triton" and steps[name] is not None:
            assert q.stride() == attn.plans.q_strides
            rotated = not torch.equal(q.cpu(), projected()[0].cpu())
            assert rotated == steps[name].exact  # (rotated in place only for a step of exact-shape plans)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    assert rel_err(outs["triton"], outs["torch"].double()) < tol
    assert rel_err(outs["kernel"], outs["torch"].double()) < tol
    step = steps["triton"]
    assert (step.fresh, step.joined, step.split, step.rest, step.exact) == calls
    rest = calls[3]
    assert step.first == (1 + sum(prefix) if in_order else None)
    assert steps["kernel"] is None
    # the extend kernel: the short extends of the fused step, then every extend with the option off
    assert extends == ([[extend_lens[i] for i in rest]] if rest else []) + [extend_lens]


async def test_engine_long_extends_in_fused_kernels_match_transformers(tiny_models, monkeypatch):
    """The engine on the triton backend with ``dense_prefill``: prompts' chunks in the fused
    kernels (fresh, after a short prefix in one call, after a longer one in two) and their
    short tails in the extend kernel; greedy tokens equal transformers' (the CPU oracle, fp32;
    CUDA's fused path is for 16-bit pools, checked against the torch backend above)."""
    import asyncio

    from test_engine import assert_greedy_matches, collect, prompts

    from radixd import Engine
    from radixd.core.attention import dense_prefill

    if GPU:
        pytest.skip("fp32 greedy equality is the CPU oracle; on CUDA this path takes 16-bit pools")
    monkeypatch.setattr(dense_prefill, "MIN_TOKENS", 4)
    monkeypatch.setattr(dense_prefill, "CALL_FLOPS", 0.0)
    steps = []
    plain = dense_prefill.attend
    monkeypatch.setattr(dense_prefill, "attend", lambda step, *a: steps.append(step) or plain(step, *a))
    path = tiny_models["llama"]
    eng = Engine(model=str(path), kv_cache_tokens=1024, attention_backend="triton", dtype="float32",
                 chunked_prefill_size=16, dense_prefill=True)
    eng.step_hook = lambda step: eng.check_accounting()
    ps = prompts(3, 37, seed=9)
    try:
        outs = await asyncio.gather(*(collect(eng, p, 5) for p in ps))
        ps.append(ps[0][:2] + prompts(1, 30, seed=10)[0])  # (2 tokens cached: one call, led by 2 zero rows)
        outs.append(await collect(eng, ps[-1], 5))
    finally:
        await eng.stop()
    assert any(s.fresh for s in steps) and any(s.joined for s in steps) and any(s.split for s in steps)
    for p, got in zip(ps, outs, strict=True):
        assert_greedy_matches(path, p, got, 5)


@pytest.mark.parametrize("extend_lens", [[1, 1, 4], [1, 5, 1, 3, 1]])
def test_mixed_step_decodes_its_one_token_rows(extend_lens, monkeypatch):
    """A step of decodes beside prompt chunks: the triton backend attends the one-token rows
    with the decode kernel (leading the step, or anywhere in it) and the others with the
    extend kernel; every row equals the torch backend's."""
    from radixd.core.attention import make_backend, triton_backend
    from radixd.core.forward_batch import ForwardBatch
    from radixd.core.kv_pool import KVPool
    from radixd.core.models.layers import Rotary

    heads, kv_heads, dim = 4, 2, 32
    prefix = [7, 0, 12, 3, 30][: len(extend_lens)]
    b = len(extend_lens)
    pool = KVPool(num_layers=1, num_slots=256, num_kv_heads=kv_heads, head_dim=dim, max_rows=b + 1,
                  max_context_len=64, dtype=torch.float32, device=torch.device(DEV))
    g = torch.Generator().manual_seed(5)
    perm = torch.randperm(255, generator=g) + 1
    rows = list(range(b))[::-1]
    off, locs, pos = 0, [], []
    for i in range(b):
        n = prefix[i] + extend_lens[i]
        pool.req_to_token[rows[i], :n] = perm[off : off + n].to(DEV)
        locs.append(perm[off + prefix[i] : off + n])
        pos.append(torch.arange(prefix[i], n))
        off += n
    pool.k_buffers[0].copy_(torch.randn(pool.k_buffers[0].shape, generator=g))
    pool.v_buffers[0].copy_(torch.randn(pool.v_buffers[0].shape, generator=g))
    t = sum(extend_lens)
    fb = ForwardBatch(input_ids=torch.zeros(t, dtype=torch.int64), positions=torch.cat(pos),
                      out_cache_loc=torch.cat(locs), rows=rows, prefix_lens=prefix, extend_lens=extend_lens)
    q, k, v = (torch.randn(t, h, dim, generator=g) for h in (heads, kv_heads, kv_heads))
    rotary = Rotary(dim, 64, 10000.0, None).to(DEV)
    monkeypatch.setattr(triton_backend, "MIXED_DECODE_ROWS", 1)  # (at these sizes; tested at its own below)
    decodes = []
    plain = triton_backend.decode_attention
    monkeypatch.setattr(triton_backend, "decode_attention", lambda q, *a, **kw: decodes.append(q.shape[0]) or plain(q, *a, **kw))
    outs = {}
    for name in ("torch", "triton"):
        attn = make_backend(name, pool, num_heads=heads, head_dim=dim, scale=dim**-0.5)
        attn.begin(fb)
        outs[name] = attn.forward(q.clone().to(DEV), k.clone().to(DEV), v.clone().to(DEV), 0,
                                  fb.positions.to(DEV), rotary).cpu()
    assert decodes == [extend_lens.count(1)]  # one decode launch for the step's one-token rows
    assert rel_err(outs["triton"], outs["torch"].double()) < 1e-3
    monkeypatch.setattr(triton_backend, "MIXED_DECODE_ROWS", extend_lens.count(1) + 1)  # too few: all extend
    attn = make_backend("triton", pool, num_heads=heads, head_dim=dim, scale=dim**-0.5)
    attn.begin(fb)
    few = attn.forward(q.clone().to(DEV), k.clone().to(DEV), v.clone().to(DEV), 0, fb.positions.to(DEV), rotary).cpu()
    assert len(decodes) == 1 and rel_err(few, outs["torch"].double()) < 1e-3
