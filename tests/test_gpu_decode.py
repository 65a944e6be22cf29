"""One-request decode on a GPU through the whole engine: the one-row fusions (the q/k/v
GEMV that rotates and stores K/V, the gate/up GEMV with SiLU*up) against the same engine
without them and against the torch backend (``-m gpu``)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from radixd import Engine, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


async def greedy_runs(path, prompts: list[list[int]], max_new: list[int], *, top_logprobs: int = 0,
                      **kw) -> list[tuple]:
    """Each prompt's greedy tokens and their logprobs (with ``top_logprobs``, also each step's
    top alternatives), all submitted at once to one fp16 engine."""
    eng = Engine(model=str(path), device="cuda", dtype="float16", kv_cache_tokens=4096, max_running_requests=8, **kw)

    async def one(prompt, n):
        toks, lps, tops = [], [], []
        params = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True, logprobs=True,
                                top_logprobs=top_logprobs)
        async for out in eng.generate(input_ids=prompt, params=params):
            toks += out.token_ids
            lps += [lp.logprob for lp in out.logprobs or []]
            tops += [lp.top for lp in out.logprobs or []]
        return (toks, lps, tops) if top_logprobs else (toks, lps)

    try:
        return await asyncio.gather(*(one(p, n) for p, n in zip(prompts, max_new, strict=True)))
    finally:
        await eng.stop()


def assert_same_greedy(a, b) -> None:
    for (t1, lp1, *_), (t2, lp2, *_) in zip(a, b, strict=True):
        assert t1 == t2
        assert max(abs(x - y) for x, y in zip(lp1, lp2, strict=True)) < 2e-2


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])  # plain; q/k/v bias; q/k norm (not fused)
async def test_fused_one_row_decode_matches_unfused_and_torch(tiny_models, arch):
    prompt = [list(range(5, 45))]
    fused = await greedy_runs(tiny_models[arch], prompt, [24], cuda_graphs=True)
    unfused = await greedy_runs(tiny_models[arch], prompt, [24], cuda_graphs=True, fuse_one_row=False)
    ref = await greedy_runs(tiny_models[arch], prompt, [24], attention_backend="torch", cuda_graphs=False)
    assert_same_greedy(fused, unfused)
    assert_same_greedy(fused, ref)


async def test_graph_replays_match_eager_as_the_batch_changes(tiny_models):
    """Six requests of different lengths finish at different steps: buckets with padding,
    picks fed back out of order (a finished request leaves a gap), one staged copy per step."""
    prompts = [list(range(3 + i, 20 + 7 * i)) for i in range(6)]
    max_new = [6 + 5 * i for i in range(6)]
    graphs = await greedy_runs(tiny_models["llama"], prompts, max_new, cuda_graphs=True)
    eager = await greedy_runs(tiny_models["llama"], prompts, max_new, cuda_graphs=False)
    assert_same_greedy(graphs, eager)


async def test_few_row_kernel_decode_matches_cublas_and_torch(tiny_models, monkeypatch):
    """Batched decode with every projection of 2..ROWS_MAX_M rows through ``rows_linear``
    (tiles forced for the tiny shapes, with and without split-K) against cuBLAS and the torch
    backend: six requests, so the batch shrinks through several buckets."""
    from radixd.core import triton_ops

    prompts = [list(range(3 + i, 20 + 7 * i)) for i in range(6)]
    max_new = [6 + 5 * i for i in range(6)]
    cublas = await greedy_runs(tiny_models["llama"], prompts, max_new, cuda_graphs=True, rows_kernel=False)
    ref = await greedy_runs(tiny_models["llama"], prompts, max_new, attention_backend="torch", cuda_graphs=False)
    assert_same_greedy(cublas, ref)
    calls = []
    real = triton_ops.rows_linear

    def counted(*args, **kw):
        calls.append(kw.get("silu", False))
        return real(*args, **kw)

    monkeypatch.setattr(triton_ops, "rows_linear", counted)
    for tiles in [(32, 64, 4, 2, 1), (16, 32, 4, 2, 2)]:
        monkeypatch.setattr(triton_ops, "rows_tiles", lambda m, n, k, tiles=tiles, **kw: tiles)
        calls.clear()
        rows = await greedy_runs(tiny_models["llama"], prompts, max_new, cuda_graphs=True, rows_kernel=True)
        assert calls and True in calls and False in calls  # the gate/up (SiLU) and the plain projections
        assert_same_greedy(rows, cublas)


def shared_prefix_case() -> tuple[list[list[int]], list[int]]:
    """Eleven requests: eight share a 300-token system prompt (one cascade item), three do
    not; finishing at different steps, so the batch shrinks through buckets."""
    system = [(7 * i) % 250 + 2 for i in range(300)]
    prompts = [system + list(range(3 + i, 10 + 2 * i)) for i in range(8)]
    prompts += [list(range(5 + i, 40 + 9 * i)) for i in range(3)]
    return prompts, [6 + 3 * i for i in range(11)]


async def greedy_runs_counting_cascade(path, prompts, max_new, **kw) -> tuple[list[tuple], list[bool]]:
    """``greedy_runs`` with CUDA graphs, and per graph replay whether it was a cascade graph."""
    from radixd.core.cuda_graph import DecodeGraphs

    replays = []
    real_run = DecodeGraphs.run

    def counted(self, batch, prev, stager):
        replays.append(batch.shared is not None and batch.batch_size in self.cascade_graphs)
        return real_run(self, batch, prev, stager)

    DecodeGraphs.run = counted
    try:
        return await greedy_runs(path, prompts, max_new, cuda_graphs=True, **kw), replays
    finally:
        DecodeGraphs.run = real_run


async def test_cascade_decode_matches_plain_decode_with_graphs_and_eager(tiny_models):
    """``shared_prefix_case``: cascade (graph replays and eager) gives the tokens and logprobs
    of decoding every request alone, and of the torch backend."""
    prompts, max_new = shared_prefix_case()
    cascade, replays = await greedy_runs_counting_cascade(tiny_models["llama"], prompts, max_new)
    assert any(replays) and not all(replays)  # cascade graphs replayed, and plain ones
    eager = await greedy_runs(tiny_models["llama"], prompts, max_new, cuda_graphs=False)
    plain = await greedy_runs(tiny_models["llama"], prompts, max_new, cuda_graphs=True, cascade_attention=False)
    ref = await greedy_runs(tiny_models["llama"], prompts, max_new, attention_backend="torch", cuda_graphs=False)
    assert_same_greedy(cascade, plain)
    assert_same_greedy(eager, plain)
    assert_same_greedy(cascade, ref)
