"""Closing constrained outputs within max_tokens (radixd/grammars/budget.py): the cost of a
configuration against a brute-force search, per-token costs against stepping, a filter that
never empties a mask, and every suite schema completing on the random-weight model when
max_tokens is just enough."""

from __future__ import annotations

import asyncio
import json
import random
import re

import jsonschema
import numpy as np
import pytest
from conftest import grammar_suite

from radixd import Engine
from radixd.core.sampling_params import SamplingParams
from radixd.grammars.automaton import TokenGrammar
from radixd.grammars.budget import INF, Budget, ClosingMatcher, ClosingShared
from radixd.grammars.json_schema import schema_to_lark
from radixd.grammars.lark_grammar import compile_lark
from radixd.grammars.lexers import Terminal
from radixd.grammars.parsers import SingleTerminalParser
from radixd.grammars.vocab import TokenizerInfo

gs = grammar_suite()

MULTI = [b'{"', b'":', b'",', b'"}', b'}]', b'[{', b'ab', b'abc', b'12', b'0.', b'true', b'null', b'":"', b' (', b'1+',
         b'xy', b'-0', b'"a', b'SELECT', b' FROM', b'  ']


def _vocab(missing: bytes = b"") -> TokenizerInfo:
    """EOS (id 0), the single bytes except ``missing``, and some multi-byte tokens."""
    toks = [None] + [bytes([b]) for b in range(256) if b not in missing] + MULTI
    return TokenizerInfo(toks, len(toks), (0,))


def _grammar(kind: str, spec: str, vocab: TokenizerInfo) -> TokenGrammar:
    if kind == "regex":
        return TokenGrammar([Terminal("REGEX", spec)], SingleTerminalParser(), vocab)
    if kind == "json_schema":
        return compile_lark(schema_to_lark(json.dumps(spec), 2), vocab)
    return compile_lark(spec, vocab)


def _brute(g: TokenGrammar, config, byte_ok: np.ndarray, limit: int = 40) -> int:
    """Breadth first over single bytes: fewest bytes to a finished configuration, or to one
    that may end plus the EOS."""
    best, seen, frontier, d = INF, {config}, [config], 0
    byte_list = [bytes([b]) for b in np.flatnonzero(byte_ok).tolist()]
    while frontier and d < best and d <= limit:
        for c in frontier:
            if g.finished(c):
                best = min(best, d)
            elif g.end_ok(c):
                best = min(best, d + 1)
        nxt = []
        for c in frontier:
            for b in byte_list:
                n = g.advance(c, b)
                if n is not None and n not in seen:
                    seen.add(n)
                    nxt.append(n)
        frontier, d = nxt, d + 1
    return best


SMALL = [
    ("regex", r"[a-c]{2,4}x(yz)?"),
    ("regex", r"-?(0|[1-9][0-9]*)(\.[0-9]+)?"),
    ("regex", r"(ab|abc)+d?"),
    ("json_schema", {"type": "object", "properties": {"a": {"type": "string"}, "n": {"type": "integer"}},
                     "required": ["a", "n"]}),
    ("json_schema", {"type": "array", "items": {"enum": ["xy", 12, True]}, "minItems": 1, "maxItems": 3}),
    ("json_schema", {"type": "object", "properties": {"k": {"anyOf": [{"type": "null"}, {"type": "number"}]}},
                     "required": []}),
    ("ebnf", gs.LARK["arithmetic"][0]),
]


def _walk_configs(g: TokenGrammar, rng: random.Random, steps: int = 14, walks: int = 6) -> list:
    """Configurations along random token walks (allowed tokens only)."""
    out = [g.start]
    for _ in range(walks):
        c = g.start
        for _ in range(steps):
            allowed, terminated = g.mask(c)
            if terminated:  # (trailing whitespace is not offered)
                break
            allowed = allowed.copy()
            allowed[g.eos] = False
            ids = np.flatnonzero(allowed)
            if not ids.size:
                break
            c = g.step(c, int(rng.choice(ids)))
            out.append(c)
    return out


@pytest.mark.parametrize("kind,spec", SMALL, ids=[f"{k}{i}" for i, (k, _) in enumerate(SMALL)])
@pytest.mark.parametrize("missing", [b"", b'"x'], ids=["all-bytes", "no-quote-token"])
def test_cost_equals_brute_force(kind, spec, missing):
    vocab = _vocab(missing)
    g = _grammar(kind, spec, vocab)
    shared = ClosingShared(vocab)
    budget = Budget(g, shared)
    for c in _walk_configs(g, random.Random(7)):
        assert budget.cost(c) == _brute(g, c, shared.byte_ok), c
    assert budget.capped == 0


@pytest.mark.parametrize("kind,spec", SMALL, ids=[f"{k}{i}" for i, (k, _) in enumerate(SMALL)])
def test_token_costs_agree_with_stepping_and_completion_replays(kind, spec):
    vocab = _vocab()
    g = _grammar(kind, spec, vocab)
    budget = Budget(g, ClosingShared(vocab))
    for c in _walk_configs(g, random.Random(3), walks=3):
        allowed, terminated = g.mask(c)
        if terminated:
            continue
        allowed = allowed.copy()
        allowed[g.eos] = False
        costs = budget.token_costs(c)
        for t in range(vocab.vocab_size):
            nxt = g.step(c, t) if vocab.token_bytes[t] else None
            if nxt is None:
                assert costs[t] == INF and not allowed[t], t
            else:
                assert allowed[t] and costs[t] == budget.cost(nxt), (c, vocab.token_bytes[t])
        done = budget.completion(c)
        assert done is not None
        data, needs_eos = done
        end = g.advance(c, data)
        assert len(data) + needs_eos == budget.cost(c)
        assert end is not None and (g.end_ok(end) if needs_eos else g.finished(end))


@pytest.mark.parametrize("kind,spec", SMALL, ids=[f"{k}{i}" for i, (k, _) in enumerate(SMALL)])
def test_filter_never_empties_a_mask_and_closes_in_time(kind, spec):
    """Random walks under random budgets: a mask is never emptied, and with a budget of at
    least the shortest document every walk ends complete within it."""
    vocab = _vocab()
    g = _grammar(kind, spec, vocab)
    budget = Budget(g, ClosingShared(vocab))
    need = budget.cost(g.start)
    rng = random.Random(11)
    row = np.zeros(vocab.vocab_size, dtype=bool)
    for trial in range(30):
        max_tokens = rng.randint(max(1, need - 2), need + 6)
        m = ClosingMatcher(g, budget)
        ended = False
        for used in range(max_tokens):
            m.fill_mask_within(row, max_tokens - used)
            assert row.any() == g.mask(m.config)[0].any()
            assert not (row & ~g.mask(m.config)[0]).any()  # a subset of the grammar's mask
            tok = int(rng.choice(np.flatnonzero(row)))
            assert m.accept_token(tok)
            if m.is_terminated():
                ended = True
                break
        if max_tokens >= need:
            assert ended, (trial, max_tokens, need)


def test_a_search_past_its_node_cap_falls_back_to_an_upper_bound():
    """Deep inside a recursive grammar with a tiny node cap: the cost is an upper bound (a
    real completion) or INF, never cached as exact, and the filter still keeps tokens."""
    vocab = _vocab()
    g = _grammar("ebnf", gs.LARK["arithmetic"][0], vocab)
    exact = Budget(g, ClosingShared(vocab))
    capped = Budget(g, ClosingShared(vocab), node_cap=1)
    c = g.advance(g.start, b"((1+(2*(3")
    want = exact.cost(c)
    got = capped.cost(c)
    assert capped.capped > 0 and got >= want and want < INF
    if got < INF:  # an upper bound is a real completion's length
        assert capped.completion(c) is None or len(capped.completion(c)[0]) >= want
    row = np.zeros(vocab.vocab_size, dtype=bool)
    m = ClosingMatcher(g, capped)
    m.config = c
    for left in (1, want, want + 3):
        m.fill_mask_within(row, left)
        assert row.any()


def test_a_closing_matcher_without_budget_is_the_plain_mask():
    vocab = _vocab()
    g = _grammar("json_schema", SMALL[3][1], vocab)
    m = ClosingMatcher(g, Budget(g, ClosingShared(vocab)))
    plain, within = np.zeros(vocab.vocab_size, dtype=bool), np.zeros(vocab.vocab_size, dtype=bool)
    m.fill_mask(plain)
    m.fill_mask_within(within, 10_000)
    assert (plain == within).all() and plain.sum() > 5
    m.fill_mask_within(within, budget_needed := m.budget.cost(g.start))
    assert within.sum() < plain.sum() and budget_needed == len(b'{"a":"","n":0}')


# ------------------------------------------------------------------------------- the engine


def _texts(outs) -> dict[int, str]:
    texts: dict[int, str] = {}
    for o in outs:
        texts[o.index] = texts.get(o.index, "") + o.text
    return texts


async def test_every_suite_schema_closes_within_max_tokens(tiny_models):
    """The random-weight model (it wanders inside strings) with max_tokens just above each
    schema's shortest document: every output, greedy and sampled, n = 2, parses and validates."""
    engine = Engine(model=str(tiny_models["llama"]), kv_cache_tokens=40000, max_running_requests=64)
    try:
        async def one(i, name, schema):
            compiled = await engine.compile_grammar(SamplingParams(json_schema=schema))
            need = compiled.budget.cost(compiled.grammar.start)
            sampled = i % 2 == 1
            params = SamplingParams(json_schema=schema, max_new_tokens=need + i % 4, n=2,
                                    temperature=1.0 if sampled else 0.0, seed=i)
            outs = [o async for o in engine.generate("Give JSON:", params=params)]
            reasons = {o.index: o.finish_reason for o in outs if o.finished}
            return name, need, _texts(outs), reasons

        results = await asyncio.gather(*[one(i, n, s) for i, (n, s) in enumerate(gs.SCHEMAS.items())])
        for name, need, texts, reasons in results:
            assert len(texts) == 2, name
            for k, text in texts.items():
                assert reasons[k] == "stop", (name, need, text)
                jsonschema.validate(json.loads(text), gs.SCHEMAS[name])
        engine.check_accounting()
    finally:
        await engine.stop()


async def test_regex_and_lark_close_and_the_switch_turns_it_off(tiny_models):
    import lark

    engine = Engine(model=str(tiny_models["llama"]), kv_cache_tokens=8000)
    off = Engine(model=str(tiny_models["llama"]), kv_cache_tokens=8000, grammar_close_within_max_tokens=False)
    try:
        pattern = r"[a-d]{2,}-[0-9]+(\.[0-9]+)?"
        for seed in range(4):
            params = SamplingParams(regex=pattern, max_new_tokens=5, temperature=1.0, seed=seed)
            outs = [o async for o in engine.generate("hi", params=params)]
            text = "".join(o.text for o in outs)
            assert re.fullmatch(pattern, text) and outs[-1].finish_reason == "stop", text
        arith, _ = gs.LARK["arithmetic"]
        sql, _ = gs.LARK["sql"]
        for grammar, budget in ((arith, 6), (sql, 40)):
            parser = lark.Lark(grammar, parser="lalr")
            for seed in range(3):
                params = SamplingParams(ebnf=grammar, max_new_tokens=budget, temperature=1.0, seed=seed)
                outs = [o async for o in engine.generate("calc", params=params)]
                text = "".join(o.text for o in outs)
                assert outs[-1].finish_reason == "stop", text
                parser.parse(text)
        # switched off: the same short budget cuts random-weight outputs (the old behaviour)
        schema = gs.SCHEMAS["flat_person"]
        cut = 0
        for seed in range(6):
            params = SamplingParams(json_schema=schema, max_new_tokens=24, temperature=1.0, seed=seed)
            outs = [o async for o in off.generate("Give JSON:", params=params)]
            cut += outs[-1].finish_reason == "length"
        assert cut >= 1
    finally:
        await engine.stop()
        await off.stop()


def test_matchers_without_the_capability_get_the_plain_mask():
    """An outside backend's matcher (no ``fill_mask_within``) is masked as before."""
    from types import SimpleNamespace

    from radixd.core.constraints import Constraints

    class Plain:
        def fill_mask(self, out):
            out[:] = False
            out[3] = True

    class Within(Plain):
        def fill_mask_within(self, out, tokens_left):
            out[:] = False
            out[tokens_left] = True

    params = SimpleNamespace(max_new_tokens=9)
    reqs = [SimpleNamespace(finish_reason=None, matcher=m, params=params, prompt_ids=[1, 2], num_output=4)
            for m in (Plain(), Within())]
    for close, want in ((True, 5), (False, 3)):
        rows = Constraints(vocab_size=8, context_len=100, close_within=close).fill_masks(2, list(enumerate(reqs)))
        assert np.flatnonzero(rows[0]).tolist() == [3]
        assert np.flatnonzero(rows[1]).tolist() == [want]
