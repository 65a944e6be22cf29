"""Programmatic dependent launch (the engine option ``pdl``): the decode path's Triton
kernels launched so that each may start while the one before drains, waiting on the device
(``triton_ops.pdl_begin``). Off the GPU the option is refused; on an H200 (``-m gpu``) each
kernel and the whole engine give what they give without it."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from radixd.core.errors import ConfigError

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


@triton.jit
def _no_wait(PDL: tl.constexpr):
    """``pdl_begin`` without griddepcontrol (which the interpreter lacks)."""
    pass


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal off a GPU")
def test_pdl_refused_off_a_gpu(tiny_models):
    from radixd import Engine

    with pytest.raises(ConfigError, match="'pdl'.*compute capability 9.0"):
        Engine(model=str(tiny_models["llama"]), pdl=True, kv_cache_tokens=256)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's run of the PDL paths")
def test_pdl_paths_compute_the_same_under_the_interpreter(monkeypatch):
    """With the wait and launch stubbed out (the interpreter has no griddepcontrol), each
    kernel's PDL path computes what its plain path does: the one-row GEMVs, which read their
    first weight step before the wait, over one and over several K steps; the norm."""
    from radixd.core import triton_ops
    from radixd.core.models.layers import Rotary

    monkeypatch.setattr(triton_ops, "pdl_begin", _no_wait)
    g = torch.Generator().manual_seed(3)

    def both(fn):
        return fn(False), fn(True)

    for n, k in ((37, 96), (5, 4096), (33, 3072)):
        x, w, b = torch.randn(1, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
        plain, pdl = (triton_ops.gemv(x, w, b, pdl=on) for on in (False, True))
        assert torch.equal(plain, pdl)
    x, w = torch.randn(1, 4096, generator=g), torch.randn(2 * 24, 4096, generator=g) / 64
    plain, pdl = both(lambda on: triton_ops.gemv_silu_mul(x, w, pdl=on))
    assert torch.equal(plain, pdl)
    heads, kv_heads, dim = 4, 2, 16
    x, w = torch.randn(1, 2048, generator=g), torch.randn((heads + 2 * kv_heads) * dim, 2048, generator=g)
    rot = Rotary(dim, 64, 10000.0, None)
    pos, loc = torch.tensor([9]), torch.tensor([3])

    def rope(on: bool):
        kb, vb = torch.zeros(5, kv_heads, dim), torch.zeros(5, kv_heads, dim)
        q = triton_ops.gemv_rope_store(x, w, None, pos, rot.cos, rot.sin, kb, vb, loc, num_heads=heads, pdl=on)
        return torch.cat((q.flatten(), kb.flatten(), vb.flatten()))

    plain, pdl = both(rope)
    assert torch.equal(plain, pdl) and plain.abs().sum() > 0
    x, res, nw = torch.randn(3, 64, generator=g), torch.randn(3, 64, generator=g), torch.randn(64, generator=g)
    plain, pdl = both(lambda on: torch.cat(triton_ops.add_rmsnorm(x, nw, 1e-5, res.clone(), use_triton=True, pdl=on)))
    assert torch.equal(plain, pdl)


@pytest.mark.parametrize("kernel", ["add_rmsnorm", "gemv", "gemv_silu_mul", "gemv_rope_store", "rows_linear",
                                    "decode_attention", "add_rmsnorm_router", "experts_gemv", "fp8_gemv",
                                    "int4_gemv"])
@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs a CUDA device of compute capability 9.0+")
def test_each_kernel_the_same_with_pdl(kernel):
    """Each kernel, launched for PDL right after a PDL-launched kernel that writes its input
    (an RMSNorm), reads that input as written: the same bits as the two without PDL."""
    from radixd.core import moe_ops, triton_ops
    from radixd.core.attention.triton_kernels import decode_attention
    from radixd.core.quant import gemv

    dev = torch.device("cuda")
    g = torch.Generator(device=dev)
    bf = torch.bfloat16
    hidden, heads, kv_heads, dim = 4096, 32, 8, 128

    def rand(*shape, dtype=bf):
        return torch.randn(*shape, generator=g, device=dev, dtype=torch.float32).to(dtype)

    def inputs() -> dict:
        """Every tensor a case reads but its input x, made before the two kernels run."""
        t = {"src": rand(4, hidden), "norm": rand(hidden), "w": rand(6144, hidden), "res": rand(4, hidden),
             "k_buf": rand(64, kv_heads, dim), "v_buf": rand(64, kv_heads, dim)}
        if kernel == "gemv_silu_mul":
            t["w"] = rand(2 * 14336, hidden) / 64
        if kernel == "gemv_rope_store":
            t["w"] = rand((heads + 2 * kv_heads) * dim, hidden)
            t["cos"], t["sin"] = rand(128, dim // 2, dtype=torch.float32), rand(128, dim // 2, dtype=torch.float32)
            t["pos"], t["loc"] = torch.tensor([5], device=dev), torch.tensor([9], device=dev)
        if kernel == "decode_attention":
            t["table"] = torch.arange(64, device=dev).view(1, 64).repeat(4, 1)
            t["rows"], t["lens"] = torch.arange(4, device=dev), torch.tensor([64, 33, 7, 1], device=dev)
        if kernel == "add_rmsnorm_router":
            t["router"] = rand(128, hidden)
        if kernel == "experts_gemv":  # (Qwen3-30B-A3B's expert shape, routed in the kernel)
            t["logits"], t["up"], t["down"] = rand(1, 128), rand(128, 2 * 768, 2048) / 45, rand(128, 2048, 768) / 28
        if kernel == "fp8_gemv":
            t["w"], t["scale"] = t["w"].to(torch.float8_e4m3fn), rand(6144, dtype=torch.float32).abs()
        if kernel == "int4_gemv":  # (groups of 128, symmetric: the packed-pair asm path)
            t["w"] = torch.randint(-2**31, 2**31 - 1, (6144, hidden // 8), generator=g, device=dev, dtype=torch.int32)
            t["scale"] = rand(6144, hidden // 128)
        return t

    def run(pdl: bool):
        g.manual_seed(0)
        t = inputs()
        torch.cuda.synchronize()
        x = triton_ops.add_rmsnorm(t["src"], t["norm"], 1e-5, pdl=pdl)[0]  # (the kernel before, writing x)
        if kernel == "add_rmsnorm":
            y, r = triton_ops.add_rmsnorm(x, t["norm"], 1e-5, t["res"], pdl=pdl)
            return torch.cat((y, r))
        if kernel == "gemv":
            return triton_ops.gemv(x[:1], t["w"], pdl=pdl)
        if kernel == "gemv_silu_mul":
            return triton_ops.gemv_silu_mul(x[:1], t["w"], pdl=pdl)
        if kernel == "rows_linear":
            return triton_ops.rows_linear(x, t["w"], pdl=pdl)
        if kernel == "fp8_gemv":
            return gemv.fp8_gemv(x[:1], t["w"], t["scale"], None, None, pdl=pdl)
        if kernel == "int4_gemv":
            return gemv.int_gemv(x[:1], t["w"], t["scale"], None, 4, 128, None, None, pdl=pdl)
        if kernel == "add_rmsnorm_router":
            h, r, logits = moe_ops.add_rmsnorm_router(x[:1], t["res"][:1], t["norm"], 1e-5, t["router"], pdl=pdl)
            return torch.cat((h.flatten(), r.flatten(), logits.flatten()))
        if kernel == "experts_gemv":
            return moe_ops.experts_gemv(x[:1, :2048], t["up"], t["down"], logits=t["logits"], top_k=8,
                                        renormalize=True, pdl=pdl)
        if kernel == "gemv_rope_store":
            k_buf, v_buf = t["k_buf"], t["v_buf"]
            q = triton_ops.gemv_rope_store(x[:1], t["w"], None, t["pos"], t["cos"], t["sin"], k_buf, v_buf, t["loc"],
                                           num_heads=heads, pdl=pdl)
            return torch.cat((q.flatten(), k_buf[9].flatten(), v_buf[9].flatten()))
        return decode_attention(x.view(4, heads, dim), t["k_buf"], t["v_buf"], t["table"], t["rows"], t["lens"],
                                dim**-0.5, num_splits=4, pdl=pdl)

    want = run(False)
    got = run(True)
    torch.cuda.synchronize()
    assert torch.equal(got, want) and want.float().abs().sum() > 0


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs a CUDA device of compute capability 9.0+")
@pytest.mark.parametrize("graphs", [True, False])
@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3-moe"])
async def test_engine_decodes_the_same_with_pdl(tiny_models, tiny_moe_models, graphs, arch):
    """Greedy tokens and logprobs of one request and of four at once (the one-row GEMVs, the
    MoE block's kernels, the few-row kernel), replayed in graphs or eager, equal with and
    without PDL."""
    from test_gpu_decode import assert_same_greedy, greedy_runs

    path = (tiny_moe_models if arch == "qwen3-moe" else tiny_models)[arch]
    prompts = [list(range(5, 45)), list(range(7, 30)), list(range(3, 60)), list(range(11, 20))]
    for batch in (prompts[:1], prompts):
        on = await greedy_runs(path, batch, [24] * len(batch), cuda_graphs=graphs, pdl=True)
        off = await greedy_runs(path, batch, [24] * len(batch), cuda_graphs=graphs, pdl=False)
        assert_same_greedy(on, off)
