"""Steps that decode and prefill together, replayed through ``cuda_graph.MixedGraphs``.

On a CPU nothing is captured: a replay runs the forward the graph would hold over the same
static buffers, eagerly (the triton backend through the interpreter). That checks what a
replay computes — the staged rows, the dummy decode rows the extend kernel overwrites, the
padding, the sampled rows' logits — against transformers; the capture itself is the GPU
test's (``-m gpu``)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from test_engine import (
    arrive_mid_flight,
    assert_greedy_matches,
    assert_idle,
    collect,
    make_engine,
    prompts,
)

from radixd.core.assembly import MIXED_GRAPH_TOKENS_MAX
from radixd.core.cuda_graph import MIXED_EXTENDS, MixedGraphs, mixed_buckets
from radixd.core.errors import ConfigError
from radixd.core.forward_batch import ForwardBatch

GPU = torch.cuda.is_available()


def replayed(eng, extra_tokens: int, *, capture: bool = False) -> list[tuple[int, int]]:
    """Give the engine's worker mixed graphs for up to ``max_rows + extra_tokens`` tokens;
    returns the list each replay appends (tokens, bucket) to."""
    w = eng.worker
    w.mixed_graphs = MixedGraphs(w.model, w.attn, w.pool, max_rows=w.max_rows, max_tokens=w.max_rows + extra_tokens,
                                 capture=capture)
    seen: list[tuple[int, int]] = []
    run = w.mixed_graphs.run

    def counting(batch, prev, stager):
        g = w.mixed_graphs
        seen.append((batch.num_tokens, min(b for b in g.buckets if b >= batch.num_tokens)))
        return run(batch, prev, stager)

    w.mixed_graphs.run = counting
    return seen


@pytest.mark.parametrize("models,arch", [("tiny_models", "llama"), ("tiny_models", "qwen3"),
                                         ("tiny_dense_models", "gemma2")])
async def test_mixed_steps_through_the_graphs_forward_match_transformers(request, models, arch):
    """Requests arrive while others decode, prompts prefilled 5 tokens a step: the steps with
    decodes and chunks (padded to their buckets) give transformers' greedy tokens. (Gemma 2:
    sliding-window layers of 8 keys beside global ones, and soft-capped scores.)"""
    if GPU:
        pytest.skip("the CPU oracle (fp32 greedy equality); the GPU test captures the graphs")
    path = request.getfixturevalue(models)[arch]
    eng = make_engine(path, attention_backend="triton", chunked_prefill_size=5, max_prefill_tokens=8,
                      max_running_requests=8)
    # the split-KV partials the decode graphs would have captured (their largest bucket's):
    # the mixed graphs' larger buckets must not regrow (so move) them
    captured = eng.worker.attn._scratch(eng.worker.max_rows)
    seen = replayed(eng, 8)
    max_new = [8, 4, 4, 4]
    try:
        ps = prompts(len(max_new), 14, seed=2)
        outs = await arrive_mid_flight(eng, ps, max_new)
        for p, got, n in zip(ps, outs, max_new, strict=True):
            assert_greedy_matches(path, p, got, n)
        await assert_idle(eng)
    finally:
        await eng.stop()
    mid_o, _ = eng.worker.attn._scratch(eng.worker.max_rows)
    assert mid_o.data_ptr() == captured[0].data_ptr() and max(eng.worker.attn._mid) == eng.worker.max_rows
    assert len(seen) >= 6  # (the later prompts' chunks beside the earlier requests' decodes)
    assert any(bucket > tokens for tokens, bucket in seen)  # some padded
    assert any(tokens > 5 for tokens, _ in seen)  # some with decodes beside a chunk


async def test_a_one_token_request_past_the_decode_rows_takes_the_extend_kernel(tiny_models):
    """A replayed mixed step runs the decode kernel over its first ``max_rows`` rows only: a
    prompt whose whole prefix is cached (one new token) admitted behind another prompt's
    chunk lands past them and is attended as an extend of one token; the tokens stay
    transformers'."""
    from radixd.core.cuda_graph import ones_beyond

    if GPU:
        pytest.skip("the CPU oracle (fp32 greedy equality)")
    path = tiny_models["llama"]
    eng = make_engine(path, attention_backend="triton", chunked_prefill_size=6, max_prefill_tokens=8,
                      max_running_requests=3)
    replayed(eng, 8)
    g = eng.worker.mixed_graphs
    run, past, steps = g.run, [], [0]

    def counting(batch, prev, stager):
        bs = min(b for b in g.buckets if b >= batch.num_tokens)
        past.append(ones_beyond(batch.extend_lens, g.decode_rows[bs]))
        return run(batch, prev, stager)

    def hook(step):
        steps[0] += 1
        eng.check_accounting()

    async def until(n):
        while steps[0] < n:
            await asyncio.sleep(0.001)

    g.run = counting
    try:
        long, again = prompts(2, 40, seed=5)
        first = await collect(eng, again, 3)  # (now cached: a later copy extends one token)
        eng.step_hook = hook
        decoding = asyncio.ensure_future(collect(eng, long[:5], 16))
        await until(2)
        chunked = asyncio.ensure_future(collect(eng, long, 4))  # (prefilled 6 tokens a step)
        await until(3)
        hits = [asyncio.ensure_future(collect(eng, again, 3)) for _ in range(2)]
        outs = await asyncio.gather(decoding, chunked, *hits)
        assert_greedy_matches(path, long[:5], outs[0], 16)
        assert_greedy_matches(path, long, outs[1], 4)
        assert outs[2] == outs[3] == first
        await assert_idle(eng)
    finally:
        await eng.stop()
    assert max(past) > 0  # (a replayed step carried a one-token request past its decode rows)


async def test_a_step_beyond_the_graphs_runs_eagerly(tiny_models):
    """Prompts of several chunks at once: steps with more extends than a replay carries, or
    more tokens than its largest bucket, run eagerly; the tokens stay transformers'."""
    if GPU:
        pytest.skip("the CPU oracle (fp32 greedy equality)")
    path = tiny_models["llama"]
    eng = make_engine(path, attention_backend="triton", chunked_prefill_size=16, max_prefill_tokens=64,
                      max_running_requests=12)
    seen = replayed(eng, 4)  # (buckets up to 16 tokens)
    mixed = []  # (tokens, extends) of every step with an extend of 2+ tokens

    def hook(step):
        eng.check_accounting()
        lens = step.batch.extend_lens
        if any(e > 1 for e in lens):
            mixed.append((step.batch.num_tokens, sum(e > 1 for e in lens)))

    eng.step_hook = hook
    ps = prompts(MIXED_EXTENDS + 2, 6, seed=4)
    try:
        outs = await asyncio.gather(*(collect(eng, p, 6) for p in ps))
        for p, got in zip(ps, outs, strict=True):
            assert_greedy_matches(path, p, got, 6)
        await assert_idle(eng)
    finally:
        await eng.stop()
    eager = [m for m in mixed if m[0] > 16 or m[1] > MIXED_EXTENDS]
    assert eager and len(seen) == len(mixed) - len(eager)


def test_which_steps_a_replay_takes():
    """``can_run``: at least one extend of 2+ tokens and at most ``MIXED_EXTENDS``, the
    tokens within the largest bucket, nothing a replay does not compute."""
    from radixd.core.forward_batch import TokenTrees

    class Attn:
        def decode_scratch(self, rows):
            return None

    class Pool:
        device = torch.device("cpu")

    g = MixedGraphs(None, Attn(), Pool(), max_rows=8, max_tokens=40, capture=False)
    assert g.buckets == mixed_buckets(40) == [4, 8, 16, 32, 40]

    def batch(lens: list[int], sampled: int | None = None, **kw) -> ForwardBatch:
        t = sum(lens)
        z = torch.zeros(t, dtype=torch.int64)
        n = len(lens) if sampled is None else sampled
        return ForwardBatch(input_ids=z, positions=z, out_cache_loc=z, rows=list(range(len(lens))),
                            prefix_lens=[0] * len(lens), extend_lens=lens, sample_indices=list(range(n)), **kw)

    assert g.can_run(batch([1, 1, 1, 5]))
    assert g.can_run(batch([1] * 7 + [33]))  # exactly the largest bucket
    assert not g.can_run(batch([1] * 7 + [34]))  # one token more
    assert not g.can_run(batch([1] * 8 + [2]))  # more sampled rows than max_rows
    assert not g.can_run(batch([1, 1, 1]))  # decodes only: the decode graphs'
    assert g.can_run(batch([2] * MIXED_EXTENDS))
    assert not g.can_run(batch([2] * (MIXED_EXTENDS + 1)))
    assert not g.can_run(batch([1, 4], prompt_lp_pos=[2], prompt_lp_target=[3]))
    assert not g.can_run(batch([1, 4], pool_rows=1, pool_pos=[1], pool_row=[0]))
    assert not g.can_run(batch([1, 4], trees=TokenTrees(first=[1], sizes=[4], masks=[torch.ones(4, 4, dtype=torch.bool)])))


@pytest.mark.parametrize("kw", [dict(tp_size=2), dict(cuda_graphs=False), dict(mixed_cuda_graphs=False)])
async def test_mixed_graph_tokens_refused_where_no_mixed_graph_is_captured(tiny_models, kw):
    from radixd import Engine

    if kw.get("tp_size", 1) > torch.cuda.device_count() > 0:  # (a GPU machine refuses tp=2 on one GPU first)
        pytest.skip("tp_size=2 needs two GPUs on a GPU machine")
    with pytest.raises(ConfigError, match="mixed_graph_tokens"):
        Engine(model=str(tiny_models["llama"]), mixed_graph_tokens=64, kv_cache_tokens=256, **kw)
    eng = Engine(model=str(tiny_models["llama"]), mixed_graph_tokens=0, kv_cache_tokens=256, **kw)  # (asks for nothing)
    await eng.stop()


@pytest.mark.parametrize(("where", "kw", "settled"), [
    (("cuda", "triton"), {}, (512, 512)),  # the GPU's default: a budget its graphs cover
    (("cuda", "triton"), dict(mixed_prefill_tokens=3000), (3000, MIXED_GRAPH_TOKENS_MAX)),
    (("cuda", "triton"), dict(mixed_prefill_tokens=9000), (4096, MIXED_GRAPH_TOKENS_MAX)),
    (("cuda", "triton"), dict(mixed_graph_tokens=64), (512, 64)),
    (("cuda", "triton"), dict(max_prefill_tokens=300), (300, 300)),
    (("cuda", "triton"), dict(mixed_cuda_graphs=False), (4096, 0)),  # eager steps: no budget of their own
    (("cuda", "triton"), dict(cuda_graphs=False), (4096, 0)),
    (("cuda", "triton"), dict(tp_size=2), (4096, 0)),
    (("cuda", "torch"), {}, (4096, 0)),
    (("cpu", "triton"), {}, (4096, 0)),
    (("cpu", "triton"), dict(mixed_prefill_tokens=64), (64, 0)),
])
def test_mixed_steps_settle_budget_and_graphs(where, kw, settled):
    """``assembly.mixed_steps``: 0 asks for the default of where the engine runs; explicit
    values stay (the budget at most ``max_prefill_tokens``)."""
    from types import SimpleNamespace

    from radixd.core.assembly import mixed_steps
    from radixd.core.config import EngineConfig

    setup = SimpleNamespace(device=torch.device(where[0]), attention_backend=where[1], pooling=None)
    c = mixed_steps(EngineConfig(**kw), setup)
    assert (c.mixed_prefill_tokens, c.mixed_graph_tokens) == settled
    if "mixed_graph_tokens" in kw:  # (asked for: refused with an EAGLE-3 drafter)
        with pytest.raises(ConfigError, match="mixed_graph_tokens"):
            mixed_steps(EngineConfig(**kw), setup, aux_layers=(1, 2))
    else:
        assert mixed_steps(EngineConfig(**kw), setup, aux_layers=(1, 2)).mixed_graph_tokens == 0


def test_a_failed_mixed_capture_takes_back_the_default_budget():
    """``assembly.mixed_uncaptured``: a replica whose mixed graphs were wanted but not captured
    gets no prompt budget of its own where ``mixed_steps`` chose it; one asked for stays."""
    from types import SimpleNamespace

    from radixd.core.assembly import mixed_steps, mixed_uncaptured
    from radixd.core.config import EngineConfig

    setup = SimpleNamespace(device=torch.device("cuda"), attention_backend="triton", pooling=None)
    failed = SimpleNamespace(graphs_wanted=True, mixed_graphs=None)
    captured = SimpleNamespace(graphs_wanted=True, mixed_graphs=object())
    asked = EngineConfig()
    settled = mixed_steps(asked, setup)
    assert mixed_uncaptured(asked, settled, captured).mixed_prefill_tokens == 512
    assert mixed_uncaptured(asked, settled, failed).mixed_prefill_tokens == 4096
    asked = EngineConfig(mixed_prefill_tokens=256)
    assert mixed_uncaptured(asked, mixed_steps(asked, setup), failed).mixed_prefill_tokens == 256


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA device")
async def test_captured_mixed_steps_match_eager(tiny_models):
    """On CUDA with the engine's own capture (``mixed_graph_tokens``): requests arriving
    mid-flight in small chunks give the eager engine's greedy tokens and logprobs."""
    from radixd import SamplingParams

    path = tiny_models["llama"]
    ps = prompts(4, 23, seed=2)
    max_new = [24, 12, 12, 12]

    async def run(**kw):
        eng = make_engine(path, device="cuda", dtype="float16", chunked_prefill_size=5, max_prefill_tokens=8,
                          max_running_requests=8, **kw)
        graphs = eng.worker.mixed_graphs
        replays = []
        if graphs is not None:
            plain = graphs.run
            graphs.run = lambda b, p, s: replays.append(b.num_tokens) or plain(b, p, s)

        async def one(p, n):
            toks, lps = [], []
            params = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True, logprobs=True)
            async for out in eng.generate(input_ids=p, params=params):
                toks += out.token_ids
                lps += [lp.logprob for lp in out.logprobs or []]
            return toks, lps

        try:
            tasks = []
            for p, n in zip(ps, max_new, strict=True):
                tasks.append(asyncio.ensure_future(one(p, n)))
                await asyncio.sleep(0.02)
            return await asyncio.gather(*tasks), graphs is not None, replays
        finally:
            await eng.stop()

    graphed, captured, replays = await run(mixed_graph_tokens=16)
    eager, captured_off, _ = await run(mixed_cuda_graphs=False)
    assert not captured_off
    assert captured and replays
    for (t1, lp1), (t2, lp2) in zip(graphed, eager, strict=True):
        assert t1 == t2
        assert max(abs(x - y) for x, y in zip(lp1, lp2, strict=True)) < 2e-2


@pytest.mark.parametrize(("lens", "decode_rows"), [([1, 1, 5, 3], 13), ([1, 5, 1, 3, 1], 13), ([4, 2], 9),
                                                   ([1, 1, 1, 5, 3], 2), ([1, 5, 1, 3, 1], 6), ([2, 1, 1], 3)])
def test_a_steps_staged_block(lens, decode_rows):
    """A replay's block: one-token requests at their rows and lengths (leading the step, as
    the scheduler orders it, or anywhere) within the first ``decode_rows`` rows, every other
    row a dummy (row 0, length 1); each chunk's (row, prefix, length, first row), and a
    one-token request's at a later row; the sampled requests' last rows, padding."""
    from radixd.core.cuda_graph import IDS, LEN, LOC, POS, ROW, ones_beyond

    t = sum(lens)
    bs = t + 3
    rows_of = [10 + i for i in range(len(lens))]
    prefix = [7 * (i + 1) for i in range(len(lens))]
    sampled = [i for i in range(len(lens)) if i != 1]
    b = ForwardBatch(input_ids=torch.arange(100, 100 + t), positions=torch.arange(200, 200 + t),
                     out_cache_loc=torch.arange(300, 300 + t), rows=rows_of, prefix_lens=prefix, extend_lens=lens,
                     sample_indices=sampled)
    flat = torch.full((5 * bs + 4 * MIXED_EXTENDS + 4,), -9, dtype=torch.int64)
    rows = flat[: 5 * bs].view(5, bs)
    ext = flat[5 * bs : 5 * bs + 4 * MIXED_EXTENDS].view(4, MIXED_EXTENDS)
    picks = flat[5 * bs + 4 * MIXED_EXTENDS :]
    s = MixedGraphs._stage(rows, ext, picks, b, decode_rows)
    assert s == len(sampled)
    assert picks[:s].tolist() == b.logits_indices().tolist() and picks[s:].tolist() == [0] * (4 - s)
    assert rows[IDS, :t].tolist() == list(range(100, 100 + t)) and rows[IDS, t:].tolist() == [0] * 3
    assert rows[POS, t:].tolist() == [0] * 3 and rows[LOC, t:].tolist() == [0] * 3
    want_row, want_len, want_ext, start = [0] * bs, [1] * bs, [], 0
    for r, p, e in zip(rows_of, prefix, lens, strict=True):
        if e == 1 and start < decode_rows:
            want_row[start], want_len[start] = r, p + 1
        else:
            want_ext.append([r, p, e, start])
        start += e
    assert rows[ROW].tolist() == want_row and rows[LEN].tolist() == want_len
    n = len(want_ext)
    assert ext[:, :n].T.tolist() == want_ext and ext[:, n:].eq(0).all()
    assert ones_beyond(lens, decode_rows) == sum(1 for x in want_ext if x[2] == 1)
