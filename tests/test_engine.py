"""Greedy tokens from radixd equal transformers' greedy tokens (fp32, CPU), under batching,
chunked prefill, cache hits and preemption; KV accounting holds after every step."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch
from conftest import hf_greedy

from radixd import Engine, SamplingParams
from radixd.core.errors import InvalidRequest

ARCHS = ["llama", "llama-tied", "llama3-rope", "mistral", "qwen2", "qwen3"]
TIE = 1e-4  # logits closer than this are a tie in fp32: either token is a correct greedy pick


def assert_greedy_matches(path, prompt, got: list[int], max_new: int):
    want, logits = hf_greedy(path, prompt, max_new)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        if a != b:
            gap = float(logits[i, b] - logits[i, a])
            assert gap < TIE, f"step {i}: radixd {a} vs transformers {b}, logit gap {gap}"
            return  # a genuine tie: the sequences may diverge from here on


def make_engine(path, **kw) -> Engine:
    kw.setdefault("kv_cache_tokens", 4096)
    eng = Engine(model=str(path), **kw)
    eng.step_hook = lambda step: eng.check_accounting()
    return eng


async def collect(eng: Engine, prompt, max_new: int, delay_steps: int = 0, **params) -> list[int]:
    params.setdefault("temperature", 0.0)
    params.setdefault("ignore_eos", True)
    toks: list[int] = []
    async for out in eng.generate(input_ids=prompt, params=SamplingParams(max_new_tokens=max_new, **params)):
        toks += out.token_ids
    return toks


def prompts(n: int, length: int, seed: int = 0, vocab: int = 256) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab) for _ in range(length + 3 * i)] for i in range(n)]


async def assert_idle(eng: Engine):
    acc = eng.scheduler.accounting()
    assert acc["private"] == 0 and acc["locked"] == 0
    assert acc["free"] + acc["evictable"] == acc["total"]
    eng.check_accounting()


async def tp1_and_tp2_tokens(path, ps: list[list[int]], max_new: int, check_shard=None) -> list[list[list[int]]]:
    """Greedy tokens of ``ps`` from an engine at tp 1, then one at tp 2 (each left idle);
    ``check_shard`` is called with the tp 2 engine's second shard's model."""
    runs = []
    for tp in (1, 2):
        eng = make_engine(path, tp_size=tp)
        try:
            runs.append(await asyncio.gather(*(collect(eng, p, max_new) for p in ps)))
            if tp == 2 and check_shard is not None:
                check_shard(eng.replicas[0].worker.shards[1].model)
            await assert_idle(eng)
        finally:
            await eng.stop()
    return runs


@pytest.mark.parametrize("arch", ARCHS)
async def test_greedy_matches_transformers(tiny_models, arch):
    await check_greedy_matches_transformers(tiny_models[arch])


async def check_greedy_matches_transformers(path):
    """Three prompts in one batch: transformers' greedy tokens (shared by the families' tests)."""
    eng = make_engine(path)
    try:
        ps = prompts(3, 20, seed=1)
        outs = await asyncio.gather(*(collect(eng, p, 16) for p in ps))
        for p, got in zip(ps, outs, strict=True):
            assert_greedy_matches(path, p, got, 16)
        await assert_idle(eng)
    finally:
        await eng.stop()


async def arrive_mid_flight(eng: Engine, ps: list[list[int]], max_new: list[int]) -> list[list[int]]:
    """Each prompt's greedy tokens, submitted a few engine steps after the one before it
    (so each arrives while the earlier ones decode); accounting checked after every step."""
    steps = 0

    def hook(step):
        nonlocal steps
        steps += 1
        eng.check_accounting()

    eng.step_hook = hook
    tasks = [asyncio.ensure_future(collect(eng, ps[0], max_new[0]))]
    for p, n in zip(ps[1:], max_new[1:], strict=True):
        start = steps
        while steps < start + 3:  # let a few steps run before the next arrival
            await asyncio.sleep(0.001)
        tasks.append(asyncio.ensure_future(collect(eng, p, n)))
    return await asyncio.gather(*tasks)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
async def test_mid_flight_arrivals_and_small_chunks(tiny_models, arch):
    await check_mid_flight_small_chunks(tiny_models[arch], [24, 12, 12, 12], min_steps=20)


async def check_mid_flight_small_chunks(path, max_new: list[int], min_steps: int):
    """Requests join while others decode; prompts are prefilled 5 tokens at a time."""
    eng = make_engine(path, chunked_prefill_size=5, max_prefill_tokens=8)
    try:
        ps = prompts(len(max_new), 23, seed=2)
        outs = await arrive_mid_flight(eng, ps, max_new)
        for p, got, n in zip(ps, outs, max_new, strict=True):
            assert_greedy_matches(path, p, got, n)
        assert eng.scheduler.stats.steps > min_steps
        await assert_idle(eng)
    finally:
        await eng.stop()


async def test_prefix_served_from_cache(tiny_models):
    await check_prefix_served_from_cache(tiny_models["llama"])


async def check_prefix_served_from_cache(path):
    """A prompt extending an earlier request's prompt and output: all but its last 2 tokens
    come from the cache, and the tokens are still exact."""
    eng = make_engine(path)
    try:
        base = prompts(1, 40, seed=3)[0]
        first = await collect(eng, base, 4)
        longer = base + first + [7]
        got = []
        cached = None
        async for out in eng.generate(input_ids=longer, params=SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True)):
            got += out.token_ids
            cached = out.cached_tokens
        assert cached == 40 + 3  # the first prompt and 3 of its 4 generated tokens have KV
        assert eng.scheduler.stats.prefill_tokens == 40 + 2  # 45 - 43 cached
        assert_greedy_matches(path, longer, got, 10)
        st = eng.stats()
        assert st["cache_hit_tokens"] == 43 and st["cache_queried_tokens"] == 40 + 45
        await assert_idle(eng)
    finally:
        await eng.stop()


@pytest.mark.parametrize("queued", [40, 200])  # below and past the lpm ranking limit (128)
async def test_lpm_prefills_a_burst_of_shared_prefixes_once(tiny_models, queued):
    """A burst of requests in 4 prefix groups: one request per group computes the prefix,
    the others wait a step and read it from the cache (whether lpm ranks the queue or, past
    its limit, keeps arrival order)."""
    from radixd.plugins import policies

    assert 40 <= policies.LPM_MAX_QUEUE < 200
    eng = make_engine(tiny_models["llama"], kv_cache_tokens=40_000, max_running_requests=256, policy="lpm",
                      max_prefill_tokens=4096, chunked_prefill_size=4096)
    try:
        groups = prompts(4, 96, seed=9)
        groups = [g[:96] for g in groups]
        burst = [groups[i % 4] + [2 + i % 250, 3, 4, 5] for i in range(queued)]
        await asyncio.gather(*(collect(eng, p, 1) for p in burst))
        st = eng.stats()
        assert st["cache_queried_tokens"] == queued * 100
        assert st["cache_hit_tokens"] == (queued - 4) * 96
        await assert_idle(eng)
    finally:
        await eng.stop()


async def test_radix_cache_off_computes_every_prompt(tiny_models):
    path = tiny_models["llama"]
    eng = make_engine(path, radix_cache=False)
    try:
        p = prompts(1, 30, seed=4)[0]
        a = await collect(eng, p, 6)
        b = await collect(eng, p, 6)
        assert a == b
        assert eng.stats()["cache_hit_tokens"] == 0
        assert eng.scheduler.stats.prefill_tokens == 60
        assert eng.cache.total_size == 0  # nothing kept once requests end
        await assert_idle(eng)
    finally:
        await eng.stop()


@pytest.mark.parametrize("radix", [True, False])
async def test_preemption_keeps_tokens(tiny_models, radix):
    await check_preemption_keeps_tokens(tiny_models["qwen2"], radix)


async def check_preemption_keeps_tokens(path, radix: bool):
    """A pool too small for the batch forces preemption; outputs are still exact."""
    eng = make_engine(path, kv_cache_tokens=150, schedule_conservativeness=0.0, radix_cache=radix)
    try:
        ps = prompts(4, 30, seed=5)
        outs = await asyncio.gather(*(collect(eng, p, 30) for p in ps))
        assert eng.scheduler.stats.preemptions > 0
        for p, got in zip(ps, outs, strict=True):
            assert_greedy_matches(path, p, got, 30)
        await assert_idle(eng)
    finally:
        await eng.stop()


async def test_n_samples_share_one_prefill(tiny_models):
    path = tiny_models["llama"]
    for radix in (True, False):
        eng = make_engine(path, radix_cache=radix)
        try:
            p = prompts(1, 50, seed=6)[0]
            outs: dict[int, list[int]] = {}
            async for out in eng.generate(input_ids=p, params=SamplingParams(max_new_tokens=5, temperature=0, ignore_eos=True, n=4)):
                outs.setdefault(out.index, []).extend(out.token_ids)
            assert sorted(outs) == [0, 1, 2, 3]
            assert len({tuple(v) for v in outs.values()}) == 1  # greedy: all the same
            # the prompt was computed once; each follower ran only its last prompt token
            assert eng.scheduler.stats.prefill_tokens == 50
            await assert_idle(eng)
        finally:
            await eng.stop()


async def test_abort_returns_kv(tiny_models):
    path = tiny_models["llama"]
    eng = make_engine(path, radix_cache=False)
    try:
        p = prompts(1, 30, seed=7)[0]
        seen = 0
        agen = eng.generate(input_ids=p, params=SamplingParams(max_new_tokens=200, temperature=0, ignore_eos=True), rid="r1")
        async for out in agen:
            seen += len(out.token_ids)
            if seen == 5:
                assert eng.scheduler.accounting()["private"] > 0
                break
        await agen.aclose()
        for _ in range(100):
            if not eng.scheduler.running:
                break
            await asyncio.sleep(0.01)
        assert not eng.scheduler.running and not eng.scheduler.waiting
        assert eng.scheduler.accounting()["free"] == eng.allocator.total
        await assert_idle(eng)
        # and the engine still serves
        assert len(await collect(eng, p, 3)) == 3
    finally:
        await eng.stop()


async def test_explicit_abort_by_id(tiny_models):
    path = tiny_models["llama"]
    eng = make_engine(path)
    try:
        p = prompts(1, 10, seed=8)[0]
        reasons = []

        async def consume():
            async for out in eng.generate(input_ids=p, params=SamplingParams(max_new_tokens=300, temperature=0, ignore_eos=True), rid="x"):
                if out.finished:
                    reasons.append(out.finish_reason)

        task = asyncio.ensure_future(consume())
        while eng.scheduler.stats.decode_tokens < 3:
            await asyncio.sleep(0.005)
        assert await eng.abort("x")
        await asyncio.wait_for(task, 5)
        assert reasons == ["abort"]
        assert not await eng.abort("x")
        await assert_idle(eng)
    finally:
        await eng.stop()


def test_tokens_per_step_budget_respected(tiny_models):
    """The scheduler never runs more prefill tokens in one step than configured."""
    path = tiny_models["llama"]
    eng = make_engine(path, max_prefill_tokens=16, chunked_prefill_size=16)
    sizes = []

    def hook(step):
        eng.check_accounting()
        sizes.append(sum(n for n in step.batch.extend_lens if n > 1))

    eng.step_hook = hook

    async def main():
        try:
            await asyncio.gather(*(collect(eng, p, 3) for p in prompts(4, 40, seed=9)))
        finally:
            await eng.stop()

    asyncio.run(main())
    assert max(sizes) <= 16 and sum(sizes) > 0


def test_hf_logits_close(tiny_models):
    """The forward pass itself: radixd's last-token logits match transformers' closely."""
    from conftest import _hf_model

    from radixd.core.forward_batch import ForwardBatch

    path = tiny_models["qwen3"]
    eng = make_engine(path)
    p = prompts(1, 17, seed=10)[0]
    slots = eng.allocator.alloc(len(p))
    batch = ForwardBatch(
        input_ids=torch.tensor(p), positions=torch.arange(len(p)), out_cache_loc=slots,
        rows=[0], prefix_lens=[0], extend_lens=[len(p)], table_writes=[(0, 0, slots)], sample_indices=[0],
    )
    ours = eng.worker.forward(batch)[0]
    with torch.no_grad():
        ref = _hf_model(path)(torch.tensor([p])).logits[0, -1]
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)
    eng.allocator.free(slots)


async def test_sharded_checkpoint_loads(tmp_path):
    """A checkpoint split over several safetensors files (with an index) loads whole."""
    from conftest import make_tiny_checkpoint

    path = make_tiny_checkpoint(tmp_path / "sharded", "llama", seed=3, max_shard_size="60KB")
    assert (path / "model.safetensors.index.json").exists()
    assert len(list(path.glob("*.safetensors"))) > 2
    eng = make_engine(path)
    try:
        p = prompts(1, 12, seed=11)[0]
        assert_greedy_matches(path, p, await collect(eng, p, 8), 8)
    finally:
        await eng.stop()


def test_missing_tensor_is_an_error(tmp_path):
    from conftest import make_tiny_checkpoint
    from safetensors.torch import load_file, save_file

    path = make_tiny_checkpoint(tmp_path / "broken", "llama", seed=4)
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(KeyError, match="lacks 1 tensors"):
        Engine(model=str(path), kv_cache_tokens=64)


async def test_overlap_schedule_launches_ahead_and_matches_sync(tiny_models):
    """With overlap on, decode inputs come from the previous step's picks on the device
    (placeholders); outputs equal the synchronous schedule's, preemption and stops included."""
    path = tiny_models["llama"]
    results = {}
    for overlap in (True, False):
        eng = make_engine(path, overlap_schedule=overlap, kv_cache_tokens=150, schedule_conservativeness=0.0)
        placeholders = 0

        def hook(step, eng=eng):
            nonlocal placeholders
            placeholders += len(step.batch.placeholder_pos)
            eng.check_accounting()

        eng.step_hook = hook
        try:
            ps = prompts(4, 30, seed=5)
            outs = await asyncio.gather(*(collect(eng, p, 30 - 3 * i) for i, p in enumerate(ps)))
            results[overlap] = outs
            assert eng.scheduler.stats.preemptions > 0
            assert (placeholders > 0) == overlap
            assert [len(o) for o in outs] == [30, 27, 24, 21]  # no extra token from a launched-ahead step
            await assert_idle(eng)
        finally:
            await eng.stop()
    assert results[True] == results[False]


@pytest.mark.parametrize("ids", [[5, -1], [5, "VOCAB"], [True, 5], [5, 1.0], [5, "6"], [5, None]])
def test_bad_token_ids_rejected(tiny_models, ids):
    eng = make_engine(tiny_models["llama"])
    vocab = eng.model_cfg.vocab_size
    ids = [vocab if t == "VOCAB" else t for t in ids]
    with pytest.raises(InvalidRequest, match=rf"input_ids.*\[0, {vocab}\)"):
        eng.validate(None, ids, SamplingParams(max_new_tokens=2))
    assert eng.validate(None, [0, vocab - 1], SamplingParams(max_new_tokens=2)) == [0, vocab - 1]
    assert eng.validate(None, (3, 4), SamplingParams(max_new_tokens=2)) == [3, 4]
