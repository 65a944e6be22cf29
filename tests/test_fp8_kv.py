"""The fp8 KV cache (``kv_cache_dtype``): logits close to a full-precision pool under chunked
prefill, cache hits and preemption; scales read from the checkpoint and applied; the Triton
stores quantizing as the torch path does; the pool's size in the same memory; fp8 pages in
the cache tiers, never served to a pool of another dtype; bad values refused by name.

Tolerance (tiny random models, fp32 weights, CPU): token log-probabilities with an fp8_e4m3
pool within 0.4 nats of an fp32 pool's, 0.1 on average (measured: prompt tokens 0.13 at most,
0.05 on average; decoded tokens under preemption 0.30 and 0.05); fp8_e5m2 (one mantissa bit
fewer) within 0.6, 0.2 on average (measured 0.29/0.09 and 0.35/0.12)."""

from __future__ import annotations

import asyncio
import random
import shutil

import pytest
import torch
import torch.nn.functional as F
from test_engine import prompts
from test_triton_kernels import DEV, GPU, check_cascade, check_decode, check_extend, rel_err

from radixd import Engine, SamplingParams
from radixd.core.errors import ConfigError
from radixd.core.kv_quant import FP8_DTYPES, MANTISSA_BITS, dequantize, is_scale_name, quantize
from radixd.core.kv_quant import read_scales as read_tensors
from radixd.core.model_loader import iter_safetensors
from radixd.core.tiers import Page


def read_scales(path, num_layers: int):
    """The KV scales of the checkpoint at ``path``, as the engine reads them."""
    return read_tensors(iter_safetensors(path, only=is_scale_name), num_layers)


LOGPROB_TOL = {"fp8_e4m3": (0.4, 0.1), "fp8_e5m2": (0.6, 0.2)}  # (most, mean) nats from fp32's


def make_engine(path, **kw) -> Engine:
    kw.setdefault("kv_cache_tokens", 4096)
    eng = Engine(model=str(path), **kw)
    eng.step_hook = lambda step: eng.check_accounting()
    return eng


async def prompt_logprobs(eng: Engine, ids: list[int]) -> list[float]:
    """The logprob of each prompt token from the second on (every position computed)."""
    got = None
    params = SamplingParams(max_new_tokens=1, temperature=0.0, prompt_logprobs_from=1)
    async for out in eng.generate(input_ids=ids, params=params):
        got = out.prompt_logprobs if out.prompt_logprobs is not None else got
    return got


async def steps(eng: Engine, prompt: list[int], n: int, cached: list | None = None) -> list[tuple[int, float, float]]:
    """Greedy decoding: (token, its logprob, its margin over the runner-up) per step; the
    prompt's tokens served from cache appended to ``cached``."""
    out_steps = []
    params = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=2)
    async for out in eng.generate(input_ids=prompt, params=params):
        for lp in out.logprobs or []:
            top = sorted((t[1] for t in lp.top), reverse=True)
            out_steps.append((lp.token_id, lp.logprob, top[0] - top[1]))
        if cached is not None and out.finished:
            cached.append(out.cached_tokens)
    return out_steps


def step_diffs(want: list[tuple[int, float, float]], got: list[tuple[int, float, float]], most: float) -> list[float]:
    """The chosen tokens' logprob differences while the tokens agree; they may part only
    where the full-precision run's top two are within ``2 * most``."""
    assert len(want) == len(got)
    diffs = []
    for (tok_w, lp_w, margin), (tok_g, lp_g, _) in zip(want, got, strict=True):
        if tok_w != tok_g:
            assert margin < 2 * most
            break
        diffs.append(abs(lp_w - lp_g))
    return diffs


def assert_close(diffs: list[float], kv: str) -> None:
    most, mean = LOGPROB_TOL[kv]
    assert diffs and max(diffs) < most and sum(diffs) / len(diffs) < mean
    assert max(diffs) > 0  # (the pool really is fp8)


@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2"])
async def test_logprobs_close_to_full_precision_with_chunks_and_cache_hits(tiny_models, kv):
    """A prompt prefilled in chunks of 8 (each chunk attends to the earlier ones in the
    pool), then one sharing its first 48 tokens (a cache hit: those are read from the pool)."""
    path = tiny_models["qwen3"]
    rng = random.Random(7)
    a = [rng.randrange(2, 256) for _ in range(60)]
    b = a[:48] + [rng.randrange(2, 256) for _ in range(20)]
    results = {}
    for dtype in ("auto", kv):
        eng = make_engine(path, kv_cache_dtype=dtype, chunked_prefill_size=8)
        try:
            assert eng.worker.pool.k_buffers[0].dtype == (FP8_DTYPES[kv] if dtype == kv else torch.float32)
            cached: list[int] = []
            results[dtype] = (await prompt_logprobs(eng, a), await steps(eng, b, 8, cached), cached[0])
        finally:
            await eng.stop()
    (want_lp, want_steps, want_cached), (got_lp, got_steps, got_cached) = results["auto"], results[kv]
    assert got_cached == want_cached >= 32
    prompt_diffs = (torch.tensor(got_lp) - torch.tensor(want_lp)).abs().tolist()
    assert_close(prompt_diffs + step_diffs(want_steps, got_steps, LOGPROB_TOL[kv][0]), kv)


async def test_decode_under_preemption_close_to_full_precision(tiny_models):
    """A pool too small for the batch: requests are preempted and recomputed, in fp8 as in
    fp32, with logprobs as close (``step_diffs``)."""
    path = tiny_models["qwen2"]
    ps = prompts(4, 30, seed=5)
    runs = {}
    for dtype in ("auto", "fp8_e4m3"):
        eng = make_engine(path, kv_cache_dtype=dtype, kv_cache_tokens=150, schedule_conservativeness=0.0)
        try:
            runs[dtype] = await asyncio.gather(*(steps(eng, p, 24) for p in ps))
            assert eng.scheduler.stats.preemptions > 0
        finally:
            await eng.stop()
    diffs = []
    for want, got in zip(runs["auto"], runs["fp8_e4m3"], strict=True):
        diffs += step_diffs(want, got, LOGPROB_TOL["fp8_e4m3"][0])
    assert_close(diffs, "fp8_e4m3")


def test_pool_holds_twice_the_tokens_of_bf16_in_the_same_memory(tiny_models):
    from radixd.core.assembly import ModelSetup, kv_slots
    from radixd.core.config import EngineConfig

    got = {}
    for kv in ("auto", "fp8_e4m3"):
        config = EngineConfig(model=str(tiny_models["llama"]), dtype="bfloat16", kv_cache_bytes=1 << 20,
                              kv_cache_dtype=kv)
        got[kv] = kv_slots(config, ModelSetup.load(config), None) - 1
    assert got["fp8_e4m3"] == 2 * got["auto"]


# ------------------------------------------------------------------ scales from the checkpoint


def with_scales(src, dst, tensors: dict[str, torch.Tensor]):
    """A copy of checkpoint ``src`` with ``tensors`` added (a safetensors file of their own)."""
    from safetensors.torch import save_file

    shutil.copytree(src, dst)
    save_file(tensors, str(dst / "kv_scales.safetensors"))
    return dst


def test_checkpoint_scales_are_applied(tiny_models, tmp_path):
    """k_scale/v_scale tensors per attention layer divide what the pool stores (layer 0,
    whose K/V do not depend on the KV of any layer before: exactly the torch quantization of
    the full-precision values; every layer: close to them); "auto" ignores them (they load)."""
    from radixd.core.forward_batch import ForwardBatch

    src = tiny_models["llama"]
    scales = {0: (0.25, 0.125), 1: (0.5, 4.0)}
    tensors = {f"model.layers.{i}.self_attn.{w}_scale": torch.tensor(s[j])
               for i, s in scales.items() for j, w in enumerate("kv")}
    path = with_scales(src, tmp_path / "scaled", tensors)
    ids = prompts(1, 20, seed=3)[0]
    pools = {}
    for name, ckpt, kv in (("scaled", path, "fp8_e4m3"), ("ones", src, "fp8_e4m3"), ("auto", path, "auto")):
        eng = make_engine(ckpt, kv_cache_dtype=kv)
        try:
            slots = eng.allocator.alloc(len(ids))
            batch = ForwardBatch(input_ids=torch.tensor(ids), positions=torch.arange(len(ids)), out_cache_loc=slots,
                                 rows=[0], prefix_lens=[0], extend_lens=[len(ids)], table_writes=[(0, 0, slots)],
                                 sample_indices=[0])
            eng.worker.forward(batch)
            pool = eng.worker.pool
            pools[name] = (pool, [(pool.k_buffers[i][slots].clone(), pool.v_buffers[i][slots].clone()) for i in scales])
            eng.allocator.free(slots)
        finally:
            asyncio.run(eng.stop())
    scaled, ones, auto = pools["scaled"], pools["ones"], pools["auto"]
    assert scaled[0].k_scales == (0.25, 0.5) and scaled[0].v_scales == (0.125, 4.0)
    assert ones[0].k_scales == (1.0, 1.0) and auto[0].dtype == torch.float32
    for i, (ks, vs) in scales.items():
        for j, s in enumerate((ks, vs)):
            raw, one, full = scaled[1][i][j], ones[1][i][j], auto[1][i][j]
            assert raw.dtype == torch.float8_e4m3fn and not torch.equal(raw.view(torch.uint8), one.view(torch.uint8))
            if i == 0:
                assert torch.equal(raw.view(torch.uint8), quantize(full, s, raw.dtype).view(torch.uint8))
            assert rel_err(dequantize(raw, s, torch.float32), full.double()) < 0.1


async def test_tensor_parallel_shards_store_their_heads_in_fp8(tiny_models, tmp_path):
    """tp_size 2: each shard's pool holds its KV heads in fp8 with the checkpoint's scales;
    the logprobs are tp_size 1's (up to a value the sums' order moves across a rounding
    boundary, as in the Triton test below)."""
    tensors = {f"model.layers.{i}.self_attn.{w}_scale": torch.tensor(0.5 + i) for i in range(2) for w in "kv"}
    path = with_scales(tiny_models["llama"], tmp_path / "scaled", tensors)
    ids = prompts(1, 21, seed=8)[0]
    got = []
    for tp in (1, 2):
        eng = make_engine(path, kv_cache_dtype="fp8_e4m3", tp_size=tp)
        try:
            pools = [s.pool for s in eng.worker.shards] if tp > 1 else [eng.worker.pool]
            for pool in pools:
                assert pool.k_buffers[0].dtype == torch.float8_e4m3fn and pool.k_buffers[0].shape[1] == 2 // tp
                assert pool.k_scales == pool.v_scales == (0.5, 1.5)
            got.append(await prompt_logprobs(eng, ids))
        finally:
            await eng.stop()
    torch.testing.assert_close(torch.tensor(got[1]), torch.tensor(got[0]), atol=1e-2, rtol=0)


@pytest.mark.parametrize("names", [
    ("layers.{i}.self_attn.k_scale", "layers.{i}.self_attn.v_scale"),            # compressed-tensors, vLLM
    ("model.layers.{i}.self_attn.k_proj.k_scale", "model.layers.{i}.self_attn.v_proj.v_scale"),  # ModelOpt
    ("model.layers.{i}.self_attn.k_proj.output_scale", "model.layers.{i}.self_attn.v_proj.output_scale"),
])
def test_scale_names_of_each_format(tmp_path, names):
    from safetensors.torch import save_file

    save_file({n.format(i=i): torch.tensor([0.5 + i + j]) for i in range(2) for j, n in enumerate(names)},
              str(tmp_path / "model.safetensors"))
    assert read_scales(tmp_path, 2) == ((0.5, 1.5), (1.5, 2.5))


def test_single_kv_scale_sets_both(tmp_path):
    from safetensors.torch import save_file

    save_file({f"model.layers.{i}.self_attn.kv_scale": torch.tensor(2.0 + i) for i in range(2)},
              str(tmp_path / "model.safetensors"))
    assert read_scales(tmp_path, 2) == ((2.0, 3.0), (2.0, 3.0))


@pytest.mark.parametrize("tensors,match", [
    ({"model.layers.0.self_attn.k_scale": torch.ones(2), "model.layers.0.self_attn.v_scale": torch.tensor(1.0)},
     r"'layers.0.self_attn.k_scale'.*one per-tensor KV scale expected, got shape \(2,\)"),
    ({"model.layers.0.self_attn.k_scale": torch.tensor(-1.0), "model.layers.0.self_attn.v_scale": torch.tensor(1.0)},
     r"'model.layers.0.self_attn.k_scale'.*positive finite"),
    ({"model.layers.0.self_attn.k_scale": torch.tensor(1.0), "model.layers.0.self_attn.v_scale": torch.tensor(1.0)},
     r"no k_scale for layer\(s\) \[1\]"),
    ({"model.layers.7.self_attn.k_scale": torch.tensor(1.0)}, r"'model.layers.7.self_attn.k_scale': layer 7 of a model with 2"),
])
def test_bad_checkpoint_scales_are_refused_naming_the_tensor(tmp_path, tensors, match):
    from safetensors.torch import save_file

    save_file({k.removeprefix("model.") if "shape" in match else k: v for k, v in tensors.items()},
              str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=match):
        read_scales(tmp_path, 2)


# ------------------------------------------------------------------ configuration


def test_bad_kv_cache_dtype_is_refused_naming_the_key(tiny_models):
    from radixd.cli import build_parser
    from radixd.core.config import EngineConfig
    from radixd.launch_flags import overrides
    from radixd.settings import settings_from_dict

    with pytest.raises(ConfigError, match="'kv_cache_dtype'.*'fp8'.*'auto', 'bfloat16', 'float16', 'fp8_e4m3', 'fp8_e5m2'"):
        EngineConfig(kv_cache_dtype="fp8")
    with pytest.raises(ConfigError, match="'memory.kv_cache_dtype'.*'int8'"):
        settings_from_dict({"memory": {"kv_cache_dtype": "int8"}})
    with pytest.raises(ConfigError, match="--kv-cache-dtype.*'fp4_e2m1'"):
        overrides(build_parser().parse_args(["--kv-cache-dtype", "fp4_e2m1"]))
    assert overrides(build_parser().parse_args(["--kv-cache-dtype", "fp8_e4m3"])) == {
        "memory.kv_cache_dtype": "fp8_e4m3"}
    assert settings_from_dict({"memory": {"kv_cache_dtype": "fp8_e5m2"}}).memory.kv_cache_dtype == "fp8_e5m2"


# ------------------------------------------------------------------ Triton stores


@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2"])
def test_rope_store_quantizes_like_the_torch_path(kv):
    """``rope_store`` writes rotated K and V divided by the scales, saturated (never inf or
    NaN): the torch quantization of the same values (subnormals: within one step of it)."""
    from radixd.core.models.layers import Rotary
    from radixd.core.triton_ops import rope_store

    dt = FP8_DTYPES[kv]
    g = torch.Generator().manual_seed(1)
    T, H, Hkv, D = 5, 4, 2, 32
    q = torch.randn(T, H, D, generator=g).to(DEV)
    k = torch.randn(T, Hkv, D, generator=g).to(DEV)
    v = torch.randn(T, Hkv, D, generator=g).to(DEV)
    v[0, 0, :4] = torch.tensor([1e6, -1e6, 3e4, -3e4])  # past the range: saturate
    rot = Rotary(D, 64, 10000.0, None).to(DEV)
    pos = torch.arange(3, 3 + T, device=DEV)
    loc = torch.tensor([2, 5, 6, 9, 1], device=DEV)
    kb = torch.zeros(12, Hkv, D, device=DEV, dtype=dt)
    vb = torch.zeros_like(kb)
    ks, vs = 0.02, 0.5
    _, ref_k = rot(pos, q.clone(), k)
    rope_store(q.clone(), k, v, pos, rot.cos, rot.sin, kb, vb, loc, ks, vs)
    top = torch.finfo(dt).max
    for buf, ref, s in ((kb, ref_k, ks), (vb, v, vs)):
        got = buf[loc].float()
        assert torch.isfinite(got).all() and got.abs().max() <= top
        want = quantize(ref, s, dt).float()
        # one step of the format's mantissa (relative), or of its smallest subnormals
        step = want.abs() * 2.0 ** -MANTISSA_BITS[dt] + torch.finfo(dt).smallest_normal
        assert ((got - want).abs() <= step).all() and (got == want).float().mean() > 0.99, (got == want).float().mean()
    assert vb[loc[0], 0, :4].float().tolist() == [top, -top, top, -top]
    untouched = torch.ones(12, dtype=torch.bool)
    untouched[loc] = False
    assert not kb[untouched].float().any() and not vb[untouched].float().any()


@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2"])
def test_gemv_rope_store_quantizes_like_the_torch_path(kv):
    """The one-row fused projection stores K and V as ``rope_store`` does."""
    from radixd.core.models.layers import Rotary
    from radixd.core.triton_ops import gemv_rope_store

    dt = FP8_DTYPES[kv]
    heads, kv_heads, dim, k = 4, 2, 16, 96
    g = torch.Generator().manual_seed(2)
    n = (heads + 2 * kv_heads) * dim
    x = torch.randn(1, k, generator=g).to(DEV)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(DEV)
    rot = Rotary(dim, 4096, 500000.0, None).to(DEV)
    pos, loc = torch.tensor([1234], device=DEV), torch.tensor([7], device=DEV)
    q, kk, v = F.linear(x, w).split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    _, ref_k = rot(pos, q.view(1, heads, dim), kk.view(1, kv_heads, dim))
    kb = torch.zeros(10, kv_heads, dim, device=DEV, dtype=dt)
    vb = torch.zeros_like(kb)
    ks, vs = 0.25, 0.0625
    gemv_rope_store(x, w, None, pos, rot.cos, rot.sin, kb, vb, loc, num_heads=heads, k_scale=ks, v_scale=vs)
    for buf, ref, s in ((kb, ref_k[0], ks), (vb, v.view(kv_heads, dim), vs)):
        want = quantize(ref, s, dt).float()
        step = want.abs() * 2.0 ** -MANTISSA_BITS[dt] + torch.finfo(dt).smallest_normal
        assert ((buf[7].float() - want).abs() <= step).all()
    kb[7], vb[7] = 0, 0
    assert not kb.float().any() and not vb.float().any()


async def test_triton_backend_matches_the_torch_backend_on_an_fp8_pool(tiny_dense_models):
    """The whole engine on the Triton kernels (interpreter) with an fp8 pool, on a model with
    sliding windows and score soft-caps (gemma2): rope_store's quantization, extend over
    chunks and decode give the torch backend's logprobs, themselves close to an fp32 pool's."""
    path = tiny_dense_models["gemma2"]
    ids = prompts(1, 12, seed=4)[0]  # (past the window of 8)
    got = {}
    for backend, kv in (("torch", "auto"), ("torch", "fp8_e4m3"), ("triton", "fp8_e4m3")):
        eng = make_engine(path, kv_cache_dtype=kv, attention_backend=backend, chunked_prefill_size=8,
                          cuda_graphs=False)
        try:
            got[backend, kv] = (await prompt_logprobs(eng, ids), await steps(eng, ids, 3))
        finally:
            await eng.stop()
    (lp_f, st_f), (lp_t, st_t), (lp_x, st_x) = got["torch", "auto"], got["torch", "fp8_e4m3"], got["triton", "fp8_e4m3"]
    assert_close((torch.tensor(lp_t) - torch.tensor(lp_f)).abs().tolist() + step_diffs(st_f, st_t, 0.4), "fp8_e4m3")
    # (a value the kernels' fp32 arithmetic puts on the other side of a rounding boundary is
    # one fp8 step off: far below fp8's own error, ~0.05 nats on average here)
    torch.testing.assert_close(torch.tensor(lp_x), torch.tensor(lp_t), atol=1e-2, rtol=0)
    assert [t for t, _, _ in st_x] == [t for t, _, _ in st_t]


@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_pool_read_by_a_bf16_query_takes_fp16_products(kv):
    """A bf16 query over an fp8 pool: the decode kernel's products in fp16 (its default there)
    stay within bf16's reach of the float64 reference; on a GPU, as close as bf16 products.
    (Triton's interpreter converts fp8 to bf16 wrongly, so the CPU checks the fp16 path only.)"""
    from test_triton_kernels import as_kv, make_pool, ref_attention

    from radixd.core.attention.triton_kernels import decode_attention

    seq_lens = [1, 9, 40, 77]
    kb, vb, table, rows = make_pool(sum(seq_lens) + 5, 2, 32, torch.float32, seq_lens, seed=3)
    (k8, v8), (rk, rv), scales = as_kv(kb, vb, kv)
    q = torch.randn(len(seq_lens), 4, 32, device=DEV).to(torch.bfloat16)
    lens = torch.tensor(seq_lens, device=DEV)
    errs = {}
    for f16 in (None, False) if GPU else (None,):
        out = decode_attention(q, k8, v8, table, rows, lens, 32**-0.5, num_splits=2, fp16_dot=f16, **scales)
        errs[f16] = max(rel_err(out[b], ref_attention(q[b][None], rk, rv, table[rows[b], :n],
                                                      torch.tensor([n - 1], device=DEV), 32**-0.5)[0])
                        for b, n in enumerate(seq_lens))
    assert errs[None] < 1e-2, errs
    if GPU:
        assert errs[None] <= errs[False] * 1.5, errs  # (fp16 keeps more mantissa than bf16)


# ------------------------------------------------------------------ kernels at the 8B shape (GPU)

REAL_LENS = [1, 17, 512, 2048, 4096, 3000, 64, 1000]  # 32 query heads, 8 KV heads, head dim 128


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA device")
@pytest.mark.parametrize("splits", [1, 4, 32])
@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_decode_kernel_at_8b_shape(splits, kv):
    check_decode(32, 8, 128, REAL_LENS, splits, kv)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA device")
@pytest.mark.parametrize("splits", [1, 4])
def test_fp8_products_decode_kernel_at_8b_shape(splits):
    """An e4m3 pool's q.K on the fp8 tensor cores (``fp8_dot``: the query rounded to e4m3):
    within 3% of the float64 attention over the same fp8 K/V (the pool's own rounding costs
    about 3% against bf16 K/V)."""
    err = check_decode(32, 8, 128, REAL_LENS, splits, "fp8_e4m3", fp8_dot=True, tol=0.03)
    print(f"fp8_dot, {splits} splits: max rel err {err:.4f}")


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA device")
@pytest.mark.parametrize("splits", [1, 2])
def test_fp8_cascade_kernel_at_8b_shape(splits):
    check_cascade("real", splits, "fp8_e4m3")


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA device")
@pytest.mark.parametrize("config", [None, (64, 64, 4, 3, True), (128, 64, 8, 3, False)], ids=str)
@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_extend_kernel_at_8b_shape(config, kv):
    check_extend(32, 8, 128, REAL_LENS, config, kv)


# ------------------------------------------------------------------ cache tiers

FP8_CTX_SHAPE = (2, 2, 8, 2, 32)  # [K/V, layers, page tokens, KV heads, head dim]


def fp8_page(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return quantize(torch.randn(FP8_CTX_SHAPE, generator=g) * 50, 1.0, torch.float8_e4m3fn)


def assert_round_trips(tier) -> None:
    """fp8 pages stored and loaded back bit for bit, still fp8 (never upcast)."""
    pages = {bytes([i]) * 16: fp8_page(i) for i in range(3)}
    for key, data in pages.items():
        assert tier.store(key, Page(data))
    for key, data in pages.items():
        page = tier.load(key)
        assert page is not None and page.data.dtype == torch.float8_e4m3fn
        assert torch.equal(page.host().view(torch.uint8), data.view(torch.uint8))
    n = 3 * data.numel()  # one byte per value (and, where a tier keeps blobs, their headers)
    assert n <= tier.stats.bytes_stored < 1.25 * n


def fp8_tier_context(identity: str = "fp8-model"):
    from radixd.core.tiers import TierContext

    return TierContext(identity, FP8_CTX_SHAPE, torch.float8_e4m3fn, torch.device("cpu"))


def test_fp8_pages_round_trip_through_host_and_disk(tmp_path):
    from radixd.core.tiers.disk import DiskTier
    from radixd.core.tiers.host import HostTier

    ctx = fp8_tier_context()
    assert_round_trips(HostTier({"max_bytes": 1 << 20}, ctx))
    assert_round_trips(DiskTier({"path": str(tmp_path)}, ctx))
    reopened = DiskTier({"path": str(tmp_path)}, ctx)  # read back from the files
    assert torch.equal(reopened.load(bytes([1]) * 16).data.view(torch.uint8), fp8_page(1).view(torch.uint8))


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")
def test_fp8_pages_round_trip_through_redis(redis_plugin, redis_server):  # (conftest's fixtures)
    tier = redis_plugin.RedisTier({"url": redis_server.url}, fp8_tier_context())
    try:
        assert_round_trips(tier)
    finally:
        tier.close()


async def test_bf16_and_fp8_engines_sharing_a_disk_tier_never_cross_serve(tiny_models, tmp_path):
    """Engines of one model on one disk directory, bf16 KV and fp8 KV: each is served only
    its own pages (keyed apart: not even looked up as the other's), fp8 pages come back to a
    new fp8 engine as they were stored."""
    path = tiny_models["llama"]
    prompt = prompts(1, 40, seed=9)[0]
    kw = dict(dtype="bfloat16", cache_tiers=("disk",), cache_write_policy="write_through", cache_page_tokens=8,
              cache_tier_options={"disk": {"path": str(tmp_path)}})
    runs = []
    for kv in ("auto", "fp8_e4m3", "fp8_e4m3", "auto"):
        eng = make_engine(path, kv_cache_dtype=kv, **kw)
        try:
            cached: list[int] = []
            toks = [t for t, _, _ in await steps(eng, prompt, 4, cached)]
            eng.tiers.flush()
            runs.append((kv, toks, cached[0], eng.stats()["cache_tiers"]["disk"]))
        finally:
            await eng.stop()
    (_, bf_toks, bf_cached, bf_st), (_, f_toks, f_cached, f_st), (_, f2_toks, f2_cached, f2_st), \
        (_, bf2_toks, bf2_cached, bf2_st) = runs
    assert bf_cached == 0 and bf_st["stores"] == 5
    assert f_cached == 0 and f_st["tokens_loaded"] == 0 and f_st["corrupt"] == 0 and f_st["stores"] == 5
    # (the whole pages of the 39 tokens looked up: the last prompt token is always computed)
    assert f2_cached == 32 and f2_st["tokens_loaded"] == 32 and f2_toks == f_toks
    assert bf2_cached == 32 and bf2_st["tokens_loaded"] == 32 and bf2_toks == bf_toks
    assert f2_st["corrupt"] == bf2_st["corrupt"] == 0
    assert len(list(tmp_path.glob("*/*.kv"))) == 10  # both sets side by side


# ------------------------------------------------------------------ the benchmark


def test_fp8_kv_benchmark_quick(tmp_path):
    """``python -m benchmarks.fp8_kv --quick``: the benchmark's logic on a tiny CPU model."""
    import json

    from benchmarks import fp8_kv

    out = tmp_path / "fp8_kv.json"
    assert fp8_kv.main(["--quick", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    bf, fp8 = doc["runs"]["auto"], doc["runs"]["fp8_e4m3"]
    assert fp8["kv_dtype"] == "float8_e4m3fn" and fp8["pool_tokens"] >= doc["batch"] * doc["context"]
    assert fp8["kv_bytes_per_token"] * 4 == bf["kv_bytes_per_token"]  # (float32 on the CPU)
    assert bf["slots_shared"] and not fp8["slots_shared"]
    assert doc["fp8_over_bf16"]["pool_tokens"] > 3.9 and doc["fp8_over_bf16"]["tok_s"] > 0
    assert "environment" in doc
