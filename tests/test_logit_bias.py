"""``logit_bias`` (OpenAI's, vLLM's): in the sampler, greedy and drawn, and batched in the
engine beside requests without one (on CPU; on CUDA with and without decode graphs). The HTTP
side is in ``test_vllm_extras.py``."""

from __future__ import annotations

import pytest
import torch

from radixd.core.errors import InvalidRequest
from radixd.core.forward_batch import SamplingBatch
from radixd.core.sampler import sample
from radixd.core.sampling_params import SamplingParams


def test_logit_bias_in_the_sampler():
    torch.manual_seed(0)
    logits = torch.randn(3, 32)
    greedy = logits.argmax(-1)

    def batch(temps):
        t = torch.tensor(temps)
        return SamplingBatch(temperature=t, top_p=torch.ones(3), top_k=torch.zeros(3, dtype=torch.int64),
                             min_p=torch.zeros(3), seeds=torch.arange(3), steps=torch.zeros(3, dtype=torch.int64),
                             all_greedy=all(x == 0 for x in temps))

    for temps in ([0.0, 0.0, 0.0], [0.0, 1.0, 0.0]):
        sb = batch(temps)
        # row 0: +100 on token 3; row 1 (greedy or drawn): -100 on its argmax and +100 on 7; row 2: none
        sb.bias_rows = torch.tensor([0, 1, 1])
        sb.bias_tokens = torch.tensor([3, int(greedy[1]), 7])
        sb.bias_values = torch.tensor([100.0, -100.0, 100.0])
        picks = sample(logits.clone(), sb).next_tokens
        assert picks[0] == 3 and picks[1] == 7 and picks[2] == int(greedy[2])
    with pytest.raises(InvalidRequest, match="logit_bias"):
        SamplingParams(logit_bias={1: 100.5})
    with pytest.raises(InvalidRequest, match="logit_bias"):
        SamplingParams(logit_bias={-1: 1.0})


ENGINE_CASES = [pytest.param("cpu", False, id="cpu"),
                *[pytest.param("cuda", graphs, id=f"cuda-graphs-{'on' if graphs else 'off'}",
                               marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                          reason="needs a CUDA device")])
                  for graphs in (False, True)]]


@pytest.mark.parametrize(("device", "graphs"), ENGINE_CASES)
async def test_logit_bias_batched_in_the_engine(tiny_models, device, graphs):
    """Requests with and without a bias decode in the same batches; each gets its own."""
    import asyncio

    from radixd import Engine

    eng = Engine(model=str(tiny_models["llama"]), device=device, dtype="float32", kv_cache_tokens=4096, cuda_graphs=graphs)

    async def tokens(prompt, **kw):
        params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True, **kw)
        return [t for out in [o async for o in eng.generate(input_ids=prompt, params=params)] for t in out.token_ids]

    try:
        prompts = [[5, 17, 42, 9], [3, 4, 5], [60, 61]]
        solo = [await tokens(p) for p in prompts]
        target = next(t for t in range(2, 250) if t not in solo[0])
        got = await asyncio.gather(tokens(prompts[0], logit_bias={target: 100.0}), tokens(prompts[1]),
                                   tokens(prompts[2], logit_bias={solo[2][0]: -100.0}))
        assert got[0] == [target] * 6 and got[1] == solo[1] and got[2][0] != solo[2][0]
        with pytest.raises(InvalidRequest, match="logit_bias"):
            await tokens(prompts[0], logit_bias={10_000: 1.0})
    finally:
        await eng.stop()
