"""Sampling and stopping through ``radixd.Engine`` on a tiny random-weight llama (CPU, fp32).

Covers seeded determinism (alone and inside mixed batches), stop strings (never emitted, not
even in part, while streaming), stop token ids, max/min_new_tokens, ignore_eos, n > 1,
logprobs, and request validation; plus both detokenizers (the window of decodes and the byte
table) on the tiny tokenizer.
"""

from __future__ import annotations

import asyncio
import copy
import json
import shutil
from dataclasses import dataclass, field

import pytest
import torch
from conftest import hf_greedy, make_tiny_checkpoint

from radixd import Engine, SamplingParams
from radixd.core.detokenizer import Detokenizers, IncrementalDetokenizer
from radixd.core.errors import ContextLengthExceeded, InvalidRequest

PROMPT = "hello world"
OTHER_PROMPTS = ["The capital of France is", "abc def 123", "radix attention", "x"]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("sampling") / "llama", "llama")


@pytest.fixture(scope="module")
def eos_model(model_path, tmp_path_factory):
    """The same weights with an extra EOS id: the token greedy decoding of PROMPT emits at
    step 2 (the tiny random model almost never emits the real EOS, id 0)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    greedy, _ = hf_greedy(model_path, tok(PROMPT).input_ids, 4)
    eos = greedy[2]
    assert eos not in greedy[:2] and eos != 0
    dst = tmp_path_factory.mktemp("eos") / "llama"
    shutil.copytree(model_path, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["eos_token_id"] = [0, eos]
    (dst / "config.json").write_text(json.dumps(cfg))
    gen = dst / "generation_config.json"
    if gen.exists():
        g = json.loads(gen.read_text())
        g["eos_token_id"] = [0, eos]
        gen.write_text(json.dumps(g))
    return dst, eos


def decode(tok, ids: list[int]) -> str:
    return tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def make_engine(path, **kw) -> Engine:
    kw.setdefault("kv_cache_tokens", 4096)
    kw.setdefault("dtype", "float32")  # logprobs are compared with transformers in fp32
    return Engine(model=str(path), **kw)


@dataclass
class Sample:
    ids: list[int] = field(default_factory=list)
    pieces: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    finished_updates: int = 0
    logprobs: list = field(default_factory=list)
    got_logprobs: bool = False
    completion_tokens: int = 0

    @property
    def text(self) -> str:
        return "".join(self.pieces)


async def run(eng: Engine, prompt: str | None = PROMPT, *, input_ids=None, **params) -> list[Sample]:
    """One generate call; the streamed updates gathered per sample index."""
    params.setdefault("ignore_eos", True)
    sp = SamplingParams(**params)
    out = [Sample() for _ in range(sp.n)]
    async for o in eng.generate(None if input_ids is not None else prompt, input_ids=input_ids, params=sp):
        s = out[o.index]
        assert s.finish_reason is None, "an update arrived after the sample finished"
        s.ids += o.token_ids
        s.pieces.append(o.text)
        if o.logprobs is not None:
            s.got_logprobs = True
            s.logprobs += o.logprobs
        if o.finished:
            s.finished_updates += 1
            s.finish_reason = o.finish_reason
            s.completion_tokens = o.completion_tokens
    for s in out:
        assert s.finished_updates == 1 and s.finish_reason is not None
    return out


async def run1(eng: Engine, prompt: str | None = PROMPT, **params) -> Sample:
    (s,) = await run(eng, prompt, **params)
    return s


def pick_stop(text: str, length: int, start: int) -> tuple[str, int] | None:
    """A stop string from ``text`` whose first occurrence starts at or after ``start`` and such
    that the text before it does not end with a proper prefix of it."""
    for i in range(start, len(text) - length + 1):
        s = text[i : i + length]
        if "\ufffd" in s or text.find(s) != i:
            continue
        if any(text[:i].endswith(s[:j]) for j in range(1, length)):
            continue
        return s, i
    return None


def assert_stream_never_shows(sample: Sample, stop: str, final: str) -> None:
    """Every streamed prefix is a prefix of the final text and never holds ``stop``."""
    acc = ""
    for piece in sample.pieces:
        acc += piece
        assert stop not in acc
        assert final.startswith(acc), (acc, final)
    assert acc == final


# ----------------------------------------------------------------------------- basics


async def test_greedy_length_and_streamed_text(model_path):
    eng = make_engine(model_path)
    try:
        tok = eng.tokenizer
        s = await run1(eng, max_new_tokens=8, temperature=0.0)
        assert len(s.ids) == 8 and s.completion_tokens == 8
        assert s.finish_reason == "length"
        assert s.text == decode(tok, s.ids)
        again = await run1(eng, max_new_tokens=8, temperature=0.0, seed=123)
        assert again.ids == s.ids  # greedy ignores the seed
        topk1 = await run1(eng, max_new_tokens=8, temperature=1.3, top_k=1, seed=5)
        assert topk1.ids == s.ids
        eng.check_accounting()
    finally:
        await eng.stop()


async def test_streamed_text_equals_decode_of_sampled_tokens(model_path):
    """Random byte tokens often end inside a UTF-8 character: the streamed pieces must still
    add up to the decoded tokens when the request ends (no bytes silently dropped)."""
    eng = make_engine(model_path)
    try:
        tok = eng.tokenizer
        outs = await asyncio.gather(*(run1(eng, max_new_tokens=20, temperature=1.0, seed=s) for s in range(12)))
        for s in outs:
            assert s.finish_reason == "length"
            assert s.text == decode(tok, s.ids), (s.ids, s.text)
        eng.check_accounting()
    finally:
        await eng.stop()


# ----------------------------------------------------------------------------- seeds


async def test_seed_determinism_alone_and_in_mixed_batch(model_path):
    eng = make_engine(model_path)
    try:
        target = dict(max_new_tokens=16, temperature=0.9, top_p=0.95, seed=1234)
        alone = await run1(eng, **target)
        others = [
            run1(eng, OTHER_PROMPTS[0], max_new_tokens=24, temperature=1.0, seed=1),
            run1(eng, OTHER_PROMPTS[1], max_new_tokens=12, temperature=0.0),
            run1(eng, OTHER_PROMPTS[2], max_new_tokens=20, temperature=0.7, top_k=20, seed=99,
                 repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.3),
            run1(eng, PROMPT, max_new_tokens=16, temperature=0.9, top_p=0.95, seed=4321),
            run1(eng, OTHER_PROMPTS[3], max_new_tokens=10, temperature=1.5, min_p=0.05, seed=7,
                 logprobs=True, top_logprobs=2),
        ]
        mixed = await asyncio.gather(*others[:2], run1(eng, **target), *others[2:])
        assert mixed[2].ids == alone.ids
        assert mixed[2].text == alone.text
        assert mixed[5].ids != alone.ids  # same prompt, another seed
        # Arriving while others are mid-decode (different batch shapes at each step).
        late = asyncio.gather(run1(eng, OTHER_PROMPTS[0], max_new_tokens=30, temperature=1.0, seed=3),
                              run1(eng, OTHER_PROMPTS[2], max_new_tokens=30, temperature=0.5, seed=8))
        task = asyncio.ensure_future(late)
        await asyncio.sleep(0.05)
        again = await run1(eng, **target)
        await task
        assert again.ids == alone.ids
        eng.check_accounting()
    finally:
        await eng.stop()


async def test_different_seeds_give_different_outputs(model_path):
    eng = make_engine(model_path)
    try:
        outs = await asyncio.gather(*(run1(eng, max_new_tokens=12, temperature=1.0, seed=s) for s in range(6)))
        assert len({tuple(o.ids) for o in outs}) == 6
        eng.check_accounting()
    finally:
        await eng.stop()


# ----------------------------------------------------------------------------- stops


async def test_stop_strings_are_cut_and_never_streamed(model_path):
    """For each seed: reference run, then the same seed with a stop string taken from the middle
    of its text. The output is the reference text up to the stop string, exactly."""
    eng = make_engine(model_path)
    try:
        tok = eng.tokenizer
        seeds = list(range(10, 18))
        common = dict(max_new_tokens=24, temperature=1.0)
        refs = await asyncio.gather(*(run1(eng, seed=s, **common) for s in seeds))
        cases = []
        for seed, ref, length in zip(seeds, refs, [1, 2, 3, 2, 3, 1, 2, 4], strict=True):
            assert ref.text == decode(tok, ref.ids)
            picked = pick_stop(ref.text, length, start=len(ref.text) // 3)
            if picked is not None:
                cases.append((seed, ref, *picked))
        assert len(cases) >= 5
        stopped = await asyncio.gather(*(run1(eng, seed=seed, stop=[s], **common) for seed, _, s, _ in cases))
        for (_seed, ref, stop, cut), got in zip(cases, stopped, strict=True):
            want = ref.text[:cut]
            assert got.finish_reason == "stop"
            assert got.text == want, (stop, got.text, ref.text)
            assert_stream_never_shows(got, stop, want)
            assert not any(got.text.endswith(stop[:j]) for j in range(1, len(stop)))
            assert got.ids == ref.ids[: len(got.ids)] and len(got.ids) < len(ref.ids)
        eng.check_accounting()
    finally:
        await eng.stop()


async def test_stop_string_prefixes_are_held_back_then_released(model_path):
    """Stop strings that only partly match (mid-text, and at the very end) must not lose or
    reorder text: the output equals the reference, and the partial match at the end is only
    released in the final update."""
    eng = make_engine(model_path)
    try:
        for seed in range(30, 60):
            ref = await run1(eng, max_new_tokens=16, temperature=1.0, seed=seed)
            t = ref.text
            if len(t) >= 6 and "\ufffd" not in t[-2:] and "\ufffd" not in t[2:4]:
                break
        else:
            pytest.fail("no reference text with a clean tail")
        never = "\U0001f600\U0001f600"
        stops = [t[2:4] + never, t[-2:] + never]
        assert not any(s in t for s in stops)
        got = await run1(eng, max_new_tokens=16, temperature=1.0, seed=seed, stop=stops)
        assert got.finish_reason == "length"
        assert got.ids == ref.ids
        assert got.text == t
        before_last = "".join(got.pieces[:-1])
        assert len(before_last) <= len(t) - 2  # the tail that could grow into a stop waited
        eng.check_accounting()
    finally:
        await eng.stop()


async def test_earliest_of_several_stop_strings_wins(model_path):
    eng = make_engine(model_path)
    try:
        for seed in range(70, 90):
            ref = await run1(eng, max_new_tokens=24, temperature=1.0, seed=seed)
            early = pick_stop(ref.text, 2, start=len(ref.text) // 4)
            late = early and pick_stop(ref.text, 2, start=early[1] + 2)
            if late:
                break
        else:
            pytest.fail("no reference text with two stop candidates")
        got = await run1(eng, max_new_tokens=24, temperature=1.0, seed=seed, stop=[late[0], early[0]])
        assert got.finish_reason == "stop"
        assert got.text == ref.text[: early[1]]
        eng.check_accounting()
    finally:
        await eng.stop()


def first_new_position(ids: list[int], start: int) -> int:
    """First position >= start whose token does not occur earlier in ``ids``."""
    for k in range(start, len(ids)):
        if ids[k] not in ids[:k]:
            return k
    raise AssertionError(f"no fresh token in {ids}")


async def test_stop_token_ids_and_min_new_tokens(model_path):
    eng = make_engine(model_path)
    try:
        ref = await run1(eng, max_new_tokens=16, temperature=0.0)
        k = first_new_position(ref.ids, 2)
        stop_id = ref.ids[k]
        got = await run1(eng, max_new_tokens=16, temperature=0.0, stop_token_ids=[stop_id], ignore_eos=False)
        assert got.finish_reason == "stop"
        assert got.ids == ref.ids[: k + 1]
        # min_new_tokens bans the stop id until it is reached.
        m = k + 3
        got = await run1(eng, max_new_tokens=16, temperature=0.0, stop_token_ids=[stop_id],
                         min_new_tokens=m, ignore_eos=False)
        assert stop_id not in got.ids[:m]
        assert len(got.ids) >= m
        assert got.finish_reason == ("stop" if got.ids[-1] == stop_id else "length")
        # Sampled: over several seeds the stop id never shows before min_new_tokens.
        outs = await asyncio.gather(*(
            run1(eng, max_new_tokens=8, temperature=0.3, seed=s, stop_token_ids=[stop_id], min_new_tokens=6)
            for s in range(6)
        ))
        for o in outs:
            assert stop_id not in o.ids[:6] and len(o.ids) >= 6
        eng.check_accounting()
    finally:
        await eng.stop()


async def test_stop_token_text_is_not_emitted(model_path):
    """SamplingParams: stop_token_ids 'end the request after emitting nothing for that token'."""
    eng = make_engine(model_path)
    try:
        ref = await run1(eng, max_new_tokens=16, temperature=0.0)
        k = first_new_position(ref.ids, 2)
        got = await run1(eng, max_new_tokens=16, temperature=0.0, stop_token_ids=[ref.ids[k]])
        assert got.ids == ref.ids[: k + 1]
        assert got.text == decode(eng.tokenizer, ref.ids[:k])
    finally:
        await eng.stop()


async def test_stop_string_completed_by_last_allowed_token_reports_stop(model_path):
    eng = make_engine(model_path)
    try:
        tok = eng.tokenizer
        found = None
        for seed in range(20):
            ref = await run1(eng, max_new_tokens=16, temperature=1.0, seed=seed)
            for n in range(4, 15):
                text, shorter = decode(tok, ref.ids[:n]), decode(tok, ref.ids[: n - 1])
                stop = text[-2:]
                if ("\ufffd" not in stop and text.find(stop) == len(text) - 2 and stop not in shorter
                        and decode(tok, ref.ids[: n + 1]).startswith(text)):
                    found = seed, n, text, stop
                    break
            if found:
                break
        assert found, "no sampled text with a usable tail"
        seed, n, text, stop = found
        got = await run1(eng, max_new_tokens=n, temperature=1.0, seed=seed, stop=[stop])
        assert got.ids == ref.ids[:n]
        assert got.text == text[:-2]
        assert got.finish_reason == "stop"
    finally:
        await eng.stop()


async def test_eos_min_new_tokens_and_ignore_eos(eos_model):
    path, eos = eos_model
    eng = make_engine(path)
    try:
        assert eos in eng.eos_token_ids
        ref = await run1(eng, max_new_tokens=10, temperature=0.0, ignore_eos=True)
        assert ref.finish_reason == "length" and len(ref.ids) == 10
        k = ref.ids.index(eos)
        stopped = await run1(eng, max_new_tokens=10, temperature=0.0, ignore_eos=False)
        assert stopped.finish_reason == "stop"
        assert stopped.ids == ref.ids[: k + 1]
        m = k + 4
        held = await run1(eng, max_new_tokens=10, temperature=0.0, ignore_eos=False, min_new_tokens=m)
        assert eos not in held.ids[:m] and len(held.ids) >= m
        assert held.finish_reason == ("stop" if held.ids[-1] == eos else "length")
        # min_new_tokens == max_new_tokens: EOS can never end it early.
        full = await run1(eng, max_new_tokens=6, temperature=0.0, ignore_eos=False, min_new_tokens=6)
        assert len(full.ids) == 6 and eos not in full.ids and full.finish_reason == "length"
        # Sampling, with the EOS made likely by a low temperature: banned below min_new_tokens.
        outs = await asyncio.gather(*(
            run1(eng, max_new_tokens=8, temperature=0.2, seed=s, ignore_eos=False, min_new_tokens=5)
            for s in range(8)
        ))
        for o in outs:
            assert eos not in o.ids[:5] and len(o.ids) >= 5
            if o.finish_reason == "stop":
                assert o.ids[-1] == eos and o.ids.count(eos) == 1
        eng.check_accounting()
    finally:
        await eng.stop()


# ----------------------------------------------------------------------------- n and logprobs


async def test_n_samples(model_path):
    eng = make_engine(model_path)
    try:
        outs = await run(eng, max_new_tokens=8, temperature=1.0, seed=5, n=4)
        assert len(outs) == 4
        assert all(len(o.ids) == 8 and o.finish_reason == "length" for o in outs)
        assert len({tuple(o.ids) for o in outs}) == 4
        again = await run(eng, max_new_tokens=8, temperature=1.0, seed=5, n=4)
        assert [o.ids for o in again] == [o.ids for o in outs]  # seeded n > 1 is reproducible
        greedy = await run(eng, max_new_tokens=6, temperature=0.0, n=3)
        assert greedy[0].ids == greedy[1].ids == greedy[2].ids
        # Indices reported: 0..n-1 each exactly once at finish (checked in run()).
        stops = await run(eng, max_new_tokens=8, temperature=1.0, seed=6, n=3, stop=["\x00"])
        assert len(stops) == 3
        eng.check_accounting()
    finally:
        await eng.stop()


async def test_logprobs_match_transformers(model_path):
    eng = make_engine(model_path)
    try:
        prompt = eng.tokenize(PROMPT)
        s = await run1(eng, None, input_ids=prompt, max_new_tokens=6, temperature=0.0, logprobs=True, top_logprobs=3)
        want, logits = hf_greedy(model_path, prompt, 6)
        assert s.ids == want
        assert s.got_logprobs and len(s.logprobs) == 6
        ref = torch.log_softmax(logits.float(), dim=-1)
        for i, lp in enumerate(s.logprobs):
            assert lp.token_id == s.ids[i]
            assert lp.logprob == pytest.approx(float(ref[i, lp.token_id]), abs=1e-3)
            assert len(lp.top) == 3
            vals = [v for _, v in lp.top]
            assert vals == sorted(vals, reverse=True)
            assert vals == pytest.approx(ref[i].topk(3).values.tolist(), abs=1e-3)
            assert lp.top[0][0] == lp.token_id  # greedy: the chosen token is the most likely
        # Sampled with penalties: logprobs still of the raw distribution, at the chosen token.
        sampled = await run1(eng, max_new_tokens=6, temperature=1.0, seed=3, logprobs=True,
                             presence_penalty=1.0)
        assert len(sampled.logprobs) == 6
        assert [lp.token_id for lp in sampled.logprobs] == sampled.ids
        assert all(lp.logprob <= 0.0 and lp.top == [] for lp in sampled.logprobs)
        plain = await run1(eng, max_new_tokens=3, temperature=1.0, seed=3)
        assert not plain.got_logprobs
        eng.check_accounting()
    finally:
        await eng.stop()


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("kw", "field_name"),
    [
        (dict(temperature=-1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(min_p=1.5), "min_p"),
        (dict(n=0), "n"),
        (dict(stop=[""]), "stop"),
        (dict(stop=""), "stop"),
        (dict(max_new_tokens=-1), "max_new_tokens"),
        (dict(min_new_tokens=5, max_new_tokens=4), "min_new_tokens"),
        (dict(repetition_penalty=0), "repetition_penalty"),
        (dict(frequency_penalty=3), "frequency_penalty"),
        (dict(seed=-1), "seed"),
        (dict(stop_token_ids=[-1]), "stop_token_ids"),
        (dict(top_logprobs=-1), "top_logprobs"),
    ],
)
def test_bad_sampling_params(kw, field_name):
    with pytest.raises(InvalidRequest) as ei:
        SamplingParams(**kw)
    assert ei.value.field == field_name


async def expect_invalid(eng: Engine, field_name: str, prompt=None, input_ids=None, **params):
    with pytest.raises(InvalidRequest) as ei:
        async for _ in eng.generate(prompt, input_ids=input_ids, params=params or None):
            pass
    assert ei.value.field == field_name, ei.value
    return ei.value


async def test_engine_rejects_bad_requests_then_serves(model_path):
    eng = make_engine(model_path, max_context_len=64, max_n=4)
    try:
        await expect_invalid(eng, "prompt", "")
        await expect_invalid(eng, "prompt", input_ids=[])
        await expect_invalid(eng, "prompt")  # neither prompt nor input_ids
        await expect_invalid(eng, "input_ids", input_ids=[5, 256])
        await expect_invalid(eng, "input_ids", input_ids=[-1, 5])
        err = await expect_invalid(eng, "prompt", input_ids=[5] * 64, max_new_tokens=1)
        assert isinstance(err, ContextLengthExceeded) and err.limit == 64 and err.prompt_tokens == 64
        await expect_invalid(eng, "prompt", "hello world " * 40, max_new_tokens=1)
        await expect_invalid(eng, "max_new_tokens", input_ids=[5] * 40, max_new_tokens=30)
        await expect_invalid(eng, "n", PROMPT, n=5, max_new_tokens=2)
        await expect_invalid(eng, "top_logprobs", PROMPT, logprobs=True, top_logprobs=21, max_new_tokens=2)
        await expect_invalid(eng, "temperature", PROMPT, temperature=-1)  # params as a dict
        s = await run1(eng, max_new_tokens=4, temperature=0.0)
        assert len(s.ids) == 4 and s.finish_reason == "length"
        eng.check_accounting()
    finally:
        await eng.stop()


async def test_engine_rejects_n_above_default_max_n(model_path):
    eng = make_engine(model_path)
    try:
        await expect_invalid(eng, "n", PROMPT, n=eng.config.max_n + 1, max_new_tokens=2)
        outs = await run(eng, max_new_tokens=3, temperature=1.0, seed=1, n=2)
        assert [len(o.ids) for o in outs] == [3, 3]
        eng.check_accounting()
    finally:
        await eng.stop()


# ----------------------------------------------------------------------------- detokenizer


@pytest.fixture(scope="module")
def tokenizer(model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


KINDS = ["window", "byte_level"]


def detokenizer(tok, kind: str, prompt: str = "hi", *, skip: bool = True, stop: list[str] | None = None,
                keep_stop: bool = False):
    """The generic two-decode detokenizer ("window") or the byte table's ("byte_level")."""
    if kind == "window":
        return IncrementalDetokenizer(tok, tok(prompt).input_ids, skip_special_tokens=skip, stop=stop or [],
                                      keep_stop=keep_stop)
    made = Detokenizers(tok)
    assert made.byte_level
    return made.new(tok(prompt).input_ids, skip_special_tokens=skip, stop=stop or [], keep_stop=keep_stop)


def stream(tok, text: str, stop: list[str], kind: str = "window") -> tuple[list[str], str, bool]:
    d = detokenizer(tok, kind, "say:", stop=stop)
    pieces = []
    for t in tok(text).input_ids:
        pieces.append(d.add(t))
        if d.stopped:
            return pieces, "".join(pieces), True
    pieces.append(d.finish())
    return pieces, "".join(pieces), False


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    ("text", "stop", "want", "stopped"),
    [
        ("hello world", ["lo w"], "hel", True),
        ("hello world", ["o"], "hell", True),
        ("hello world", ["d"], "hello worl", True),
        ("hello world", ["worlds"], "hello world", False),
        ("hello world", ["xyz", "wor", "ll"], "he", True),
        ("hello hello world", ["hello w"], "hello ", True),
        ("aab", ["ab"], "a", True),
        ("The capital of France is Paris.", ["Paris!", "France is P"], "The capital of ", True),
        ("héllo wörld", ["ö"], "héllo w", True),
        ("héllo wörld", ["öx"], "héllo wörld", False),
    ],
)
def test_detokenizer_stop_strings(tokenizer, text, stop, want, stopped, kind):
    pieces, got, was_stopped = stream(tokenizer, text, stop, kind)
    assert got == want and was_stopped == stopped
    acc = ""
    for p in pieces:
        acc += p
        assert want.startswith(acc)
        assert not any(s in acc for s in stop)


@pytest.mark.parametrize("kind", KINDS)
def test_detokenizer_stop_strings_on_long_text_against_a_plain_search(tokenizer, kind):
    """Random stop strings (pieces of a long text, or not in it) against the plain answer:
    the text up to the first stop string (the longest one starting there), held back as it
    streams; the text the detokenizer keeps stays short however long the output grows."""
    words = ["hello", "world,", "radix", "attention", "The", "capital", "of", "France", "is", "Paris.", "é"]
    g = torch.Generator().manual_seed(2)
    for _ in range(30):
        text = " ".join(words[i] for i in torch.randint(0, len(words), (120,), generator=g).tolist())
        stops = []
        for _ in range(int(torch.randint(1, 4, (1,), generator=g))):
            a = int(torch.randint(200, len(text) - 8, (1,), generator=g))
            stops.append(text[a : a + int(torch.randint(1, 8, (1,), generator=g))])
        stops.append("zzz")
        ids = tokenizer(text).input_ids
        full = decode(tokenizer, ids)
        hits = [(i, -len(s)) for s in stops if (i := full.find(s)) >= 0]
        cut, _ = min(hits)
        d = detokenizer(tokenizer, kind, "say:", stop=stops)
        got, longest = "", 0
        for t in ids:
            got += d.add(t)
            longest = max(longest, len(d.text))
            assert not any(s in got for s in stops)
            if d.stopped:
                break
        assert d.stopped and got == full[:cut], (stops, got, full[:cut])
        assert longest < 40  # a few tokens' text plus max(len(stop)) - 1, not the whole output


@pytest.mark.parametrize("kind", KINDS)
def test_detokenizer_flushes_an_incomplete_character_at_finish(tokenizer, kind):
    ids = tokenizer("é").input_ids
    assert len(ids) == 2  # two byte tokens: the first alone is half a character
    d = detokenizer(tokenizer, kind)
    assert d.add(ids[0]) == ""
    assert d.finish() == decode(tokenizer, ids[:1])  # "\ufffd", not dropped
    d = detokenizer(tokenizer, kind)
    assert d.add(ids[0]) + d.add(ids[1]) + d.finish() == "é"


@pytest.mark.parametrize("kind", KINDS)
def test_detokenizer_matches_decode_of_random_tokens(tokenizer, kind):
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        ids = torch.randint(2, 256, (12,), generator=g).tolist()
        d = detokenizer(tokenizer, kind)
        out = "".join(d.add(t) for t in ids) + d.finish()
        assert out == decode(tokenizer, ids)


@pytest.mark.parametrize("skip", [True, False])
def test_byte_table_text_is_the_tokenizers_decode(tokenizer, skip):
    """Every id (special ones, lone bytes of multi-byte characters, ids past the vocabulary)
    in random order: the byte table's text is exactly ``decode`` of the ids, whole and as
    each prefix grows."""
    from tokenizers import AddedToken

    tok = copy.deepcopy(tokenizer)
    # added tokens decode through the byte alphabet too: "é" is its byte 0xe9 (invalid alone),
    # while one with a space is its own UTF-8
    tok.add_tokens([AddedToken("héllo wörld", special=False), AddedToken("<spé>", special=True)])
    size = len(tok)
    g = torch.Generator().manual_seed(1)
    for _ in range(40):
        ids = torch.randint(0, size + 3, (24,), generator=g).tolist()
        d = detokenizer(tok, "byte_level", skip=skip)
        acc = ""
        for n, t in enumerate(ids, 1):
            acc += d.add(t)
            assert tok.decode(ids[:n], skip_special_tokens=skip).startswith(acc)
        acc += d.finish()
        assert acc == tok.decode(ids, skip_special_tokens=skip)


def test_other_decoders_keep_the_window_detokenizer():
    """A SentencePiece-style tokenizer (Metaspace: "▁" for a space, dropped at the start of a
    text) gets no byte table; its output text is what ``decode`` adds to the prompt's, the
    output's word-initial space kept."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Metaspace()
    raw.decoder = decoders.Metaspace()
    raw.train_from_iterator(["hello world, the capital of France is Paris"] * 5,
                            trainers.BpeTrainer(vocab_size=80, special_tokens=["<unk>", "<eos>"], show_progress=False))
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<eos>", unk_token="<unk>")
    made = Detokenizers(tok)
    assert not made.byte_level
    prompt, ids = tok("hello").input_ids, tok("the capital of France").input_ids
    d = made.new(prompt, skip_special_tokens=True, stop=[])
    assert isinstance(d, IncrementalDetokenizer)
    text = "".join(d.add(t) for t in ids) + d.finish()
    assert text == " the capital of France" == decode(tok, prompt + ids)[len(decode(tok, prompt)):]


def test_a_byte_table_that_disagrees_with_decode_is_not_used(tokenizer, monkeypatch):
    """The build-time check: an alphabet read wrongly (two bytes swapped) turns the table off."""
    from radixd.core import detokenizer as mod

    right = mod.byte_alphabet()
    assert mod.byte_tables(tokenizer) is not None
    wrong = {c: {0x61: 0x62, 0x62: 0x61}.get(b, b) for c, b in right.items()}
    monkeypatch.setattr(mod, "byte_alphabet", lambda: wrong)
    assert mod.byte_tables(tokenizer) is None
    assert not Detokenizers(tokenizer).byte_level
