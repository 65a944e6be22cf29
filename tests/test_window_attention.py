"""Sliding-window and soft-capped attention: the Triton kernels (decode, extend) against a
float64 reference through the interpreter at tiny shapes (at real shapes on a GPU), and the
engine on the triton backend giving transformers' Gemma tokens."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch
from test_triton_kernels import DEV, GPU, REAL, SMALL, TOL, make_pool, rel_err

from radixd.core.attention.triton_kernels import decode_attention, extend_attention


def ref_attention(q, kb, vb, idx, q_pos, scale, window, softcap):
    """float64 attention over gathered K/V: query i sees keys in (q_pos[i] - window, q_pos[i]]
    (window 0: all up to q_pos[i]); scores soft-capped when ``softcap``."""
    group = q.shape[1] // kb.shape[1]
    k = kb[idx].double().repeat_interleave(group, 1).transpose(0, 1)  # [H, S, D]
    v = vb[idx].double().repeat_interleave(group, 1).transpose(0, 1)
    s = q.double().transpose(0, 1) @ k.transpose(1, 2) * scale        # [H, M, S]
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    kv = torch.arange(idx.numel(), device=q.device)[None, :]
    mask = (kv <= q_pos[:, None]) & ((kv > q_pos[:, None] - window) if window else True)
    return (s.masked_fill(~mask, float("-inf")).softmax(-1) @ v).transpose(0, 1)


CASES = [(5, 0.0), (0, 1.5), (16, 1.5)]  # (window, softcap)


@pytest.mark.parametrize("window,softcap", CASES)
@pytest.mark.parametrize("splits", [1, 4])
def test_decode_window_softcap_matches_reference(window, softcap, splits):
    heads, kv_heads, dim, seq_lens = (REAL if GPU else SMALL)[0]
    dtype = torch.bfloat16 if GPU else torch.float32
    kb, vb, table, rows = make_pool(sum(seq_lens) + 11, kv_heads, dim, dtype, seq_lens, seed=splits)
    q = torch.randn(len(seq_lens), heads, dim, device=DEV).to(dtype)
    out = torch.full_like(q, float("nan"))
    decode_attention(q, kb, vb, table, rows, torch.tensor(seq_lens, device=DEV), dim**-0.5, num_splits=splits,
                     out=out, window=window, softcap=softcap)
    assert not out.isnan().any()
    for b, n in enumerate(seq_lens):
        idx = table[rows[b], :n]
        ref = ref_attention(q[b][None], kb, vb, idx, torch.tensor([n - 1], device=DEV), dim**-0.5, window, softcap)
        assert rel_err(out[b], ref[0]) < TOL


@pytest.mark.parametrize("window,softcap", CASES)
@pytest.mark.parametrize("config", [None, (16, 16, 4, 2, True), (16, 16, 4, 2, True, 2)], ids=str)
def test_extend_window_softcap_matches_reference(window, softcap, config):
    heads, kv_heads, dim, seq_lens = (REAL if GPU else SMALL)[0]
    dtype = torch.bfloat16 if GPU else torch.float32
    kb, vb, table, rows = make_pool(sum(seq_lens) + 11, kv_heads, dim, dtype, seq_lens, seed=window)
    rng = random.Random(window)
    ext = [rng.randint(1, n) for n in seq_lens]
    prefix = [n - e for n, e in zip(seq_lens, ext, strict=True)]
    starts = [sum(ext[:i]) for i in range(len(ext))]
    q = torch.randn(sum(ext), heads, dim, device=DEV).to(dtype)
    out = torch.full_like(q, float("nan"))
    t = lambda xs: torch.tensor(xs, device=DEV)  # noqa: E731
    extend_attention(q, kb, vb, table, rows, t(prefix), t(ext), t(starts), max(ext), dim**-0.5, out=out,
                     config=config, window=window, softcap=softcap)
    assert not out.isnan().any()
    for i, (p, e) in enumerate(zip(prefix, ext, strict=True)):
        idx = table[rows[i], : p + e]
        ref = ref_attention(q[starts[i] : starts[i] + e], kb, vb, idx, torch.arange(p, p + e, device=DEV),
                            dim**-0.5, window, softcap)
        assert rel_err(out[starts[i] : starts[i] + e], ref) < TOL


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
async def test_engine_with_triton_backend_matches_transformers(tiny_dense_models, arch):
    """Windows of 8 across prefill chunks of 8 and into decode, on the triton backend."""
    from test_engine import assert_greedy_matches, collect, prompts

    from radixd import Engine

    path = tiny_dense_models[arch]
    eng = Engine(model=str(path), kv_cache_tokens=1024, attention_backend="triton", dtype="float32",
                 chunked_prefill_size=8)
    eng.step_hook = lambda step: eng.check_accounting()
    try:
        ps = prompts(2, 20, seed=12)
        outs = await asyncio.gather(*(collect(eng, p, 6) for p in ps))
        for p, got in zip(ps, outs, strict=True):
            assert_greedy_matches(path, p, got, 6)
    finally:
        await eng.stop()
