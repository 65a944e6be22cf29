"""One-request decode on a GPU through the whole engine: the one-row fusions (the q/k/v
GEMV that rotates and stores K/V, the gate/up GEMV with SiLU*up) against the same engine
without them and against the torch backend (``-m gpu``)."""

from __future__ import annotations

import pytest
import torch

from radixd import Engine, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


async def greedy_logprobs(path, prompt: list[int], **kw) -> tuple[list[int], list[float]]:
    eng = Engine(model=str(path), device="cuda", dtype="float16", kv_cache_tokens=4096, max_running_requests=4, **kw)
    try:
        toks, lps = [], []
        params = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True, logprobs=True)
        async for out in eng.generate(input_ids=prompt, params=params):
            toks += out.token_ids
            lps += [lp.logprob for lp in out.logprobs or []]
        return toks, lps
    finally:
        await eng.stop()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])  # plain; q/k/v bias; q/k norm (not fused)
async def test_fused_one_row_decode_matches_unfused_and_torch(tiny_models, monkeypatch, arch):
    from radixd.core import triton_ops

    prompt = list(range(5, 45))
    fused = await greedy_logprobs(tiny_models[arch], prompt, cuda_graphs=True)
    monkeypatch.setattr(triton_ops, "FUSE_ONE_ROW", False)
    unfused = await greedy_logprobs(tiny_models[arch], prompt, cuda_graphs=True)
    ref = await greedy_logprobs(tiny_models[arch], prompt, attention_backend="torch", cuda_graphs=False)
    for other in (unfused, ref):
        assert fused[0] == other[0]
        assert max(abs(a - b) for a, b in zip(fused[1], other[1], strict=True)) < 2e-2


async def test_graph_replays_match_eager_as_the_batch_changes(tiny_models):
    """Six requests of different lengths finish at different steps: buckets with padding,
    picks fed back out of order (a finished request leaves a gap), one staged copy per step."""
    import asyncio

    prompts = [list(range(3 + i, 20 + 7 * i)) for i in range(6)]

    async def run(**kw):
        eng = Engine(model=str(tiny_models["llama"]), device="cuda", dtype="float16", kv_cache_tokens=4096,
                     max_running_requests=8, **kw)

        async def one(i, p):
            toks, lps = [], []
            params = SamplingParams(max_new_tokens=6 + 5 * i, temperature=0.0, ignore_eos=True, logprobs=True)
            async for out in eng.generate(input_ids=p, params=params):
                toks += out.token_ids
                lps += [lp.logprob for lp in out.logprobs or []]
            return toks, lps

        try:
            return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        finally:
            await eng.stop()

    graphs = await run(cuda_graphs=True)
    eager = await run(cuda_graphs=False)
    for (t1, lp1), (t2, lp2) in zip(graphs, eager, strict=True):
        assert t1 == t2
        assert max(abs(a - b) for a, b in zip(lp1, lp2, strict=True)) < 2e-2
