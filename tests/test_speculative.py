"""Speculative decoding is exact: with drafts right and wrong, greedy and seeded sampled tokens
equal plain decoding's (and transformers' greedy ones), under chunked prefill, cache hits,
preemption, stop strings, logprobs, n > 1, logit bias, penalties, min_tokens and grammars;
requests it cannot verify (matchers that do not fork) decode plainly; drafters (n-gram, the
radix tree, a draft model), configuration, launch flags, /metrics and the benchmark's quick
run; KV accounting holds after every step. The sampled distribution:
test_speculative_distribution.py."""

from __future__ import annotations

import asyncio
import random
import re

import numpy as np
import pytest
from test_engine import assert_greedy_matches, assert_idle, prompts

from radixd import Engine, SamplingParams, launch_flags
from radixd.cli import build_parser
from radixd.core.config import EngineConfig
from radixd.core.errors import ConfigError
from radixd.plugins import hookimpl, make_plugin_manager
from radixd.plugins.drafters import lookup


class Oracle:
    """Drafts the plain run's tokens (``truth[(prompt, sample index)]``), each replaced by a
    wrong one with probability ``wrong``: accepted and rejected drafts in every verify."""

    name = "oracle"
    truth: dict[tuple, list[int]] = {}
    wrong = 0.3

    def __init__(self, config: EngineConfig, cache):
        self.rng = random.Random(0)

    def right(self, r, k: int) -> list[int]:
        """The plain run's next ``k`` tokens for request ``r``."""
        done = len(r.output_ids)
        return self.truth.get((tuple(r.prompt_ids), r.index), [])[done : done + k]

    def propose(self, reqs, ks):
        return [[t if self.rng.random() >= self.wrong else (t + 1 + self.rng.randrange(50)) % 256
                 for t in self.right(r, k)] for r, k in zip(reqs, ks, strict=True)]


class OraclePlugin:
    @hookimpl
    def radixd_drafters(self):
        return {"oracle": Oracle}


def spec_engine(path, algorithm: str | None = "oracle", **kw) -> Engine:
    kw.setdefault("kv_cache_tokens", 4096)
    if algorithm:
        kw["speculative_algorithm"] = algorithm
    pm = make_plugin_manager(load_entry_points=False, extra=[OraclePlugin()])
    eng = Engine(model=str(path), plugin_manager=pm, **kw)
    eng.step_hook = lambda step: eng.check_accounting()
    return eng


async def run_calls(eng: Engine, calls: list[tuple[list[int], dict]]) -> list[list]:
    """Each call's outputs: per sample, (token ids, text, finish reason, logprobs)."""

    async def one(prompt, params):
        params = {"temperature": 0.0, "ignore_eos": True, **params}
        got: dict[int, list] = {}
        async for o in eng.generate(input_ids=prompt, params=SamplingParams(**params)):
            g = got.setdefault(o.index, [[], "", None, []])
            g[0] += o.token_ids
            g[1] += o.text
            g[2] = o.finish_reason
            g[3] += [lp.logprob for lp in o.logprobs or []]
        return [got[i] for i in sorted(got)]

    return await asyncio.gather(*(one(p, params) for p, params in calls))


async def plain_then_spec(path, calls, *, wrong: float = 0.3, **kw):
    """The calls' outputs without and with speculation (the oracle taught by the first run)
    and the speculative engine's stats."""
    plain_eng = spec_engine(path, None, **kw)
    try:
        plain = await run_calls(plain_eng, calls)
    finally:
        await plain_eng.stop()
    Oracle.truth = {(tuple(p), i): out[0] for (p, _), outs in zip(calls, plain, strict=True)
                    for i, out in enumerate(outs)}
    Oracle.wrong = wrong
    eng = spec_engine(path, **kw)
    try:
        spec = await run_calls(eng, calls)
        await assert_idle(eng)
        stats = eng.stats()
    finally:
        await eng.stop()
    return plain, spec, stats


def same_outputs(plain, spec, *, logprob_tol: float = 1e-4):
    for a_call, b_call in zip(plain, spec, strict=True):
        for a, b in zip(a_call, b_call, strict=True):
            assert a[:3] == b[:3]
            assert np.allclose(a[3], b[3], atol=logprob_tol)


async def test_greedy_equals_plain_and_transformers(tiny_models):
    """Right and wrong drafts, prompts chunked 5 at a time, mixed with prefills."""
    path = tiny_models["llama"]
    ps = prompts(3, 20, seed=1)
    plain, spec, st = await plain_then_spec(path, [(p, {"max_new_tokens": 24}) for p in ps],
                                            chunked_prefill_size=5, max_prefill_tokens=8)
    same_outputs(plain, spec)
    for p, outs in zip(ps, spec, strict=True):
        assert_greedy_matches(path, p, outs[0][0], 24)
    # drafts were verified, some accepted, some rejected, each verify yielding > 1 token
    assert st["spec_verifies"] > 0 and 0 < st["spec_accepted_tokens"] < st["spec_draft_tokens"]
    assert st["spec_accepted_tokens"] > 0.5 * st["spec_verifies"]  # > 1.5 tokens per verify


@pytest.mark.parametrize("radix", [True, False])
async def test_cache_hits_and_preemption(tiny_models, radix):
    """A pool too small for the batch preempts; a repeated prompt is served from the cache."""
    path = tiny_models["qwen2"]
    ps = prompts(4, 30, seed=5)
    calls = [(p, {"max_new_tokens": 30}) for p in ps] + [(ps[0], {"max_new_tokens": 30})]
    plain, spec, st = await plain_then_spec(path, calls, kv_cache_tokens=180, schedule_conservativeness=0.0,
                                            radix_cache=radix)
    same_outputs(plain, spec)
    assert st["preemptions"] > 0 and st["spec_accepted_tokens"] > 0


async def test_stop_strings_logprobs_n_seeds_bias(tiny_models):
    """Sampled (seeded) outputs equal plain ones token for token; a stop string inside accepted
    drafts ends the text there; per-token logprobs match; n > 1; logit bias applies to each
    verified position."""
    path = tiny_models["llama"]
    ps = prompts(3, 12, seed=3)
    plain_eng = spec_engine(path, None)
    try:  # a stop string: the text of a few tokens from the middle of a greedy output
        [[(toks, text, _, _)]] = await run_calls(plain_eng, [(ps[0], {"max_new_tokens": 20})])
        stop = plain_eng.tokenizer.decode(toks[8:10])
    finally:
        await plain_eng.stop()
    calls = [
        (ps[0], {"max_new_tokens": 20, "stop": [stop]}),
        (ps[1], {"max_new_tokens": 16, "temperature": 0.8, "top_p": 0.9, "seed": 7, "n": 3, "logprobs": True,
                 "top_logprobs": 2}),
        (ps[2], {"max_new_tokens": 16, "temperature": 1.0, "top_k": 20, "seed": 11, "logit_bias": {9: 3.0}}),
    ]
    plain, spec, st = await plain_then_spec(path, calls, wrong=0.4)
    same_outputs(plain, spec)
    assert spec[0][0][2] == "stop" and stop not in spec[0][0][1]
    assert len({tuple(s[0]) for s in spec[1]}) > 1  # the samples differ
    assert st["spec_accepted_tokens"] > 0


async def test_penalties_and_min_tokens_apply_per_verified_position(tiny_models):
    """Each verified row's penalties count the drafts before it and its stop-token ban its
    own token index: outputs equal plain decoding's, greedy and sampled."""
    path = tiny_models["llama"]
    ps = prompts(3, 10, seed=4)
    first = spec_engine(path, None)
    try:  # a stop token first picked at index 8..11: banned before 8 it changes nothing there
        [[(toks, _, _, _)]] = await run_calls(first, [(ps[2], {"max_new_tokens": 12, "min_new_tokens": 8})])
    finally:
        await first.stop()
    at = next(j for j in range(8, 12) if toks[j] not in toks[:j])
    calls = [(ps[0], {"max_new_tokens": 16, "repetition_penalty": 1.3, "frequency_penalty": 0.5}),
             (ps[1], {"max_new_tokens": 16, "presence_penalty": 0.8, "temperature": 0.9, "seed": 5})]
    plain, spec, st = await plain_then_spec(path, calls, wrong=0.3)
    same_outputs(plain, spec)
    assert st["spec_accepted_tokens"] > 0
    # right drafts: the verify from 6 tokens spans index 8, banned for the rows before it only
    calls = [(ps[2], {"max_new_tokens": 12, "min_new_tokens": 8, "stop_token_ids": [toks[at]]})]
    plain, spec, st = await plain_then_spec(path, calls, wrong=0.0)
    same_outputs(plain, spec)
    assert plain[0][0][0] == toks[: at + 1] and plain[0][0][2] == "stop"  # it stops there


def test_matchers_that_cannot_fork_decode_plainly():
    """A constrained request whose matcher has no ``fork`` drafts nothing (plain decoding)."""
    from radixd.core.constraints import Constraints
    from radixd.core.request import Request
    from radixd.core.speculative.speculator import Speculator

    class NoFork:
        def fill_mask(self, out): ...
        def accept_token(self, token): return True
        def is_terminated(self): return False

    class Forking(NoFork):
        def fork(self): return Forking()

    spec = Speculator(EngineConfig(), Oracle(EngineConfig(), None), None,
                      Constraints(vocab_size=8, context_len=99, close_within=False), context_len=99)
    r = Request(rid="a", prompt_ids=[1, 2], params=SamplingParams(max_new_tokens=10), seed=0, arrival=0)
    assert spec._length(r) == 4
    r.matcher = NoFork()
    assert spec._length(r) == 0
    r.matcher = Forking()
    assert spec._length(r) == 4


async def run_constrained(eng: Engine, prompt, params: SamplingParams) -> list:
    grammar = await eng.compile_grammar(params)
    outs = [o async for o in eng.submit(input_ids=prompt, params=params, grammar=grammar)]
    return [[t for o in outs for t in o.token_ids], "".join(o.text for o in outs), outs[-1].finish_reason]


async def test_grammar_drafts_are_masked_and_exact(tiny_models):
    """Constrained requests draft: drafts the grammar refuses are cut, each verified position
    is masked by the grammar's state after the drafts before it, the matcher sees only the
    accepted tokens; greedy and seeded sampled outputs equal plain decoding's."""
    path = tiny_models["llama"]
    ps = prompts(2, 10, seed=4)
    cases = [(ps[0], SamplingParams(max_new_tokens=24, regex="[a-e]{3,8}( [a-e]{2,6}){2,4}\\.", temperature=0.0)),
             (ps[1], SamplingParams(max_new_tokens=24, json_schema='{"type": "object", "properties": {"a": '
                                    '{"type": "integer"}}, "required": ["a"]}', temperature=0.9, seed=3))]
    results = {}
    for algorithm in (None, "oracle"):
        eng = spec_engine(path, algorithm, grammar_compile_memory_mb=0)
        try:
            results[algorithm] = [await run_constrained(eng, p, params) for p, params in cases]
            st = eng.stats()
        finally:
            await eng.stop()
        if algorithm is None:
            Oracle.truth = {(tuple(p), 0): out[0] for (p, _), out in zip(cases, results[None], strict=True)}
            Oracle.wrong = 0.4
    assert results["oracle"] == results[None]
    assert results[None][0][2] == "stop" and results[None][0][1].endswith(".")
    assert st["spec_verifies"] > 0 and st["spec_accepted_tokens"] > 0


async def test_rejected_drafts_free_their_kv_and_large_batches_step_aside(tiny_models):
    """Only wrong drafts: every verify keeps one token and frees the rest at once; past
    speculative_max_batch decoding requests, nothing drafts."""
    path = tiny_models["llama"]
    ps = prompts(3, 10, seed=8)
    plain, spec, st = await plain_then_spec(path, [(p, {"max_new_tokens": 10}) for p in ps], wrong=1.0,
                                            speculative_num_draft_tokens=3, speculative_adaptive=False)
    same_outputs(plain, spec)
    assert st["spec_verifies"] > 0 and st["spec_accepted_tokens"] == 0
    _, spec, st = await plain_then_spec(path, [(p, {"max_new_tokens": 10}) for p in ps], speculative_max_batch=2)
    assert st.get("spec_verifies", 0) == 0


def test_adaptive_draft_length():
    from radixd.core.speculative.speculator import Speculator

    class R:
        draft_len = 0

    spec = Speculator(EngineConfig(speculative_num_draft_tokens=6), Oracle(EngineConfig(), None), None, None, context_len=99)
    r = R()
    spec._learn(r, 6, 6)
    assert r.draft_len == 6  # capped at num_draft_tokens
    spec._learn(r, 6, 2)
    assert r.draft_len == 5
    spec._learn(r, 1, 0)
    assert r.draft_len == 1  # never below one
    spec._learn(r, 1, 1)
    assert r.draft_len == 3
    assert spec.stats.as_dict() == {"spec_verifies": 4, "spec_draft_tokens": 14, "spec_accepted_tokens": 9}


def test_ngram_lookup():
    seq = np.array([1, 2, 3, 4, 9, 1, 2, 3, 5, 7, 2, 3])
    assert lookup(seq, 3, 1, 3) == [5, 7, 2]  # the latest earlier "2 3" (longest match first)
    assert lookup(seq, 3, 3, 3) == []  # "7 2 3" occurs nowhere before
    assert lookup(np.array([4, 5, 4]), 2, 1, 4) == [5, 4]
    assert lookup(np.array([4, 5, 6]), 2, 1, 4) == []
    assert lookup(np.array([8, 1, 2, 8, 1, 2]), 5, 1, 2) == [8, 1, 2]  # stops at the end


async def test_ngram_drafter_on_a_repetitive_prompt(tiny_models):
    from prometheus_client import generate_latest

    from radixd.server.metrics import Metrics

    path = tiny_models["llama"]
    p = [5, 6, 7, 8, 9, 10, 11] * 4
    plain, spec, st = await plain_then_spec(path, [(p, {"max_new_tokens": 24})], speculative_ngram_max_match_window=3)
    Oracle.truth = {}
    eng = spec_engine(path, "ngram")
    try:
        [[got]] = await run_calls(eng, [(p, {"max_new_tokens": 24})])
        assert got[0] == plain[0][0][0]
        st = eng.stats()
        assert st["spec_verifies"] > 0
        text = generate_latest(Metrics(eng).registry).decode()
        assert f"radixd_spec_verifies_total {float(st['spec_verifies'])}" in text
        v, a = st["spec_verifies"], st["spec_accepted_tokens"]
        assert f"radixd_spec_accept_length {(a + v) / v}" in text and "radixd_spec_accept_rate " in text
    finally:
        await eng.stop()


def test_sglang_launch_flags():
    def flags(*words):
        return launch_flags.overrides(build_parser().parse_args(list(words)))

    assert flags("--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "6",
                 "--speculative-ngram-min-match-window-size", "2", "--speculative-ngram-max-match-window-size", "5") == {
        "speculative.algorithm": "ngram", "speculative.num_draft_tokens": 6,
        "speculative.ngram_min_match_window": 2, "speculative.ngram_max_match_window": 5}
    with pytest.raises(ConfigError, match="--speculative-algorithm.*NEXTN"):  # (EAGLE3: test_eagle3.py)
        flags("--speculative-algorithm", "NEXTN")
    with pytest.raises(ConfigError, match="--speculative-num-draft-tokens"):
        flags("--speculative-num-draft-tokens", "0")


def test_unknown_drafter_is_refused(tiny_models):
    with pytest.raises(ConfigError, match="speculative_algorithm.*ngram"):
        spec_engine(tiny_models["llama"], "eagle9")
    with pytest.raises(ConfigError, match="speculative_ngram_min_match_window"):
        EngineConfig(speculative_ngram_min_match_window=5, speculative_ngram_max_match_window=2)


async def test_verify_rows_on_the_triton_backend(tiny_models):
    """A verify entry is decode rows of one table row: the triton decode kernels (interpreted
    on CPU) store every row's K/V before attending, so outputs equal plain decoding's."""
    path = tiny_models["qwen3"]
    ps = prompts(1, 6, seed=9)
    plain, spec, st = await plain_then_spec(path, [(p, {"max_new_tokens": 6}) for p in ps], wrong=0.2,
                                            attention_backend="triton", dtype="float32", kv_cache_tokens=512)
    same_outputs(plain, spec)
    assert st["spec_accepted_tokens"] > 0


@pytest.mark.gpu
async def test_verify_steps_replay_decode_graphs(tiny_models):
    """On a GPU, verify steps are decode batches: they replay the decode CUDA graphs."""
    path = tiny_models["llama"]
    ps = prompts(3, 20, seed=10)
    kw = dict(device="cuda", attention_backend="triton", dtype="float32", cuda_graphs=True)
    plain_eng = spec_engine(path, None, **kw)
    try:
        plain = await run_calls(plain_eng, [(p, {"max_new_tokens": 32}) for p in ps])
    finally:
        await plain_eng.stop()
    Oracle.truth = {(tuple(p), 0): out[0][0] for p, out in zip(ps, plain, strict=True)}
    Oracle.wrong = 0.3
    eng = spec_engine(path, **kw)
    graphed = []

    def hook(step):
        eng.check_accounting()
        if step.drafts:
            graphed.append(eng.worker.graphs.can_run(step.batch))

    eng.step_hook = hook
    try:
        spec = await run_calls(eng, [(p, {"max_new_tokens": 32}) for p in ps])
    finally:
        await eng.stop()
    same_outputs(plain, spec)
    assert graphed and all(graphed)


@pytest.mark.gpu
async def test_standalone_draft_model_on_the_gpu(tiny_models):
    """The draft model on the GPU's triton backend (its own pool and rows), the target's
    verify steps on decode graphs: outputs equal plain decoding's."""
    path = tiny_models["llama"]
    ps = prompts(2, 16, seed=15)
    kw = dict(device="cuda", attention_backend="triton", dtype="float32", cuda_graphs=True)
    plain, spec, st = await plain_then_spec(path, [(p, {"max_new_tokens": 24}) for p in ps], **kw)
    eng = spec_engine(path, "standalone", speculative_draft_model_path=str(path), **kw)
    try:
        spec = await run_calls(eng, [(p, {"max_new_tokens": 24}) for p in ps])
        st = eng.stats()
    finally:
        await eng.stop()
    same_outputs(plain, spec)
    assert st["spec_accepted_tokens"] > 0.9 * st["spec_draft_tokens"]


def test_benchmark_runs_quick(tmp_path):
    """``python -m benchmarks.spec --quick``: every section's logic on tiny random models."""
    import json

    from benchmarks import spec

    assert spec.main(["--quick", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "spec_cpu_quick.json").read_text())
    q = doc["quick"]
    assert all(q["verify"][f"k{k}"]["step_ms"] > 0 for k in (1, 4, 8))
    rates = q["accept"]["rates"]
    assert rates["1.0"]["accepted_of_drafted"] == 1.0 and rates["1.0"]["tokens_per_verify"] == spec.K_DEFAULT + 1
    assert 0 < rates["0.5"]["accepted_of_drafted"] < 1.0  # the verifier took drafts by the coin, not all
    assert q["verify_rows_vs_plain"]["same_outputs"] == 2  # float32 on the CPU: verify rows decode alike
    assert q["batch"]["steps_aside"]["verifies"] == 0 < q["batch"]["forced"]["verifies"]
    assert q["ngram"]["ngram"]["accepted_of_drafted"] > 0
    assert q["standalone"]["same_outputs"] == 2 and q["standalone"]["accepted_of_drafted"] > 0.9
    assert all(q["tree"][f"w{w}"]["tree_verifies"] > 0 and q["tree"][f"w{w}"]["step_ms"] > 0 for w in (2, 4))
    e3 = q["eagle3"]  # (a random head: its own drafts miss; forced, the verifier takes them)
    assert e3["unforced"]["verifies"] > 0 and e3["rates"]["0.7"]["tokens_per_verify"] > 1.5
    cpu = doc["cpu_ngram"]
    assert cpu["copy"]["same_outputs"] == len(spec.COPY_PROMPTS) and cpu["copy"]["tokens_per_verify"] > 1


@pytest.mark.parametrize("draft", ["llama", "llama-tied"])
async def test_standalone_draft_model(tiny_models, draft):
    """A draft model on its own KV region: the target's own weights (every greedy draft
    accepted) or another checkpoint of the same tokenizer (unrelated random weights: drafts
    mostly rejected); outputs equal plain
    decoding's, rejected draft KV is dropped at the next call, a finished request's at the
    first call after it."""
    path = tiny_models["llama"]
    ps = prompts(2, 12, seed=11)
    calls = [(p, {"max_new_tokens": 16}) for p in ps]
    plain_eng = spec_engine(path, None)
    try:
        plain = await run_calls(plain_eng, calls)
    finally:
        await plain_eng.stop()
    eng = spec_engine(path, "standalone", speculative_draft_model_path=str(tiny_models[draft]),
                      speculative_draft_kv_tokens=256)
    drafter = eng.scheduler.speculator.drafter

    def hook(step):
        eng.check_accounting()
        held = sum(st.slots.numel() for st in drafter.states.values())
        assert drafter.allocator.available + held == drafter.allocator.total
        assert all(st.slots.numel() == len(st.tokens) for st in drafter.states.values())

    eng.step_hook = hook
    try:
        spec = await run_calls(eng, calls)
        st = eng.stats()
        assert len(drafter.states) == 2  # kept until the next call
        await run_calls(eng, [(ps[0][:5], {"max_new_tokens": 3})])
        assert len(drafter.states) == 1
    finally:
        await eng.stop()
    same_outputs(plain, spec)
    assert st["spec_draft_tokens"] > 0
    if draft == "llama":
        assert st["spec_accepted_tokens"] == st["spec_draft_tokens"]
    with pytest.raises(ConfigError, match="speculative_draft_model_path"):
        spec_engine(path, "standalone")


def test_radix_continuation_reads_the_cached_path():
    from radixd.core.kv_pool import SlotAllocator
    from radixd.core.radix_cache import RadixCache

    alloc = SlotAllocator(64)
    cache = RadixCache(alloc)
    cache.insert([1, 2, 3, 4, 5], alloc.alloc(5))
    cache.insert([1, 2, 3, 9, 9, 9], alloc.alloc(6))  # forks after 1 2 3; the newer branch
    cache.match_prefix([1, 2, 3, 9])  # used now: the most recent
    assert cache.continuation([1, 2], limit=3) == [3, 9, 9]
    assert cache.continuation([1, 2, 3, 4], limit=5) == [5]
    assert cache.continuation([1, 2, 7]) == [] and cache.continuation([8]) == []
    assert cache.continuation([1, 2, 3, 4, 5]) == []  # nothing past it
    assert cache._roots[0].children[1].key == (1, 2, 3)  # the reads split no edge


async def test_ngram_drafts_from_the_radix_tree(tiny_models):
    """A prompt seen before: the tree holds the earlier answer past it, which ``ngram`` drafts
    when the request's own tokens have no match."""
    path = tiny_models["llama"]
    p = prompts(1, 30, seed=13)[0]
    eng = spec_engine(path, "ngram", speculative_ngram_min_match_window=4)
    try:
        [[first]] = await run_calls(eng, [(p, {"max_new_tokens": 16})])
        before = eng.stats()["spec_accepted_tokens"]
        [[again]] = await run_calls(eng, [(p, {"max_new_tokens": 16})])
        st = eng.stats()
    finally:
        await eng.stop()
    assert again[0] == first[0]
    assert st["spec_accepted_tokens"] - before >= 10  # most of the answer came from the tree


async def test_daemon_speculates_and_reports_it(tiny_models, tmp_path):
    """radixd.toml's [speculative] section through a real daemon: the official openai client
    gets plain decoding's text, and /metrics counts the verified drafts."""
    import httpx
    import openai
    from conftest import Daemon

    path = tiny_models["llama"]
    prompt = "one two three one two three one two three one two"
    plain = spec_engine(path, None)
    try:
        want = "".join([o.text async for o in plain.generate(prompt, params=SamplingParams(max_new_tokens=16,
                                                                                            temperature=0.0))])
    finally:
        await plain.stop()
    d = Daemon(tmp_path, f"""
[model]
path = "{path}"
[server]
port = 0
[memory]
kv_cache_tokens = 2048
[speculative]
algorithm = "ngram"
num_draft_tokens = 3
""")
    try:
        client = openai.OpenAI(base_url=f"{d.url}/v1", api_key="none")
        got = client.completions.create(model="llama", prompt=prompt, max_tokens=16, temperature=0)
        assert got.choices[0].text == want
        metrics = httpx.get(f"{d.url}/metrics").text
        verifies = re.search(r"^radixd_spec_verifies_total (\S+)$", metrics, re.M)
        assert verifies and float(verifies.group(1)) > 0
        assert re.search(r"^radixd_spec_accept_length \S+$", metrics, re.M)
    finally:
        assert d.stop() == 0



async def test_requests_without_guesses_decode_overlapped(tiny_models):
    """A request the drafter has no guess for pauses drafting: most of its steps are
    scheduled ahead (placeholders), not synchronised for a draft that never comes."""
    path = tiny_models["llama"]
    Oracle.truth = {}  # no guesses at all
    eng = spec_engine(path)
    placeholders = 0

    def hook(step):
        nonlocal placeholders
        placeholders += len(step.batch.placeholder_pos)
        eng.check_accounting()

    eng.step_hook = hook
    try:
        await run_calls(eng, [(p, {"max_new_tokens": 20}) for p in prompts(2, 10, seed=14)])
    finally:
        await eng.stop()
    assert placeholders >= 20  # of 2 x 19 decode steps


def test_verify_steps_on_the_scheduler_alone():
    """No model (test_scheduler's fake worker, which checks every row reads its sequence's
    KV): a verify entry is 1 + k decode rows at consecutive positions; a failed verify step
    rolls back to where it was; a processed one keeps the accepted drafts and the bonus pick
    and frees the rejected slot at once."""
    from test_scheduler import FakeWorker, free_of_requests, pick, prompt, req, step

    from radixd.core.kv_pool import RowAllocator, SlotAllocator
    from radixd.core.radix_cache import RadixCache
    from radixd.core.scheduler import Scheduler
    from radixd.plugins.policies import FCFS

    class Guess:  # the fake model's next picks, the last one wrong
        def propose(self, reqs, ks):
            return [[pick(r, len(r.output_ids) + i) for i in range(k - 1)] + [7] for r, k in zip(reqs, ks, strict=True)]

    config = EngineConfig(max_running_requests=4, speculative_num_draft_tokens=4, speculative_adaptive=False)
    allocator = SlotAllocator(257)
    s = Scheduler(config, allocator=allocator, rows=RowAllocator(4), cache=RadixCache(allocator), policy=FCFS(config),
                  eos_token_ids=(2,), context_len=4096, vocab_size=2048, drafter=Guess())
    w = FakeWorker()
    r = req(s, prompt(10), max_new_tokens=12)
    step(s, w)  # the prompt, and the first pick
    before = (r.kv.length, list(r.output_ids), s.accounting())
    st = s.schedule()
    assert st.drafts == {r: [1001, 1002, 1003, 7]} and st.reqs == [r] * 5
    assert st.batch.prefix_lens == list(range(10, 15)) and st.batch.extend_lens == [1] * 5
    assert st.batch.input_ids.tolist() == [1000, 1001, 1002, 1003, 7]
    w.fail_next = True
    with pytest.raises(RuntimeError):
        w.run(st)
    s.rollback(st)
    s.check_accounting()
    assert (r.kv.length, list(r.output_ids), s.accounting()) == before
    st = step(s, w)  # again: three drafts accepted, the fourth replaced by the model's pick
    assert st.drafts and r.output_ids == [pick(r, i) for i in range(5)] and r.kv.length == 14
    assert s.accounting()["private"] == 4  # the rejected draft's slot went back
    while s.has_work():
        step(s, w)
    assert r.output_ids == [pick(r, i) for i in range(12)] and r.finish_reason == "length"
    free_of_requests(s)
