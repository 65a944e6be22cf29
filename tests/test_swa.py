"""Sliding-window KV through the engine (``swa_pool``, ``swa_cache``): a request's window KV
behind its window goes back to the window region as it decodes, the radix cache serves a
prefix only as far as its window KV is there, and the tokens still equal transformers' (fp32,
CPU) for an all-windowed Mistral and an interleaved Gemma-3-style model, with chunked
prefill, cache hits and preemption; both regions' accounting holds after every step; the
Triton kernels read window layers through the slot map (interpreter, tiny shapes)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, rule
from test_engine import assert_greedy_matches, assert_idle, collect, make_engine, prompts
from test_radix_cache import POOL_SLOTS, Handle, RadixCacheMachine, keys
from test_triton_kernels import DEV, TOL, make_pool, rel_err
from test_window_attention import ref_attention

from radixd import SamplingParams
from radixd.core.attention.triton_kernels import decode_attention, extend_attention
from radixd.core.swa_cache import WindowRadixCache
from radixd.core.swa_pool import HybridSlotAllocator

ARCHS = ["mistral-swa", "gemma3"]  # windows of 8 on every layer; on two of three layers


def window_free(eng) -> int:
    return eng.allocator.window_available


async def assert_window_idle(eng):
    await assert_idle(eng)
    acc = eng.scheduler.accounting()
    assert acc["window_private"] == 0 and acc["window_locked"] == 0
    assert acc["window_free"] + acc["window_evictable"] == acc["window_total"]


async def final(eng, prompt, max_new: int) -> tuple[list[int], int]:
    """(tokens, cached prompt tokens) of one greedy request."""
    toks, cached = [], 0
    params = SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True)
    async for out in eng.generate(input_ids=prompt, params=params):
        toks += out.token_ids
        cached = out.cached_tokens
    return toks, cached


@pytest.mark.parametrize("arch", ARCHS)
async def test_window_kv_freed_as_it_decodes(tiny_dense_models, arch):
    """One request decodes 40 tokens past a 20-token prompt (window 8): the window region's
    free count grows while it runs, its private window KV stays within a window and a batch
    of freeing, and its tokens are transformers'."""
    path = tiny_dense_models[arch]
    eng = make_engine(path, kv_cache_tokens=512, chunked_prefill_size=8)
    seen: list[tuple[int, int, int]] = []  # (window slots free, held privately, pinned) per step

    def hook(step):
        eng.check_accounting()
        acc = eng.scheduler.accounting()
        seen.append((acc["window_free"], acc["window_private"], acc["window_locked"]))

    eng.step_hook = hook
    try:
        p = prompts(1, 20, seed=31)[0]
        got = await collect(eng, p, 40)
        assert_greedy_matches(path, p, got, 40)
        frees = [f for f, _, _ in seen]
        assert any(b > a for a, b in zip(frees, frees[1:], strict=False)), frees  # freed while decoding
        assert max(priv for _, priv, _ in seen) <= 7 + 8 + 1  # window - 1, a batch of freeing, the new token
        # the prompt's last 7 tokens are pinned while the window reaches them, then not (while
        # the request still runs)
        assert max(pinned for _, _, pinned in seen) == 7
        assert any(pinned == 0 and priv > 0 for _, priv, pinned in seen)
        await assert_window_idle(eng)
    finally:
        await eng.stop()


@pytest.mark.parametrize("arch", ARCHS)
async def test_hit_on_a_prefix_whose_window_kv_was_freed(tiny_dense_models, arch):
    """The cache keeps a prefix's slots after its window KV is evicted; a later request is
    served only up to where the window KV before the match end is there, recomputes the rest
    (reviving the tombstones), and a third one then gets the whole prefix."""
    path = tiny_dense_models[arch]
    eng = make_engine(path, kv_cache_tokens=512, chunked_prefill_size=8)
    try:
        base = prompts(1, 40, seed=32)[0]
        a = base[:24] + prompts(1, 16, seed=33)[0]       # shares 24 tokens with base
        await final(eng, base, 4)
        await final(eng, a, 4)                              # now the least recently used leaf is base's
        cache = eng.cache
        tail = 40 + 4 - 1 - 24                              # base's own tokens in the tree
        assert cache.evict_window(tail) >= tail - 7         # its leaf (the pinned window is gone with the lock)
        eng.check_accounting()
        c = base + prompts(1, 5, seed=34)[0]
        got, cached = await final(eng, c, 6)
        assert cached == 24                                 # base's window KV from 24 on is gone
        assert_greedy_matches(path, c, got, 6)
        d = base + prompts(1, 5, seed=35)[0]
        got, cached = await final(eng, d, 6)
        assert cached == 40                                 # revived by c's recomputation
        assert_greedy_matches(path, d, got, 6)
        await assert_window_idle(eng)
    finally:
        await eng.stop()


@pytest.mark.parametrize("arch", ARCHS)
async def test_small_window_region_preempts_and_stays_exact(tiny_dense_models, arch):
    """A window region of 48 tokens for four 30-token prompts decoding 30 each, in chunks of
    8: the window region is what runs out (preemption, eviction of the tree's window KV),
    and the tokens are still transformers'."""
    path = tiny_dense_models[arch]
    eng = make_engine(path, kv_cache_tokens=400, swa_full_tokens_ratio=0.12, chunked_prefill_size=8,
                      schedule_conservativeness=0.0)
    try:
        assert eng.allocator.window_total == 48
        ps = prompts(4, 30, seed=36)
        outs = await asyncio.gather(*(collect(eng, p, 30) for p in ps))
        assert eng.scheduler.stats.preemptions > 0
        for p, got in zip(ps, outs, strict=True):
            assert_greedy_matches(path, p, got, 30)
        await assert_window_idle(eng)
    finally:
        await eng.stop()


async def test_aborts_leak_no_window_kv(tiny_dense_models):
    """Requests aborted mid-decode (cache off) give back every slot of both regions."""
    eng = make_engine(tiny_dense_models["gemma3"], kv_cache_tokens=256, radix_cache=False)
    try:
        ps = prompts(3, 20, seed=37)
        gens = [eng.generate(input_ids=p, params=SamplingParams(max_new_tokens=200, temperature=0, ignore_eos=True))
                for p in ps]

        async def take(agen, n):
            seen = 0
            async for out in agen:
                seen += len(out.token_ids)
                if seen >= n:
                    break
            await agen.aclose()

        await asyncio.gather(*(take(g, 12 + 5 * i) for i, g in enumerate(gens)))
        for _ in range(200):
            if not eng.scheduler.running:
                break
            await asyncio.sleep(0.01)
        acc = eng.scheduler.accounting()
        assert acc["free"] == acc["total"] and acc["window_free"] == acc["window_total"]
        await assert_window_idle(eng)
    finally:
        await eng.stop()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
async def test_triton_backend_serves_window_kv_through_the_map(tiny_dense_models, device):
    """The triton backend (the interpreter on CPU; on a GPU, CUDA graphs too) with the window
    region, decoding past the window and hitting the cache where window KV was freed:
    transformers' tokens."""
    path = tiny_dense_models["gemma3"]
    eng = make_engine(path, kv_cache_tokens=256, attention_backend="triton", dtype="float32",
                      chunked_prefill_size=8, device=device)
    try:
        p = prompts(1, 10, seed=38)[0]
        got = await collect(eng, p, 16)
        assert_greedy_matches(path, p, got, 16)
        # the prompt's window KV is cached; position 10 on was decoded and freed behind the window
        q = p + got[:2]
        got, cached = await final(eng, q, 3)
        assert cached == 10
        assert_greedy_matches(path, q, got, 3)
        await assert_window_idle(eng)
    finally:
        await eng.stop()


# (query heads, KV heads, head dim, lengths): tiny through the interpreter, real on a GPU
SHAPES = [pytest.param((4, 2, 32, [1, 7, 64, 130]), id="small"),
          pytest.param((32, 8, 128, [1, 17, 512, 2048, 4097]), id="real", marks=pytest.mark.gpu)]


def mapped_pool(seq_lens, dead, seed, kv_heads=2, dim=32):
    """``make_pool``'s with its K/V moved to a window region read through a slot map; the
    slots of each request's first ``dead[i]`` positions (keys behind its window) map to the
    sink, as freed ones do."""
    dtype = torch.bfloat16 if DEV == "cuda" else torch.float32
    kb, vb, table, rows = make_pool(sum(seq_lens) + 11, kv_heads, dim, dtype, seq_lens, seed=seed)
    n = kb.shape[0]
    g = torch.Generator().manual_seed(seed)
    to_window = torch.zeros(n, dtype=torch.int64, device=DEV)
    to_window[1:] = (torch.randperm(n - 1, generator=g) + 1).to(DEV)
    kw, vw = torch.zeros_like(kb), torch.zeros_like(vb)
    kw[to_window], vw[to_window] = kb, vb
    for r, d in zip(rows.tolist(), dead, strict=True):
        to_window[table[r, :d]] = 0
    return kb, vb, kw, vw, table, rows, to_window


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("splits", [1, 4])
def test_decode_kernel_reads_window_layers_through_the_map(splits, shape):
    heads, kv_heads, dim, seq_lens = shape
    window = 5 if seq_lens[-1] < 1000 else 1024
    dead = [max(0, n - window) for n in seq_lens]  # a query at n - 1 reads keys from n - window
    kb, vb, kw, vw, table, rows, to_window = mapped_pool(seq_lens, dead, splits, kv_heads, dim)
    q = torch.randn(len(seq_lens), heads, dim, device=DEV).to(kb.dtype)
    out = decode_attention(q, kw, vw, table, rows, torch.tensor(seq_lens, device=DEV), dim**-0.5, num_splits=splits,
                           window=window, slot_map=to_window)
    for b, n in enumerate(seq_lens):
        ref = ref_attention(q[b][None], kb, vb, table[rows[b], :n], torch.tensor([n - 1], device=DEV), dim**-0.5,
                            window, 0.0)
        assert rel_err(out[b], ref[0]) < TOL


@pytest.mark.parametrize("shape", SHAPES)
def test_extend_kernel_reads_window_layers_through_the_map(shape):
    heads, kv_heads, dim, seq_lens = shape
    window = 16 if seq_lens[-1] < 1000 else 1024
    ext = [min(n, (3, 20, 33, 300, 1000)[i]) for i, n in enumerate(seq_lens)]
    prefix = [n - e for n, e in zip(seq_lens, ext, strict=True)]
    dead = [max(0, p - window + 1) for p in prefix]  # the chunk's first query reads from p - window + 1
    kb, vb, kw, vw, table, rows, to_window = mapped_pool(seq_lens, dead, 3, kv_heads, dim)
    starts = [sum(ext[:i]) for i in range(len(ext))]
    q = torch.randn(sum(ext), heads, dim, device=DEV).to(kb.dtype)
    t = lambda xs: torch.tensor(xs, device=DEV)  # noqa: E731
    out = extend_attention(q, kw, vw, table, rows, t(prefix), t(ext), t(starts), max(ext), dim**-0.5,
                           window=window, slot_map=to_window)
    for i, (p, e) in enumerate(zip(prefix, ext, strict=True)):
        ref = ref_attention(q[starts[i] : starts[i] + e], kb, vb, table[rows[i], : p + e],
                            torch.arange(p, p + e, device=DEV), dim**-0.5, window, 0.0)
        assert rel_err(out[starts[i] : starts[i] + e], ref) < TOL


def test_swa_benchmark_runs_quick(tmp_path):
    """``python -m benchmarks.swa --quick``: the script's logic on a tiny Gemma-3 shape on the
    CPU; the window region holds less KV than the whole pool and frees some as it decodes."""
    import json

    from benchmarks import swa

    assert swa.main(["--quick", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "swa.json").read_text())
    hybrid, whole = doc["cases"]
    assert hybrid["windows_freed"] and not whole["windows_freed"]
    assert hybrid["window_slots_freed"] > 0 and whole["window_slots_freed"] == 0
    assert hybrid["held_by_running_max_bytes"] < whole["held_by_running_max_bytes"]
    assert hybrid["held_by_running_max_vs_whole"] < 1 and hybrid["decode_tok_s"] > 0


# ---------------------------------------------------------------------------- the window cache's contract

WINDOW = 4  # a window layer reads the 3 keys before a query's position and its own


class WindowRadixCacheMachine(RadixCacheMachine):
    """``test_radix_cache``'s state machine over the window radix cache, with a window region
    smaller than the pool, window KV evicted on its own, and admission's served prefix; after
    every step the window region's accounting holds and every lock's window KV is there."""

    def __init__(self) -> None:
        super().__init__()
        self.allocator = HybridSlotAllocator(POOL_SLOTS, 13, WINDOW)

    @initialize(enabled=st.booleans())
    def setup(self, enabled: bool) -> None:
        super().setup(enabled)
        self.cache = WindowRadixCache(self.allocator, enabled=enabled)
        if enabled:
            self.namespaces = [0, self.cache.new_namespace()]
        else:
            self.namespaces = [self.cache.default_namespace(), self.cache.default_namespace()]

    def _take(self, n: int) -> torch.Tensor | None:
        """As the KV manager's room: the window region's unpinned KV first, then leaves."""
        if not self.cache.make_window_room(n):
            return None
        return super()._take(n)

    def _served(self, ns: int, key: tuple[int, ...], longest: int):
        """``match_served``, its matches marked in the reference (the whole match, then the
        served part again when it is shorter)."""
        res = self.cache.match_served(list(key), ns)
        self.ref.touch(ns, key, longest, self.ref.tick())
        if res.slots.numel() < longest:
            self.ref.touch(ns, key, res.slots.numel(), self.ref.tick())
        return res

    @rule(n=st.integers(0, 14))
    def evict_window(self, n: int) -> None:
        before = self.allocator.window_available
        freed = self.cache.evict_window(n)
        assert self.allocator.window_available == before + freed
        if freed < n:  # all the tree's unpinned window KV is gone
            tree = self.cache.all_slots()
            assert not (self.allocator.has_window(tree) & (self.cache._pins[tree] == 0)).any()

    @rule(ns_i=st.integers(0, 1), key=keys)
    def match_served(self, ns_i: int, key: tuple[int, ...]) -> None:
        ns = self.namespaces[ns_i]
        longest = self.ref.longest(ns, key)
        res = self._served(ns, key, longest)
        n = res.slots.numel()
        assert n <= longest and res.slots.tolist() == self.ref.slots_of(ns, key, n)
        alive = self.allocator.has_window(torch.tensor(self.ref.slots_of(ns, key, longest), dtype=torch.int64))

        def servable(m: int) -> bool:
            return bool(alive[max(0, m - WINDOW + 1) : m].all())

        assert servable(n) and not any(servable(m) for m in range(n + 1, longest + 1))

    @rule(ns_i=st.integers(0, 1), key=keys)
    def match_and_lock(self, ns_i: int, key: tuple[int, ...]) -> None:
        """What admission locks: the served prefix (never a tail whose window KV is gone)."""
        ns = self.namespaces[ns_i]
        longest = self.ref.longest(ns, key)
        res = self._served(ns, key, longest)
        self.cache.lock(res.node)
        self.ref.handles.append(Handle(res.node, ns, key[: res.slots.numel()]))

    @invariant()
    def window_region(self) -> None:
        if not hasattr(self, "cache"):
            return
        self.cache.check_window([])
        for h in self.ref.handles:  # a lock's window: the keys before its end
            tail = self.ref.slots_of(h.ns, h.key, len(h.key))[-(WINDOW - 1) :] if h.key else []
            assert self.allocator.has_window(torch.tensor(tail, dtype=torch.int64)).all()


WindowRadixCacheMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=40, deadline=None,
                                                     suppress_health_check=[HealthCheck.too_slow])
TestWindowRadixCacheMachine = WindowRadixCacheMachine.TestCase


@pytest.mark.parametrize("arch", ARCHS)
async def test_speculative_decoding_keeps_window_kv_exact(tiny_dense_models, arch):
    """n-gram drafts verified on a window model: rejected drafts' slots go back through the
    hybrid allocator, the tokens equal plain decoding's, both regions' accounting holds after
    every step and nothing is held after."""
    path = tiny_dense_models[arch]
    prompt = [5, 6, 7, 8, 9, 10] * 3 + [5, 6]
    plain = make_engine(path, kv_cache_tokens=512, chunked_prefill_size=8)
    try:
        want, _ = await final(plain, prompt, 40)
    finally:
        await plain.stop()
    eng = make_engine(path, kv_cache_tokens=512, chunked_prefill_size=8, speculative_algorithm="ngram")
    eng.step_hook = lambda step: eng.check_accounting()
    try:
        got, _ = await final(eng, prompt, 40)
        assert eng.stats()["spec_verifies"] > 0
        await assert_window_idle(eng)
    finally:
        await eng.stop()
    assert got == want
