"""One-request decode on a GPU through the whole engine: the one-row fusions (the q/k/v
GEMV that rotates and stores K/V, the gate/up GEMV with SiLU*up, the in-kernel split merge)
against the same engine without them and against the torch backend (``-m gpu``)."""

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
    from radixd.core.attention import triton_backend

    prompt = list(range(5, 45))
    fused = await greedy_logprobs(tiny_models[arch], prompt, cuda_graphs=True)
    monkeypatch.setattr(triton_ops, "FUSE_ONE_ROW", False)
    monkeypatch.setattr(triton_backend, "FUSED_MERGE", False)
    unfused = await greedy_logprobs(tiny_models[arch], prompt, cuda_graphs=True)
    ref = await greedy_logprobs(tiny_models[arch], prompt, attention_backend="torch", cuda_graphs=False)
    for other in (unfused, ref):
        assert fused[0] == other[0]
        assert max(abs(a - b) for a, b in zip(fused[1], other[1], strict=True)) < 2e-2
