"""Prompt-token logprobs (``prompt_logprobs_from``) equal transformers' log-softmax over the
same sequence (fp32, CPU), whether the prefix was cached, the prompt chunked, or batched."""

from __future__ import annotations

import asyncio

import pytest
import torch
from conftest import _hf_model
from test_engine import assert_idle, make_engine, prompts

from radixd import SamplingParams
from radixd.core.errors import InvalidRequest


def hf_prompt_logprobs(path, ids: list[int]) -> list[float]:
    with torch.no_grad():
        logits = _hf_model(path)(torch.tensor([ids])).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    return [float(lp[q - 1, ids[q]]) for q in range(1, len(ids))]  # logprob of ids[q], q >= 1


async def prompt_lp(eng, ids, start, **kw):
    params = SamplingParams(max_new_tokens=1, temperature=0.0, prompt_logprobs_from=start, **kw)
    got, cached = None, None
    async for out in eng.generate(input_ids=ids, params=params):
        if out.prompt_logprobs is not None:
            assert got is None, "prompt logprobs come once"
            got = out.prompt_logprobs
        cached = out.cached_tokens
    return got, cached


@pytest.mark.parametrize("chunk", [512, 4])
async def test_prompt_logprobs_match_transformers(tiny_models, chunk):
    path = tiny_models["llama"]
    eng = make_engine(path, chunked_prefill_size=chunk, max_prefill_tokens=max(chunk, 8))
    try:
        base = prompts(1, 30, seed=5)[0]
        want = hf_prompt_logprobs(path, base)
        # cold, from position 0 (position 0 has no logprob)
        got, _ = await prompt_lp(eng, base, 0)
        assert len(got) == len(base) - 1
        assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-4
        # the prefix is cached now: only what is needed is recomputed, from position 20 on
        got, cached = await prompt_lp(eng, base, 20)
        assert len(got) == len(base) - 20
        assert max(abs(a - b) for a, b in zip(got, want[19:], strict=True)) < 1e-4
        assert cached == 19  # the token before position 20 is recomputed for its logits
        # several choices after a shared prefix, in one batch
        choices = [base[:24] + c for c in ([7, 8, 9], [10], [11, 12, 13, 14])]
        outs = await asyncio.gather(*(prompt_lp(eng, c, 24) for c in choices))
        for c, (got, _) in zip(choices, outs, strict=True):
            want_c = hf_prompt_logprobs(path, c)
            assert len(got) == len(c) - 24
            assert max(abs(a - b) for a, b in zip(got, want_c[23:], strict=True)) < 1e-4
        # with alternatives and ranks (over chunks when chunk is small), as transformers ranks them
        params = SamplingParams(max_new_tokens=1, temperature=0.0, prompt_logprobs_from=10, prompt_top_logprobs=3)
        outs = [o async for o in eng.generate(input_ids=base, params=params)]
        part = next(o for o in outs if o.prompt_logprobs is not None)
        with torch.no_grad():
            every = torch.log_softmax(_hf_model(path)(torch.tensor([base])).logits[0].float(), -1)
        assert len(part.prompt_top) == len(part.prompt_ranks) == len(base) - 10
        for q, row, rank in zip(range(10, len(base)), part.prompt_top, part.prompt_ranks, strict=True):
            want = every[q - 1]
            assert [t for t, _ in row] == want.topk(3).indices.tolist()
            assert rank == int((want > want[base[q]]).sum()) + 1
        # beyond the prompt: nothing to compute, an empty list
        got, _ = await prompt_lp(eng, base, len(base))
        assert got == []
        await assert_idle(eng)
    finally:
        await eng.stop()


def test_prompt_logprobs_params_checked():
    with pytest.raises(InvalidRequest, match="prompt_logprobs_from"):
        SamplingParams(prompt_logprobs_from=-1)
    with pytest.raises(InvalidRequest, match="max_new_tokens"):
        SamplingParams(prompt_logprobs_from=0, max_new_tokens=0)
    with pytest.raises(InvalidRequest, match="prompt_top_logprobs"):
        SamplingParams(prompt_top_logprobs=2)  # alternatives of no positions
    with pytest.raises(InvalidRequest, match="prompt_top_logprobs"):
        SamplingParams(prompt_logprobs_from=0, prompt_top_logprobs=-1)
