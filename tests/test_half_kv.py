"""A 16-bit KV pool under a float32 model on the CPU (``kv_cache_dtype = "float16"`` or
``"bfloat16"``): the decode kernels read it in float32 (the same results as over float32
copies of its values; the fused decode step over it: ``test_cpu_kernels``'s
``test_fused_decode_layers_equal_the_layer_loop``), the engine's greedy tokens stay transformers' (float16) or its logits close to them (bfloat16),
the pool holds twice the tokens in the same bytes, stored pages keep to their own pool's
format, and a 16-bit pool a device cannot read under its model is refused by name.

Tolerance (tiny random models, fp32 weights): a bfloat16 pool's chosen tokens'
log-probabilities within 0.05 nats of transformers' float32 ones (measured: 0.020 at most;
a float16 pool's 0.0024, its tokens all transformers')."""

from __future__ import annotations

import asyncio

import pytest
import torch
from conftest import hf_greedy
from test_cpu_kernels import reference_decode
from test_engine import assert_greedy_matches, assert_idle, make_engine, prompts

from radixd import SamplingParams
from radixd.core import cpu_kernels
from radixd.core.errors import ConfigError
from radixd.core.kv_quant import HALF_DTYPES, kv_format

HALF = ["float16", "bfloat16"]
BF16_LOGIT_TOL = 0.05


def needs_half_kernels():
    if cpu_kernels.library() is None or cpu_kernels.kv_type(torch.float32, torch.float16) is None:
        pytest.skip("no AVX2 kernels here: a 16-bit pool is read through torch's path")


@pytest.mark.parametrize("name", HALF)
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (4, 4, 64), (8, 2, 128), (16, 1, 32)])
def test_decode_reads_a_half_pool_as_float32_copies_of_it(name, heads, kv_heads, dim):
    needs_half_kernels()
    half = HALF_DTYPES[name]
    g = torch.Generator().manual_seed(heads * dim)
    k_buf = torch.randn(400, kv_heads, dim, generator=g).to(half)
    v_buf = torch.randn(400, kv_heads, dim, generator=g).to(half)
    lens = torch.tensor([1, 37, 120, 64])
    slots = torch.zeros(4, 120, dtype=torch.int64)
    for b, n in enumerate(lens.tolist()):
        slots[b, :n] = torch.randperm(400, generator=g)[:n]
    slots[3, :60] = slots[2, :60]  # a shared prefix
    q = torch.randn(4, heads, dim, generator=g)
    assert cpu_kernels.takes(torch.float32, k_buf, heads)
    assert not cpu_kernels.takes(torch.bfloat16 if half == torch.float16 else torch.float16, k_buf, heads)
    got = cpu_kernels.decode(q, k_buf, v_buf, slots, lens, dim**-0.5)
    # the same arithmetic as over float32 copies of the pool's values: equal bit for bit
    assert torch.equal(got, cpu_kernels.decode(q, k_buf.float(), v_buf.float(), slots, lens, dim**-0.5))
    want = reference_decode(q, k_buf.float(), v_buf.float(), slots, lens, dim**-0.5)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", HALF)
def test_engine_over_a_half_pool(tiny_models, name):
    """Batching, a shared prefix (cache hits), chunked prefill and preemption over a 16-bit
    pool: float16's greedy tokens are transformers'; bfloat16's chosen tokens' log-probabilities
    stay close to transformers' (its tokens may part from theirs only at a near tie)."""
    path = tiny_models["llama"]
    base = prompts(1, 24, seed=3)[0]
    ps = [base + p for p in prompts(4, 6, seed=4)] + prompts(2, 30, seed=5)
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True, logprobs=True)

    async def run():
        eng = make_engine(path, kv_cache_dtype=name, chunked_prefill_size=16, kv_cache_tokens=160,
                          schedule_conservativeness=0.0)
        try:
            assert eng.kv_dtype == HALF_DTYPES[name]
            assert {b.dtype for b in eng.replicas[0].worker.pool.k_buffers} == {HALF_DTYPES[name]}

            async def one(p):
                got = []
                async for out in eng.generate(input_ids=p, params=params):
                    got += [(lp.token_id, lp.logprob) for lp in out.logprobs or []]
                return got

            outs = await asyncio.gather(*(one(p) for p in ps))
            await assert_idle(eng)
            return outs
        finally:
            await eng.stop()

    outs = asyncio.run(run())
    for p, got in zip(ps, outs, strict=True):
        toks = [t for t, _ in got]
        assert len(toks) == 12
        if name == "float16":
            assert_greedy_matches(path, p, toks, 12)
            continue
        want, logits = hf_greedy(path, p, 12)
        ref = torch.log_softmax(logits, -1)
        for i, (t, lp) in enumerate(got):
            assert abs(lp - float(ref[i, t])) < BF16_LOGIT_TOL, (i, lp, float(ref[i, t]))
            if t != want[i]:
                assert float(logits[i, want[i]] - logits[i, t]) < 2 * BF16_LOGIT_TOL
                break


def test_a_half_pool_holds_twice_the_tokens_and_keeps_its_own_pages(tiny_models):
    from radixd.core.assembly import ModelSetup, kv_identity, kv_slots
    from radixd.core.config import EngineConfig

    path = tiny_models["llama"]
    got = {}
    for name in ("auto", "float16", "bfloat16"):
        cfg = EngineConfig(model=str(path), kv_cache_dtype=name, kv_cache_bytes=1 << 20)
        setup = ModelSetup.load(cfg)
        got[name] = kv_slots(cfg, setup, None), kv_identity(cfg, setup)
    assert got["float16"][0] == got["bfloat16"][0] and abs((got["float16"][0] - 1) - 2 * (got["auto"][0] - 1)) <= 1
    assert len({ident for _, ident in got.values()}) == 3  # stored pages never cross formats


def test_a_half_pool_the_triton_backend_cannot_read_is_refused_by_name(tiny_models):
    from radixd.core.assembly import ModelSetup
    from radixd.core.config import EngineConfig

    cfg = EngineConfig(model=str(tiny_models["llama"]), kv_cache_dtype="float16", attention_backend="triton")
    with pytest.raises(ConfigError, match="'kv_cache_dtype'.*'float16'.*torch backend"):
        ModelSetup.load(cfg)


def test_a_half_pool_a_device_cannot_read_is_refused_by_name():
    assert kv_format("bfloat16", torch.bfloat16, 2, device="cuda").dtype == torch.bfloat16  # the model's own
    assert kv_format("float16", torch.float32, 2, device="cpu").dtype == torch.float16
    with pytest.raises(ConfigError, match="'kv_cache_dtype'.*'float16'.*'auto' or 'bfloat16'"):
        kv_format("float16", torch.bfloat16, 2, device="cuda")
    with pytest.raises(ConfigError, match="'kv_cache_dtype'.*'bfloat16'.*'auto' or 'float32'"):
        kv_format("bfloat16", torch.float32, 2, device="cuda")
    with pytest.raises(ConfigError, match="'kv_cache_dtype'.*'float16'"):
        kv_format("float16", torch.bfloat16, 2, device="cpu")
