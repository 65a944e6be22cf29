"""Mixture-of-experts models (Qwen3-MoE, Qwen2-MoE, Mixtral): greedy tokens equal
transformers' (fp32, CPU) under batching, mid-flight arrivals with small chunked prefill,
cache hits, preemption and tensor parallelism; the fused MoE Triton kernels against the torch
reference (through the interpreter at tiny shapes; at Qwen3-30B-A3B's layer shape on a GPU,
``-m gpu``); configs radixd does not implement refused, naming the field."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch
from conftest import MOE_ARCHS
from test_engine import (
    assert_greedy_matches,
    assert_idle,
    check_greedy_matches_transformers,
    check_mid_flight_small_chunks,
    check_preemption_keeps_tokens,
    check_prefix_served_from_cache,
    collect,
    make_engine,
    prompts,
    tp1_and_tp2_tokens,
)

from radixd.core.models.config import ModelConfig
from radixd.core.moe_ops import (
    PAIRS_UNSORTED,
    MoETiles,
    add_rmsnorm_router,
    align_pairs,
    experts_gemv,
    experts_torch,
    experts_triton,
)

GPU = torch.cuda.is_available()


@pytest.mark.parametrize("arch", MOE_ARCHS)
async def test_moe_greedy_matches_transformers(tiny_moe_models, arch):
    await check_greedy_matches_transformers(tiny_moe_models[arch])


async def test_moe_through_the_triton_kernels_matches_transformers(tiny_moe_models, monkeypatch):
    """The model with its experts run by the fused Triton kernels (the interpreter here):
    prefill (pairs sorted by expert) and decode (a block per pair) give transformers' tokens."""
    from radixd.core import moe_ops
    from radixd.core.models import moe

    calls = []

    def triton_experts(*args, **kw):
        calls.append(args[0].shape[0])
        return moe_ops.fused_experts(*args, **kw, use_triton=True)

    monkeypatch.setattr(moe, "fused_experts", triton_experts)
    path = tiny_moe_models["qwen2-moe"]
    eng = make_engine(path)
    try:
        p = prompts(1, 20, seed=5)[0]
        assert_greedy_matches(path, p, await collect(eng, p, 4), 4)
        assert 20 in calls and 1 in calls
    finally:
        await eng.stop()


@pytest.mark.parametrize("arch", MOE_ARCHS)
async def test_moe_routed_in_the_gemv_kernel_matches_transformers(tiny_moe_models, arch, monkeypatch):
    """Decode at batch 1 as CUDA runs it: the residual add, norm and router GEMV in one kernel
    (``add_rmsnorm_router``), the router's softmax, top-k and rescaling inside the experts'
    GEMV kernel (``experts_gemv``; the interpreter here); transformers' tokens."""
    from radixd.core.models import moe

    calls = []

    def one_token(x, kernels):
        calls.append(x.shape[0])
        return x.shape[0] == 1

    fused = []

    def add_norm_router(*args, **kw):
        fused.append(args[0].shape[0])
        return add_rmsnorm_router(*args, **kw)

    monkeypatch.setattr(moe, "routed_in_kernel", one_token)
    monkeypatch.setattr(moe, "add_rmsnorm_router", add_norm_router)
    path = tiny_moe_models[arch]
    eng = make_engine(path)
    try:
        p = prompts(1, 12, seed=3)[0]
        assert_greedy_matches(path, p, await collect(eng, p, 4), 4)
        assert 1 in calls and fused and set(fused) == {1}
    finally:
        await eng.stop()


@pytest.mark.parametrize("arch", MOE_ARCHS)
async def test_moe_mid_flight_arrivals_and_small_chunks(tiny_moe_models, arch):
    await check_mid_flight_small_chunks(tiny_moe_models[arch], [16, 8, 8], min_steps=15)


@pytest.mark.parametrize("arch", MOE_ARCHS)
async def test_moe_prefix_served_from_cache(tiny_moe_models, arch):
    await check_prefix_served_from_cache(tiny_moe_models[arch])


@pytest.mark.parametrize("arch", ["qwen2-moe", "mixtral"])
async def test_moe_preemption_keeps_tokens(tiny_moe_models, arch):
    await check_preemption_keeps_tokens(tiny_moe_models[arch], radix=True)


@pytest.mark.parametrize("arch", MOE_ARCHS)
async def test_moe_tp2_gives_the_tp1_tokens(tiny_moe_models, arch):
    """Experts split by their intermediate columns (the shared expert too), router
    replicated: two shards give one model's tokens."""
    path = tiny_moe_models[arch]
    cfg = ModelConfig.from_hf(json.loads((path / "config.json").read_text())).moe

    def check(shard):
        moe = next(layer.mlp for layer in shard.layers if hasattr(layer.mlp, "experts"))
        assert moe.experts.down_proj.shape[-1] == cfg.intermediate_size // 2
        assert moe.gate.weight.shape[0] == cfg.num_experts

    runs = await tp1_and_tp2_tokens(path, prompts(3, 20, seed=4), 10, check)
    assert runs[0] == runs[1]


@pytest.mark.parametrize("block", [(16, 32), None])
async def test_fp8_experts_checkpoint_gives_its_dequantized_twins_tokens(tiny_moe_models, tmp_path, block):
    """A Qwen3-MoE checkpoint whose experts are fp8 (block scales as Qwen3-MoE-FP8 ships
    them, or llmcompressor's per-channel ones) loads them as fp8 and decodes transformers'
    greedy tokens of the same model with the experts dequantized, in small prefill chunks and
    from the cache."""
    from quant_checkpoints import dense_twin, fp8_experts_checkpoint

    from radixd.core.quant.ops import FP8

    base = tiny_moe_models["qwen3-moe"]
    path, dense = fp8_experts_checkpoint(base, tmp_path / "fp8", block=block)
    twin = dense_twin(base, tmp_path / "twin", dense)
    # On the CPU, where the oracle is exact (float32 against float32): on a CUDA device the
    # engine runs bf16, whose logits differ from transformers' float32 ones by more than a tie
    # (there the gpu-marked tests compare within bf16 tolerances).
    eng = make_engine(path, chunked_prefill_size=7, device="cpu")
    try:
        experts = eng.worker.model.layers[0].mlp.experts
        assert experts.gate_up_proj.dtype == FP8 and experts.down_proj.dtype == FP8
        assert experts.gate_up_proj_scale.shape == ((8, 4, 2) if block else (8, 64))  # (2I = 64 rows, H = 64)
        ps = prompts(2, 20, seed=8)
        outs = await asyncio.gather(*(collect(eng, p, 8) for p in ps))
        for p, got in zip(ps, outs, strict=True):
            assert_greedy_matches(twin, p, got, 8)
        again = ps[0] + outs[0]
        assert_greedy_matches(twin, again, await collect(eng, again, 4), 4)
        await assert_idle(eng)
    finally:
        await eng.stop()


@pytest.mark.parametrize("block", [(16, 16), None])
async def test_fp8_experts_tp2_gives_the_tp1_tokens(tiny_moe_models, tmp_path, block):
    """fp8 experts split by their intermediate columns, their scales with them."""
    from quant_checkpoints import fp8_experts_checkpoint

    path, _ = fp8_experts_checkpoint(tiny_moe_models["qwen3-moe"], tmp_path / "fp8", block=block)

    def check(shard):
        assert shard.layers[0].mlp.experts.down_proj_scale.shape == ((8, 4, 1) if block else (8, 64))

    runs = await tp1_and_tp2_tokens(path, prompts(2, 20, seed=9), 8, check)
    assert runs[0] == runs[1]


def test_fp8_expert_blocks_a_shard_would_cut_and_int_experts_are_refused(tiny_moe_models, tmp_path):
    from quant_checkpoints import fp8_experts_checkpoint, gptq_checkpoint

    from radixd.core.errors import ConfigError
    from radixd.core.quant.formats import QuantFormatError

    base = tiny_moe_models["qwen3-moe"]
    path, _ = fp8_experts_checkpoint(base, tmp_path / "fp8", block=(16, 32))  # (16 columns a shard: half a block)
    with pytest.raises(ConfigError, match="tp_size.*fp8 blocks of \\[16, 32\\]"):
        make_engine(path, tp_size=2)
    gptq, _ = gptq_checkpoint(base, tmp_path / "gptq")
    with pytest.raises(QuantFormatError, match="experts.*int experts"):
        make_engine(gptq)


def test_moe_config_layout(tiny_moe_models):
    """Dense layers from mlp_only_layers / decoder_sparse_step; Mixtral renormalises."""
    def cfg(arch, **over):
        hf = json.loads((tiny_moe_models[arch] / "config.json").read_text())
        return ModelConfig.from_hf({**hf, **over})

    q3 = cfg("qwen3-moe")
    assert q3.moe.dense_layers == (1,) and q3.moe.renormalize and q3.moe.shared_intermediate_size == 0
    assert cfg("qwen3-moe", mlp_only_layers=[], decoder_sparse_step=2).moe.dense_layers == (0, 2)
    q2 = cfg("qwen2-moe")
    assert q2.moe.shared_intermediate_size == 48 and not q2.moe.renormalize and q2.attention_bias
    assert cfg("mixtral").moe.renormalize and cfg("mixtral").moe.num_experts == 4


@pytest.mark.parametrize("arch,field,value", [
    ("qwen3-moe", "hidden_act", "gelu"),
    ("qwen2-moe", "num_experts_per_tok", 7),
    ("mixtral", "num_experts_per_tok", 0),
    ("qwen3-moe", "decoder_sparse_step", 0),
])
def test_unimplemented_moe_config_is_refused(tiny_moe_models, arch, field, value):
    hf = json.loads((tiny_moe_models[arch] / "config.json").read_text())
    with pytest.raises(ValueError, match=rf"{field}.*{value!r}"):
        ModelConfig.from_hf({**hf, field: value})


def test_missing_expert_tensor_is_an_error(tmp_path):
    from conftest import make_tiny_checkpoint
    from safetensors.torch import load_file, save_file

    from radixd import Engine

    path = make_tiny_checkpoint(tmp_path / "broken", "mixtral", seed=4)
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.experts.3.w3.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(KeyError, match=r"lacks 1 tensors.*layers\.1\.mlp\.experts\.gate_up_proj#3,1"):
        Engine(model=str(path), kv_cache_tokens=64)


async def test_stacked_expert_checkpoint_loads(tiny_moe_models, tmp_path):
    """A checkpoint of transformers 5's in-memory layout (each layer's experts already
    stacked: ``mlp.experts.gate_up_proj`` [E, 2I, H], ``mlp.experts.down_proj``) gives the
    same tokens as the per-expert one."""
    import shutil

    from conftest import _hf_model
    from safetensors.torch import save_file

    src = tiny_moe_models["qwen3-moe"]
    state = {k: v.contiguous() for k, v in _hf_model(src).state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    dst = tmp_path / "stacked"
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors"))
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    p = prompts(1, 20, seed=6)[0]
    outs = []
    for path in (src, dst):
        eng = make_engine(path)
        try:
            outs.append(await collect(eng, p, 8))
        finally:
            await eng.stop()
    assert outs[0] == outs[1]


# ------------------------------------------------------------------------ kernels


def moe_case(t: int, e: int, k: int, h: int, i: int, dtype=torch.float32, device="cpu", seed: int = 0,
             idle: int = 0):
    """Random x, stacked expert weights and a softmax top-k routing (``idle``: that many
    experts get no token)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g)
    gate_up = torch.randn(e, 2 * i, h, generator=g) * h**-0.5
    down = torch.randn(e, h, i, generator=g) * i**-0.5
    logits = torch.randn(t, e, generator=g)
    logits[:, e - idle:] = -1e9
    weights, ids = logits.softmax(-1).topk(k, dim=-1)
    return [a.to(device) for a in (x.to(dtype), gate_up.to(dtype), down.to(dtype), weights, ids)]


def naive_moe(x, gate_up, down, weights, ids):
    """Token by token, slot by slot, in float64 (the definition)."""
    out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = (gate_up[e].double() @ x[t].double()).chunk(2)
            out[t] += float(weights[t, j]) * (down[e].double() @ (torch.nn.functional.silu(gate) * up))
    return out


SMALL_TILES = MoETiles(16, (32, 32, 1, 1), (32, 32, 1, 1))


@pytest.mark.parametrize("t,e,k,h,i,idle,tiles", [
    (1, 8, 2, 64, 32, 0, None),          # batch-1 decode: a block per pair, no sort
    (3, 8, 2, 48, 40, 0, SMALL_TILES),   # K and N not multiples of the tiles
    (20, 8, 2, 48, 40, 0, SMALL_TILES),  # the same, sorted by expert
    (40, 6, 2, 32, 32, 2, SMALL_TILES),  # sorted by expert; two experts idle
    (300, 8, 4, 64, 32, 0, None),        # more pairs than the decode tiles take: BLOCK_M 64
])
def test_experts_triton_matches_the_reference(t, e, k, h, i, idle, tiles):
    assert (t * k <= PAIRS_UNSORTED) == (t <= 3)
    x, gate_up, down, weights, ids = moe_case(t, e, k, h, i, idle=idle, seed=t)
    want = naive_moe(x, gate_up, down, weights, ids)
    ref = experts_torch(x, gate_up, down, weights, ids)
    torch.testing.assert_close(ref.double(), want, rtol=1e-5, atol=1e-5)
    got = experts_triton(x, gate_up, down, weights, ids, tiles=tiles)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    if t > 100:  # in chunks of tokens, the last one short
        got = experts_triton(x, gate_up, down, weights, ids, tiles=tiles, chunk_tokens=128)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


GEMV_SMALL = dict(up_tiles=(4, 32, 1), down_tiles=(2, 16, 1))  # (K steps that 48 and 40 do not divide)
GEMV_SMALL_STREAMED = dict(up_tiles=(4, 16, 1, True), down_tiles=(2, 8, 1, True))  # (each next step prefetched)


@pytest.mark.parametrize("t,e,k,h,i", [(1, 8, 2, 64, 32), (1, 8, 2, 48, 40), (3, 6, 3, 32, 24), (1, 16, 8, 64, 32)])
@pytest.mark.parametrize("renormalize", [None, False, True])
@pytest.mark.parametrize("tiles", [GEMV_SMALL, GEMV_SMALL_STREAMED], ids=["small", "streamed"])
def test_experts_gemv_matches_the_reference(t, e, k, h, i, renormalize, tiles):
    """The few-token GEMV kernels, routed by the caller (``renormalize`` None) or from the
    router's logits inside the kernel (``route``'s softmax, top-k and rescaling): the MLP of
    the same routing, and the routing itself."""
    from radixd.core.models.moe import route

    dev = "cuda" if GPU else "cpu"  # (the interpreter runs CPU tensors only where no GPU is)
    x, gate_up, down, weights, ids = moe_case(t, e, k, h, i, seed=t + e, device=dev)
    if renormalize is None:
        got = experts_gemv(x, gate_up, down, weights=weights, ids=ids, **tiles)
    else:
        logits = torch.randn(t, e, generator=torch.Generator().manual_seed(i)).to(dev)
        weights, ids = route(logits, k, renormalize)
        got = experts_gemv(x, gate_up, down, logits=logits, top_k=k, renormalize=renormalize, **tiles)
    torch.testing.assert_close(got.double(), naive_moe(x, gate_up, down, weights, ids), rtol=1e-5, atol=1e-5)
    if t == 1:  # (experts_triton's own choice at one token: tl.dot tiles, TF32 products on a GPU)
        tol = 2e-3 if GPU else 1e-5
        torch.testing.assert_close(experts_triton(x, gate_up, down, weights, ids), got, rtol=tol, atol=tol)


@pytest.mark.parametrize("h,e,rows", [(64, 8, 1), (48, 6, 4)])
def test_add_rmsnorm_router_is_the_add_the_norm_and_the_router(h, e, rows):
    """One token: the residual add, RMSNorm and the router's GEMV in one kernel, against
    ``add_rmsnorm`` and ``F.linear``; the residual passed in is left as it was."""
    from radixd.core.moe_ops import add_rmsnorm_router
    from radixd.core.triton_ops import add_rmsnorm

    dev = "cuda" if GPU else "cpu"
    dtype = torch.bfloat16 if GPU else torch.float32
    g = torch.Generator().manual_seed(h)
    x, res, nw = (torch.randn(1, h, generator=g).to(dev, dtype) for _ in range(3))
    router = torch.randn(e, h, generator=g).to(dev, dtype)
    before = res.clone()
    got_h, got_res, logits = add_rmsnorm_router(x, res, nw, 1e-6, router, rows=rows)
    assert torch.equal(res, before)
    want_h, want_res = add_rmsnorm(x, nw, 1e-6, before.clone())
    tol = dict(rtol=2e-2, atol=2e-2) if GPU else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_res, want_res, **tol)
    torch.testing.assert_close(got_h, want_h, **tol)
    torch.testing.assert_close(logits, torch.nn.functional.linear(want_h, router), **tol)


def fp8_experts(gate_up, down, block):
    """Each expert's weights in fp8 (``block`` scales, or per row): (weights, scales) of both,
    and their dequantized 16-bit twins."""
    from radixd.core.quant.ops import dequantize_fp8, quantize_fp8

    out = []
    for w in (gate_up, down):
        qs = [quantize_fp8(w[e], "block" if block else "channel", block or (128, 128)) for e in range(w.shape[0])]
        q, sc = torch.stack([a for a, _ in qs]), torch.stack([b for _, b in qs])
        out.append((q, sc, torch.stack([dequantize_fp8(q[e], sc[e], block) for e in range(w.shape[0])]).to(w.dtype)))
    return out


@pytest.mark.parametrize("t,block", [(1, None), (1, (16, 32)), (20, (16, 32)), (40, None)])
def test_fp8_experts_compute_the_dequantized_experts(t, block):
    """fp8 experts (per-row scales, or 16 x 32 blocks that do not divide either K, 48 and 40)
    through the Triton kernels and the torch loop: the MLP of their dequantized weights."""
    x, gate_up, down, weights, ids = moe_case(t, 8, 2, 48, 40, idle=1, seed=t)
    (gq, gs, gd), (dq, ds, dd) = fp8_experts(gate_up, down, block)
    want = naive_moe(x, gd, dd, weights, ids)
    for fn in (experts_torch, lambda *a, **kw: experts_triton(*a, **kw, tiles=SMALL_TILES)):
        got = fn(x, gq, dq, weights, ids, scales=(gs, ds), block=block)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    # the GEMV kernels on at most 2 tokens (the engine gives them one; each token is a program
    # row of its own, and the interpreter runs 20 or 40 of them for minutes)
    g = slice(0, 2)
    for tiles in (GEMV_SMALL, GEMV_SMALL_STREAMED):
        got = experts_gemv(x[g], gq, dq, weights=weights[g], ids=ids[g], scales=(gs, ds), block=block, **tiles)
        torch.testing.assert_close(got.double(), want[g], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("t", [1, 40])
def test_experts_triton_reads_only_the_chosen_experts(t):
    """Every expert no token chose has NaN weights: the output is still exact."""
    x, gate_up, down, weights, ids = moe_case(t, 8, 2, 32, 32, idle=3, seed=7)
    chosen = torch.zeros(8, dtype=torch.bool)
    chosen[ids.flatten()] = True
    want = experts_torch(x, gate_up, down, weights, ids)
    gate_up[~chosen] = float("nan")
    down[~chosen] = float("nan")
    got = experts_triton(x, gate_up, down, weights, ids, tiles=SMALL_TILES)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    g = slice(0, 2)  # (the GEMV kernels on at most 2 tokens, as above)
    for tiles in (GEMV_SMALL, GEMV_SMALL_STREAMED):
        got = experts_gemv(x[g], gate_up, down, weights=weights[g], ids=ids[g], **tiles)
        torch.testing.assert_close(got, want[g], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("t,k,e,bm", [(1, 8, 128, 16), (2, 8, 128, 16), (33, 2, 8, 16), (500, 8, 16, 64)])
def test_align_pairs_groups_each_expert_in_whole_blocks(t, k, e, bm):
    ids = torch.stack([torch.randperm(e, generator=torch.Generator().manual_seed(s))[:k] for s in range(t)])
    sorted_ids, block_expert, used = align_pairs(ids, e, bm)
    n = t * k
    used = int(used)
    assert used % bm == 0 and sorted_ids.numel() >= used and sorted_ids.numel() // bm == block_expert.numel()
    real = sorted_ids[:used]
    assert sorted(real[real < n].tolist()) == list(range(n))  # every pair once, in a block in use
    assert bool((sorted_ids[used:] == n).all())
    flat = ids.flatten()
    for b in range(used // bm):
        block = sorted_ids[b * bm:(b + 1) * bm]
        block = block[block < n]
        assert block.numel() > 0 and bool((flat[block] == block_expert[b]).all())


QWEN3_30B_LAYER = dict(e=128, k=8, h=2048, i=768)  # Qwen3-30B-A3B's MoE layer


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA device")
@pytest.mark.parametrize("t", [1, 2, 16, 64, 512, 4096])
def test_experts_triton_at_qwen3_30b_shape_on_gpu(t):
    """bf16 on the GPU against the per-expert torch loop, and both against float64."""
    x, gate_up, down, weights, ids = moe_case(t, **QWEN3_30B_LAYER, dtype=torch.bfloat16, device="cuda", seed=t)
    got = experts_triton(x, gate_up, down, weights, ids)
    ref = experts_torch(x, gate_up, down, weights, ids)
    want = naive_moe(x[:8], gate_up, down, weights[:8], ids[:8]) if t > 8 else naive_moe(x, gate_up, down, weights, ids)

    def rel(a, b):
        return float((a.double() - b.double()).norm() / b.double().norm())

    assert not got.isnan().any()
    assert rel(got, ref) < 2e-2
    assert rel(got[: want.shape[0]], want) < 2e-2 and rel(ref[: want.shape[0]], want) < 2e-2


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA device")
@pytest.mark.parametrize("t", [1, 2])
@pytest.mark.parametrize("block", ["bf16", (128, 128), None])
def test_experts_gemv_at_qwen3_30b_shape_on_gpu(t, block):
    """The GEMV kernels at Qwen3-30B-A3B's layer shape, bf16 and fp8 experts (128 x 128 blocks
    or per row), routed by the caller and from the router's logits in the kernel: against the
    per-expert torch loop on the same routing, and the tl.dot kernels."""
    from radixd.core.models.moe import route

    x, gate_up, down, _, _ = moe_case(t, **QWEN3_30B_LAYER, dtype=torch.bfloat16, device="cuda", seed=t)
    logits = torch.randn(t, 128, device="cuda").to(torch.bfloat16)
    weights, ids = route(logits, 8, True)
    kw = {}
    if block != "bf16":
        (gate_up, gs, _), (down, ds, _) = fp8_experts(gate_up, down, block)
        kw = dict(scales=(gs, ds), block=block)
    ref = experts_torch(x, gate_up, down, weights, ids, **kw)
    dot = experts_triton(x, gate_up, down, weights, ids, gemv=False, **kw)
    for got in (experts_gemv(x, gate_up, down, weights=weights, ids=ids, **kw),
                experts_gemv(x, gate_up, down, logits=logits, top_k=8, renormalize=True, **kw)):
        assert torch.isfinite(got).all()
        assert float((got.double() - ref.double()).norm() / ref.double().norm()) < 2e-2
        assert float((got.double() - dot.double()).norm() / dot.double().norm()) < 1e-2


def test_moe_benchmark_runs_tiny(tmp_path):
    """``python -m benchmarks.moe --tiny``: every section's logic on a tiny shape on the CPU
    (the fused kernel through the interpreter)."""
    from benchmarks import moe

    assert moe.main(["--tiny", "--out", str(tmp_path)]) == 0
    kernel = json.loads((tmp_path / "kernel.json").read_text())
    assert [c["tokens"] for c in kernel["cases"]] == [1, 3, 40]
    assert all(c["rel_err_vs_loop"] < 1e-5 and c["fused_us"] > 0 for c in kernel["cases"])
    swept = json.loads((tmp_path / "tiles.json").read_text())["cases"]
    assert [c["tokens"] for c in swept] == [1, 40] and all(0 < c["best_us"] <= c["default_us"] for c in swept)
    decode = json.loads((tmp_path / "decode.json").read_text())
    assert [c["batch"] for c in decode["cases"]] == [1, 2]
    assert decode["cases"][0]["experts_per_layer"] == 2  # batch 1: its top-k
    assert all(c["decode_tok_s"] > 0 and c["roofline_fraction"] > 0 for c in decode["cases"])
    assert json.loads((tmp_path / "prefill.json").read_text())["tok_s"] > 0
    assert "environment" in json.loads((tmp_path / "summary.json").read_text())
    q = tmp_path / "fp8"  # (fp8 weights, experts included: a byte a weight, plus an fp32 scale a row)
    assert moe.main(["--tiny", "--out", str(q), "--sections", "decode", "--quant", "fp8-channel"]) == 0
    fp8 = json.loads((q / "decode.json").read_text())
    h, i = moe.TINY["hidden_size"], moe.TINY["moe_intermediate_size"]
    assert fp8["expert_MB"] == round((3 * h * i + 4 * (2 * i + h)) / 1e6, 3) < decode["expert_MB"]


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA device")
@pytest.mark.parametrize("arch", MOE_ARCHS)
async def test_moe_engine_on_gpu_graphs_match_eager_and_the_torch_loop(tiny_moe_models, arch, monkeypatch):
    """fp16 on the GPU: twelve requests finishing at different steps, so decode replays
    graphs of pairs sorted by expert (batch > 8 at top-2) and of a block per pair (<= 8),
    against eager and against the per-expert torch loop with the torch attention backend."""
    from test_gpu_decode import assert_same_greedy, greedy_runs

    from radixd.core import moe_ops
    from radixd.core.models import moe

    path = tiny_moe_models[arch]
    prompts_ = [list(range(3 + i, 20 + 7 * i)) for i in range(12)]
    max_new = [6 + 3 * i for i in range(12)]
    graphs = await greedy_runs(path, prompts_, max_new, cuda_graphs=True, top_logprobs=2)
    eager = await greedy_runs(path, prompts_, max_new, cuda_graphs=False, top_logprobs=2)
    assert_same_greedy(graphs, eager)  # the same kernels: the same tokens
    monkeypatch.setattr(moe, "fused_experts", lambda *a, **kw: moe_ops.fused_experts(*a, **kw, use_triton=False))
    monkeypatch.setattr(moe, "routed_in_kernel", lambda x, kernels: False)
    ref = await greedy_runs(path, prompts_, max_new, attention_backend="torch", cuda_graphs=False, top_logprobs=2)
    assert_same_greedy_up_to_ties(graphs, ref)


def assert_same_greedy_up_to_ties(a, b, tie: float = 0.05, tol: float = 2e-2) -> None:
    """Other kernels, fp16: the same tokens and logprobs within ``tol``, up to a step where
    either run's two best tokens were within ``tie`` of each other (fp16 noise, and a router
    choice it tips, may pick either there; what follows is then another sequence)."""
    for (t1, lp1, top1), (t2, lp2, top2) in zip(a, b, strict=True):
        for k, (x, y) in enumerate(zip(t1, t2, strict=True)):
            if x != y:
                margins = [top[k][0][1] - top[k][1][1] for top in (top1, top2)]
                assert min(margins) < tie, (k, t1, t2, margins)
                break
            assert abs(lp1[k] - lp2[k]) < tol, (k, lp1[k], lp2[k])


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA device")
async def test_moe_engine_on_gpu_with_cascade_attention(tiny_moe_models):
    """``shared_prefix_case`` on a Qwen3-MoE model: cascade graph replays give plain decoding's
    tokens (the same expert kernels; the attention's rounding may differ, so routing near-ties
    are allowed)."""
    from test_gpu_decode import greedy_runs, greedy_runs_counting_cascade, shared_prefix_case

    path = tiny_moe_models["qwen3-moe"]
    prompts_, max_new = shared_prefix_case()
    cascade, replays = await greedy_runs_counting_cascade(path, prompts_, max_new, top_logprobs=2)
    assert any(replays)  # cascade graphs replayed
    plain = await greedy_runs(path, prompts_, max_new, cuda_graphs=True, cascade_attention=False, top_logprobs=2)
    assert_same_greedy_up_to_ties(cascade, plain)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA device")
@pytest.mark.parametrize("t", [1, 16, 512])
@pytest.mark.parametrize("block", [(128, 128), None])
def test_fp8_experts_at_qwen3_30b_shape_on_gpu(t, block):
    """fp8 experts (Qwen3-MoE-FP8's 128 x 128 blocks, or per row) through the fused kernels
    against the torch loop on the same fp8 weights, bf16 activations."""
    x, gate_up, down, weights, ids = moe_case(t, **QWEN3_30B_LAYER, dtype=torch.bfloat16, device="cuda", seed=t)
    (gq, gs, _), (dq, ds, _) = fp8_experts(gate_up, down, block)
    got = experts_triton(x, gq, dq, weights, ids, scales=(gs, ds), block=block)
    ref = experts_torch(x, gq, dq, weights, ids, scales=(gs, ds), block=block)
    assert torch.isfinite(got).all()
    assert float((got.double() - ref.double()).norm() / ref.double().norm()) < 2e-2
