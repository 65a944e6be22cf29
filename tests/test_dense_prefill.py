"""Prompt chunks in cuDNN's fused kernels over a fixed set of plans (``dense_prefill``): the
step planner and the keys built at start on the CPU; on a GPU (``-m gpu``) the plans themselves:
built once, no plan for a new length inside a bucket, outputs against a float64 reference."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch
import torch.nn.functional as F

from radixd.core.attention import dense_prefill
from radixd.core.attention.dense_prefill import DensePlans, Key, bucket, plan, wanted

GPU = torch.cuda.is_available()


def test_bucket_rounds_up_to_a_power_of_two():
    assert [bucket(n) for n in (1, 2, 3, 255, 256, 257, 2048, 2049)] == [1, 2, 4, 256, 256, 512, 2048, 4096]


def starts_of(lens: list[int]) -> list[int]:
    out, at = [], 0
    for n in lens:
        out.append(at)
        at += n
    return out


def test_fresh_runs_split_into_power_of_two_batches():
    lens = [300] * 7 + [1000, 1000]
    fresh, joined, split, rest, exact = plan(lens, [0] * 9, list(range(9)), starts_of(lens), lambda k: True)
    assert fresh == [(0, 4, 300), (1200, 2, 300), (1800, 1, 300), (2100, 2, 1000)]
    assert joined == split == rest == [] and exact  # (every key ready, exact ones too)


def test_a_batch_without_a_plan_takes_smaller_ones_and_a_length_without_one_the_kernel():
    lens = [300] * 4 + [5000] + [100]
    ready = {Key(True, False, 2, 512, 512), Key(True, False, 1, 512, 512)}.__contains__
    fresh, joined, split, rest, exact = plan(lens, [0] * 6, list(range(6)), starts_of(lens), ready)
    assert fresh == [(0, 2, 300), (600, 2, 300)]  # (no plan of batch 4)
    assert rest == [4, 5]  # 5000 tokens: no plan of that length; 100: too short


def test_a_chunk_after_a_short_prefix_joins_it_and_after_a_long_one_splits():
    lens, prefixes = [512, 1024, 1024, 2048], [100, 256, 257, 24576]
    fresh, joined, split, rest, exact = plan(lens, prefixes, [7, 8, 9, 10], starts_of(lens), lambda k: True)
    assert joined == [(0, 512, 7, 100), (512, 1024, 8, 256)]  # p < 256; 4p <= n
    assert split == [(1536, 1024, 9, 257), (2560, 2048, 10, 24576)]
    assert fresh == rest == []
    asked = []
    plan(lens, prefixes, [7, 8, 9, 10], starts_of(lens), lambda k: asked.append(k) or True)
    assert asked == [Key(True, False, 1, 1024, 1024), Key(True, False, 1, 2048, 2048),
                     Key(False, True, 1, 1024, 512), Key(True, True, 1, 1024, 1024),
                     Key(False, True, 1, 2048, 32768), Key(True, True, 1, 2048, 2048)]


def test_a_step_has_exact_plans_only_where_every_call_has_one():
    """Exact-shape keys: fresh prompts of a power-of-two length (in the step budget), a chunk of
    exactly the chunk size after whole chunks; a step takes them only if all its calls do."""
    have = set(wanted(256, 2048, 4096, 131072))
    cases = [([0], [2048], True), ([0, 0], [1024, 1024], True), ([4096], [2048], True), ([0, 4096], [1024, 2048], True),
             ([0], [2000], False), ([0, 0], [2048, 300], False), ([100], [512], False), ([3000], [2048], False),
             ([2048 * 17], [2048], False)]
    for prefixes, lens, exact in cases:
        fresh, joined, split, rest, got = plan(lens, prefixes, list(range(len(lens))), starts_of(lens), have.__contains__)
        assert not rest and got == exact, (prefixes, lens)


def test_a_step_takes_fused_calls_only_with_enough_device_work():
    """Batch-1 prompts of a few thousand tokens at the 8B shape keep the extend kernel (the
    fused call's host time would show), 8 x 2048 fresh prompts or a 32k prompt's chunks take
    the fused calls; the threshold grows with the calls."""
    from radixd.core.attention.dense_prefill import CALL_FLOPS, layer_flops

    width = 32 * 128
    assert layer_flops(2048, width, [(2048, 0)]) < CALL_FLOPS
    assert layer_flops(16384, width, [(2048, 0)] * 8) >= CALL_FLOPS
    assert layer_flops(8192, width, [(8192, 0)]) >= CALL_FLOPS
    assert layer_flops(8192, width, [(8192, 24576)]) >= 2 * CALL_FLOPS  # (a split chunk: two calls)
    assert layer_flops(4096, width, [(2048, 0), (2048, 0)]) < 2 * CALL_FLOPS


def test_the_backend_leaves_a_small_step_to_the_extend_kernel(monkeypatch):
    """A step whose layer work is under ``CALL_FLOPS`` per call plans no fused calls."""
    from radixd.core.attention.triton_backend import TritonAttention
    from radixd.core.forward_batch import ForwardBatch
    from radixd.core.kv_pool import KVPool

    pool = KVPool(num_layers=1, num_slots=1024, num_kv_heads=2, head_dim=32, max_rows=2, max_context_len=512,
                  dtype=torch.float32, device=torch.device("cpu"))
    fb = ForwardBatch(input_ids=torch.zeros(300, dtype=torch.int64), positions=torch.arange(300),
                      out_cache_loc=torch.arange(1, 301), rows=[0], prefix_lens=[0], extend_lens=[300])
    attn = TritonAttention(pool, num_heads=4, head_dim=32, scale=0.1, dense_prefill=True)
    attn.begin(fb)
    assert attn.dense is None and attn.extends is not None
    monkeypatch.setattr(dense_prefill, "CALL_FLOPS", 0.0)
    attn.begin(fb)
    assert attn.dense is not None and attn.dense.fresh == [(0, 1, 300)] and attn.extends is None


def test_a_step_makes_at_most_max_calls():
    lens = [300 + i for i in range(40)]  # (all different: a call each)
    fresh, _, _, rest, _ = plan(lens, [0] * 40, list(range(40)), starts_of(lens), lambda k: True)
    assert len(fresh) == dense_prefill.MAX_CALLS and rest == list(range(dense_prefill.MAX_CALLS, 40))


@pytest.mark.parametrize("limits", [(2048, 4096, 131072), (8192, 16384, 131072), (2048, 2048, 5000),
                                    (300, 1000, 700)])
def test_the_wanted_keys_cover_every_step_the_scheduler_can_make(limits):
    """Random steps within the limits (each extend at most the chunk, the step at most the
    budget, prefix + chunk within the context): every extend of at least MIN_TOKENS new
    tokens finds its keys among ``wanted``'s (a warmed engine never falls back for want of
    a plan), and fewer than 160 keys are built (a few seconds at start)."""
    max_extend, max_tokens, max_context = limits
    keys = wanted(dense_prefill.MIN_TOKENS, max_extend, max_tokens, max_context)
    assert len(keys) < 160
    have = set(keys)
    rng = random.Random(3)
    for _ in range(2000):
        lens, prefixes, total = [], [], 0
        while True:
            n = rng.choice([rng.randint(1, max_extend), max_extend, rng.randint(200, 600)])
            n = min(n, max_extend, max_tokens - total)
            if n <= 0:
                break
            p = rng.choice([0, 0, rng.randint(0, max_context - n), rng.randint(0, 300)])
            p = min(p, max_context - n)
            if p < 0:
                break
            same = lens and prefixes[-1] == 0 and p == 0 and rng.random() < 0.5
            lens.append(lens[-1] if same and lens[-1] + total <= max_tokens else n)
            prefixes.append(p)
            total = sum(lens)
            if total > max_tokens:
                lens.pop()
                prefixes.pop()
                break
            if rng.random() < 0.3:
                break
        if not lens:
            continue
        _, _, _, rest, _ = plan(lens, prefixes, list(range(len(lens))), starts_of(lens), have.__contains__)
        assert all(lens[i] < dense_prefill.MIN_TOKENS for i in rest), (lens, prefixes, rest)


def test_plans_count_only_on_the_thread_that_built_them():
    """On CUDA torch keeps cuDNN's plans per thread: a key built on one thread does not count
    on another (the step goes to the extend kernel there rather than building a plan)."""
    plans = DensePlans(heads=4, kv_heads=2, head_dim=32, dtype=torch.bfloat16, device=torch.device("cpu"),
                       max_extend=2048, max_tokens=4096, max_context=8192)
    key = plans.keys[0]
    assert plans.ready(key)  # (the CPU: nothing planned, every wanted key ready)
    assert not plans.ready(Key(True, False, 1, 1 << 20, 1 << 20))  # (not wanted: longer than a chunk)
    plans.cuda, plans.built, plans.thread = True, frozenset(plans.keys), threading.get_ident()
    seen = []
    t = threading.Thread(target=lambda: seen.append(plans.ready(key)))
    t.start()
    t.join()
    assert plans.ready(key) and seen == [False]


# ---------------------------------------------------------------------------- GPU


def reference(q, k, v, prefix, scale):
    """float64 attention of new tokens q [n, H, D] at positions prefix.. over k/v [p + n, Hkv, D]."""
    n = q.shape[0]
    mask = torch.arange(prefix + n, device=q.device)[None, :] <= torch.arange(prefix, prefix + n, device=q.device)[:, None]
    return F.scaled_dot_product_attention(q.double().transpose(0, 1)[None], k.double().transpose(0, 1)[None],
                                          v.double().transpose(0, 1)[None], attn_mask=mask, scale=scale,
                                          enable_gqa=True)[0].transpose(0, 1)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA device")
def test_gpu_plans_built_once_serve_new_lengths_without_planning(monkeypatch):
    """At the 8B shape: ``warm_up`` builds every key and finds bucketing in effect; then steps of
    lengths never seen (fresh runs, a chunk after a short prefix, after a long one) plan
    nothing (each step well under the ~70 ms of a plan) and match a float64 reference."""
    from radixd.core.attention.triton_backend import TritonAttention
    from radixd.core.forward_batch import ForwardBatch
    from radixd.core.kv_pool import KVPool
    from radixd.core.models.layers import Rotary

    H, HKV, D = 32, 8, 128
    slots = 40000
    monkeypatch.setattr(dense_prefill, "CALL_FLOPS", 0.0)  # (every step fused, small ones too)
    pool = KVPool(num_layers=1, num_slots=slots, num_kv_heads=HKV, head_dim=D, max_rows=8, max_context_len=16384,
                  dtype=torch.bfloat16, device=torch.device("cuda"))
    attn = TritonAttention(pool, num_heads=H, head_dim=D, scale=D**-0.5, dense_prefill=True,
                           prefill_limits=(2048, 4096))
    attn.warm_up()
    assert attn.plans.built and attn.plans.thread == threading.get_ident()
    g = torch.Generator(device="cuda").manual_seed(4)
    pool.k_buffers[0].copy_(torch.randn(pool.k_buffers[0].shape, device="cuda", generator=g))
    pool.v_buffers[0].copy_(torch.randn(pool.v_buffers[0].shape, device="cuda", generator=g))
    rotary = Rotary(D, 20000, 500000.0, None).to("cuda")
    # the first of each kind untimed (kernels load), then new lengths: bucketed, then exact shapes
    warm = [([0], [256]), ([50], [300]), ([3000], [700]), ([0], [512]), ([2048], [2048])]
    steps = [([0, 0, 0], [777, 777, 1501]), ([100], [1999]), ([9000], [1333]), ([0, 5000, 0], [300, 600, 2000]),
             ([0, 0], [1024, 1024]), ([4096], [2048])]
    order = torch.randperm(slots - 1, generator=g, device="cuda") + 1
    for prefixes, lens in warm + steps:
        off, locs, pos = 0, [], []
        for i, (p, n) in enumerate(zip(prefixes, lens, strict=True)):
            pool.req_to_token[i, :p + n] = order[off:off + p + n]
            locs.append(order[off + p:off + p + n])
            pos.append(torch.arange(p, p + n))
            off += p + n
        t = sum(lens)
        fb = ForwardBatch(input_ids=torch.zeros(t, dtype=torch.int64), positions=torch.cat(pos),
                          out_cache_loc=torch.cat(locs).cpu(), rows=list(range(len(lens))), prefix_lens=prefixes,
                          extend_lens=lens)
        qkv = torch.randn(t, (H + 2 * HKV) * D, device="cuda", generator=g, dtype=torch.bfloat16)
        q, k, v = (x.view(t, -1, D) for x in qkv.split([H * D, HKV * D, HKV * D], dim=-1))
        q0 = q.clone()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        attn.begin(fb)
        out = attn.forward(q, k, v, 0, fb.positions.cuda(), rotary)
        torch.cuda.synchronize()
        took = time.perf_counter() - t0
        assert attn.dense is not None and not attn.dense.rest
        assert attn.dense.exact == all(n & (n - 1) == 0 for n in lens), (prefixes, lens)
        assert took < 0.03 or (prefixes, lens) in warm, (prefixes, lens, took)  # (a plan takes about 0.07 s)
        q = q0
        qr, _ = rotary(fb.positions.cuda(), q.clone(), k.clone())
        at = 0
        for i, (p, n) in enumerate(zip(prefixes, lens, strict=True)):
            keys = pool.req_to_token[i, :p + n]
            ref = reference(qr[at:at + n], pool.k_buffers[0][keys], pool.v_buffers[0][keys], p, D**-0.5)
            err = float((out[at:at + n].double() - ref).norm() / ref.norm())
            assert err < 2e-2, (prefixes, lens, i, err)
            at += n
