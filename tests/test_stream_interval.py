"""``stream_interval``: outputs coalesced N tokens at a time, same tokens and text."""

from __future__ import annotations

import asyncio

import pytest
from test_engine import assert_idle, make_engine

from radixd import SamplingParams
from radixd.core.errors import ConfigError


async def updates(eng, prompt: str, n: int, **kw):
    outs = []
    async for out in eng.generate(prompt, params=SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True, **kw)):
        outs.append(out)
    return outs


async def test_coalesced_updates_carry_the_same_tokens(tiny_models):
    path = tiny_models["llama"]
    one, four = make_engine(path), make_engine(path, stream_interval=4)
    try:
        prompts = ["hello there", "a much longer prompt about nothing in particular"]
        for p in prompts:
            a, b = await asyncio.gather(updates(one, p, 10, logprobs=True), updates(four, p, 10, logprobs=True))
            assert len(a) == 10 and [len(o.token_ids) for o in b] == [4, 4, 2]
            assert [t for o in a for t in o.token_ids] == [t for o in b for t in o.token_ids]
            assert "".join(o.text for o in a) == "".join(o.text for o in b)
            assert [x.token_id for o in b for x in o.logprobs] == [t for o in b for t in o.token_ids]
            assert b[-1].finished and not any(o.finished for o in b[:-1])
            assert b[-1].completion_tokens == 10
        # a request that ends early (a stop string) still gets its last tokens
        b = await updates(four, prompts[0], 12, stop=[" "])
        assert b[-1].finished and sum(len(o.token_ids) for o in b) <= 12
        await assert_idle(four)
    finally:
        await one.stop()
        await four.stop()


def test_stream_interval_checked():
    from radixd.core.config import EngineConfig

    with pytest.raises(ConfigError, match="stream_interval"):
        EngineConfig(model="x", stream_interval=0)
