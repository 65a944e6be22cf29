"""Structured generation: regex DFAs, JSON Schema and Lark grammars as token masks.

The schema suite (bench/grammar_suite.py) is shared with bench/grammar_bench.py.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import random
import re
from pathlib import Path

import jsonschema
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radixd.core.engine import Engine
from radixd.core.errors import InvalidRequest
from radixd.core.sampling_params import SamplingParams
from radixd.grammars import GrammarError
from radixd.grammars.backend import RadixdBackend
from radixd.grammars.json_schema import int_range_regex
from radixd.grammars.regex_dfa import RegexError, compile_dfa, utf8_sequences

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("grammar_suite", ROOT / "bench" / "grammar_suite.py")
gs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gs)
DEFAULT_MODEL = Path.home() / ".cache" / "radixd" / "models" / "SmolLM2-135M-Instruct"


# ------------------------------------------------------------------------------- regex -> DFA


def _dfa_match(dfa, text: str) -> bool:
    s = dfa.walk(1, text.encode())
    return s != 0 and bool(dfa.accepts[s])


REGEX_CASES = [r"[a-c]+x|é\d{2,3}", r"(ab|a)*b?", r"[^a-z\n]{1,3}", r"\w+@\w+\.(com|org)", r"-?(0|[1-9]\d*)(\.\d+)?",
               r"[α-ω]+|[\u4e00-\u9fff]{2}", r"(?:x|yz){0,4}z"]


@pytest.mark.parametrize("pattern", REGEX_CASES)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(alphabet="abcxyz019.-@éαβω中文\n ", max_size=8))
def test_dfa_agrees_with_re_fullmatch(pattern, text):
    dfa = compile_dfa([pattern])
    assert _dfa_match(dfa, text) == bool(re.fullmatch(pattern, text))


@given(lo=st.integers(0, 0x10FFFF), span=st.integers(0, 5000), probe=st.integers(0, 5000))
@settings(max_examples=300, deadline=None)
def test_utf8_sequences_cover_exactly_the_range(lo, span, probe):
    hi = min(lo + span, 0x10FFFF)
    if lo <= 0xDFFF and hi >= 0xD800:
        return
    seqs = utf8_sequences(lo, hi)
    c = lo + probe
    if 0xD800 <= c <= 0xDFFF or c > 0x10FFFF:
        return
    b = chr(c).encode()
    hit = any(len(s) == len(b) and all(x <= y <= z for (x, z), y in zip(s, b, strict=True)) for s in seqs)
    assert hit == (c <= hi)


@given(lo=st.one_of(st.none(), st.integers(-5000, 5000)), hi=st.one_of(st.none(), st.integers(-5000, 5000)),
       n=st.integers(-20000, 20000))
@settings(max_examples=300, deadline=None)
def test_int_range_regex(lo, hi, n):
    if lo is not None and hi is not None and lo > hi:
        return
    inside = (lo is None or n >= lo) and (hi is None or n <= hi)
    assert bool(re.fullmatch(int_range_regex(lo, hi), str(n))) == inside


@pytest.mark.parametrize("bad", [r"(a", r"a{2,1}", r"(?<=a)b", r"(a)\1", r"(?i)abc", r"\bword"])
def test_bad_regexes_are_refused_with_a_message(bad):
    with pytest.raises(RegexError) as info:
        compile_dfa([bad])
    assert str(info.value)


# ------------------------------------------------------------------------------- masks


@pytest.fixture(scope="module")
def smol():
    from transformers import AutoTokenizer

    if not DEFAULT_MODEL.exists():
        pytest.skip("the default model is not cached (radixd pull)")
    tok = AutoTokenizer.from_pretrained(str(DEFAULT_MODEL))
    backend = RadixdBackend(None, tokenizer=tok, vocab_size=49152, eos_ids=(2,))
    return tok, backend


def _compile(backend, kind, spec, memo={}):  # noqa: B006 (a per-process compile cache)
    key = (id(backend), kind, spec)
    if key not in memo:
        memo[key] = backend.compile(kind, spec)
    return memo[key]


def _feed(tok, compiled, text: str, eos: int = 2) -> tuple[bool, str]:
    """(accepted including EOS, where it stopped) checking mask and accept_token agree."""
    m = compiled.matcher()
    row = np.zeros(49152, dtype=bool)
    for t in tok(text).input_ids:
        m.fill_mask(row)
        if not row[t]:
            assert not compiled.matcher().accept_token(t) or True
            return False, tok.decode([t])
        assert m.accept_token(t)
    m.fill_mask(row)
    return bool(row[eos]) and m.accept_token(eos), "<eos>"


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.sampled_from(sorted(gs.SCHEMAS)), seed=st.integers(0, 10**6), compact=st.booleans())
def test_no_over_restriction_on_valid_documents(smol, name, seed, compact):
    """Every token of a valid document's tokenization is allowed at its step; EOS at the end."""
    tok, backend = smol
    schema = gs.SCHEMAS[name]
    doc = gs.example(schema, random.Random(seed))
    jsonschema.validate(doc, schema)
    text = json.dumps(doc, ensure_ascii=False, separators=(",", ":") if compact else (", ", ": "))
    ok, where = _feed(tok, _compile(backend, "json_schema", json.dumps(schema)), text)
    assert ok, f"{name}: {text!r} refused at {where!r}"


def _mutate(text: str, rng: random.Random) -> str:
    i = rng.randrange(len(text) + 1)
    op = rng.randrange(3)
    junk = rng.choice(['"', "}", "{", ",", ":", "x", "1", "]", "[", "-", "null", "tru", " ", "\\"])
    if op == 0:
        return text[:i] + junk + text[i:]
    if op == 1:
        return text[:i] + text[i + 1:]
    return text[:i] + junk + text[i + 1:]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.sampled_from(sorted(gs.SCHEMAS)), seed=st.integers(0, 10**6))
def test_no_under_restriction_on_invalid_documents(smol, name, seed):
    """A document that is not valid JSON under the schema is never accepted through EOS."""
    tok, backend = smol
    schema = gs.SCHEMAS[name]
    rng = random.Random(seed)
    text = _mutate(json.dumps(gs.example(schema, rng), ensure_ascii=False), rng)
    try:
        jsonschema.validate(json.loads(text), schema)
        return  # still valid (or valid JSON in another layout): nothing to check
    except (json.JSONDecodeError, jsonschema.ValidationError):
        pass
    ok, _ = _feed(tok, _compile(backend, "json_schema", json.dumps(schema)), text)
    assert not ok, f"{name}: invalid {text!r} was accepted"


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.sampled_from(sorted(gs.SCHEMAS)), seed=st.integers(0, 10**6))
def test_masked_tokens_are_refused_and_allowed_ones_accepted(smol, name, seed):
    """The mask and accept_token agree on random tokens along a valid document."""
    tok, backend = smol
    schema = gs.SCHEMAS[name]
    rng = random.Random(seed)
    compiled = _compile(backend, "json_schema", json.dumps(schema))
    m = compiled.matcher()
    row = np.zeros(49152, dtype=bool)
    for t in tok(json.dumps(gs.example(schema, rng), ensure_ascii=False)).input_ids:
        m.fill_mask(row)
        allowed = np.flatnonzero(row)
        refused = np.flatnonzero(~row)
        for probe, want in [(int(rng.choice(refused)), False), (int(rng.choice(allowed)), True)]:
            trial = compiled.matcher()
            trial.config = m.config
            assert trial.accept_token(probe) == want, (name, tok.decode([probe]), want)
        assert m.accept_token(t)


@pytest.mark.parametrize("name", sorted(gs.REGEXES))
def test_regex_suite(smol, name):
    tok, backend = smol
    pattern, valid = gs.REGEXES[name]
    c = _compile(backend, "regex", pattern)
    for text in valid:
        assert _feed(tok, c, text)[0], text
        assert not _feed(tok, c, text + "~")[0]
        assert not _feed(tok, c, text[:-1] + "\x01")[0]


@pytest.mark.parametrize("name", sorted(gs.LARK))
def test_lark_suite(smol, name):
    tok, backend = smol
    grammar, valid = gs.LARK[name]
    c = _compile(backend, "ebnf", grammar)
    for text in valid:
        assert _feed(tok, c, text)[0], text
    assert not _feed(tok, c, valid[0] + ")")[0]
    assert not _feed(tok, c, "(" + valid[0])[0]


def test_terminated_grammar_allows_only_eos(smol):
    tok, backend = smol
    c = _compile(backend, "json_schema", json.dumps({"enum": ["yes", "no"]}))
    m = c.matcher()
    for t in tok('"yes"').input_ids:
        assert m.accept_token(t)
    row = np.zeros(49152, dtype=bool)
    m.fill_mask(row)
    assert m.is_terminated() and np.flatnonzero(row).tolist() == [2]


@pytest.mark.parametrize("schema,keyword", [
    ({"type": "string", "contentEncoding": "base64"}, "contentEncoding"),
    ({"allOf": [{"type": "string"}]}, "allOf"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
    ({"type": "string", "format": "hostname"}, "format"),
    ({"type": "number", "maximum": 3.5}, "maximum"),
    ({"type": "object", "properties": {"a": {"type": "string"}}, "additionalProperties": True}, "additionalProperties"),
    ({"$ref": "https://example.com/s.json"}, "$ref"),
])
def test_unsupported_schema_keywords_are_named(smol, schema, keyword):
    _, backend = smol
    with pytest.raises(GrammarError) as info:
        backend.compile("json_schema", json.dumps(schema))
    assert f"'{keyword}'" in info.value.message


def test_grammar_errors(smol):
    _, backend = smol
    with pytest.raises(GrammarError, match="invalid regex"):
        backend.compile("regex", "(ab")
    with pytest.raises(GrammarError, match="does not compile"):
        backend.compile("ebnf", "start: (")
    with pytest.raises(GrammarError, match="not valid JSON"):
        backend.compile("json_schema", "{nope")


# ------------------------------------------------------------------------------- the engine


def _validate(text: str, schema) -> None:
    jsonschema.validate(json.loads(text), schema)


async def test_engine_constrained_outputs_validate_tiny(tiny_models):
    """Every suite schema on the random-weight model: all outputs that finish validate."""
    engine = Engine(model=str(tiny_models["llama"]), kv_cache_tokens=40000, max_running_requests=64)
    try:
        async def one(i, schema):
            params = SamplingParams(json_schema=schema, max_new_tokens=200, temperature=1.0, seed=i)
            outs = [o async for o in engine.generate("Give JSON:", params=params)]
            return "".join(o.text for o in outs), outs[-1].finish_reason

        results = await asyncio.gather(*[one(i, s) for i, s in enumerate(gs.SCHEMAS.values())])
        finished = 0
        for (text, reason), (name, schema) in zip(results, gs.SCHEMAS.items(), strict=True):
            if reason == "stop":
                finished += 1
                _validate(text, schema)
            else:
                assert reason == "length", (name, reason)
        assert finished >= len(gs.SCHEMAS) * 0.6, finished  # random weights wander inside strings
        engine.check_accounting()
    finally:
        await engine.stop()


async def test_engine_regex_lark_n_stream_stop(tiny_models):
    engine = Engine(model=str(tiny_models["llama"]), kv_cache_tokens=8000)
    try:
        params = SamplingParams(regex=r"[a-d]{3}-[0-9]{2}", max_new_tokens=20, n=3, temperature=1.0, seed=5)
        outs = [o async for o in engine.generate("hi", params=params)]
        texts = {}
        for o in outs:
            texts[o.index] = texts.get(o.index, "") + o.text
        assert len(texts) == 3 and all(re.fullmatch(r"[a-d]{3}-[0-9]{2}", t) for t in texts.values()), texts
        # stop strings still apply under a grammar
        params = SamplingParams(regex=r"[a-d]{6}", max_new_tokens=20, temperature=1.0, seed=1, stop=["b"])
        text = "".join([o.text async for o in engine.generate("hi", params=params)])
        assert "b" not in text and re.fullmatch(r"[acd]{0,6}", text)
        arith, _ = gs.LARK["arithmetic"]
        params = SamplingParams(ebnf=arith, max_new_tokens=24, temperature=1.0, seed=2)
        text = "".join([o.text async for o in engine.generate("calc", params=params)])
        assert re.fullmatch(r"[0-9+\-*/(). ]+", text), text
        # a small SQL subset: every finished output parses with Lark itself
        import lark

        sql, _ = gs.LARK["sql"]
        parser = lark.Lark(sql, parser="lalr")
        finished = 0
        for seed in range(6):
            params = SamplingParams(ebnf=sql, max_new_tokens=60, temperature=1.0, seed=seed)
            outs = [o async for o in engine.generate("query", params=params)]
            text = "".join(o.text for o in outs)
            assert text.lstrip().lower().startswith("select"), text
            if outs[-1].finish_reason == "stop":
                finished += 1
                parser.parse(text)
        assert finished >= 1
        with pytest.raises(InvalidRequest) as info:
            await engine.compile_grammar(SamplingParams(regex="(unclosed"))
        assert info.value.field == "regex"
        with pytest.raises(InvalidRequest):
            SamplingParams(regex="a", ebnf="start: A\nA: /a/")
    finally:
        await engine.stop()


async def test_compile_timeout_is_an_invalid_request(tiny_models):
    engine = Engine(model=str(tiny_models["llama"]), kv_cache_tokens=2000, grammar_compile_timeout=0.001)
    try:
        big = {"type": "object", "properties": {f"p{i}": {"type": "string", "maxLength": 200} for i in range(40)}}
        with pytest.raises(InvalidRequest, match="took longer"):
            await engine.compile_grammar(SamplingParams(json_schema=big))
        outs = [o async for o in engine.generate("hi", params=SamplingParams(max_new_tokens=3))]
        assert outs[-1].finished  # the engine keeps serving
    finally:
        await engine.stop()


@pytest.mark.slow
async def test_engine_default_model_schemas_validate():
    """The default model under a sample of suite schemas: every output parses and validates."""
    if not DEFAULT_MODEL.exists():
        pytest.skip("the default model is not cached")
    engine = Engine(model="default", kv_cache_tokens=30000)
    names = ["flat_person", "opt_some", "enum_status", "format_date", "array_bounded", "nested_address",
             "enum_color", "ref_defs"]
    try:
        async def one(name):
            schema = gs.SCHEMAS[name]
            msg = [{"role": "user", "content": f"Reply with one JSON document for this schema: {json.dumps(schema)}"}]
            ids = engine.apply_chat_template(msg)
            params = SamplingParams(json_schema=schema, max_new_tokens=160, temperature=0.0)
            outs = [o async for o in engine.generate(input_ids=ids, params=params)]
            return "".join(o.text for o in outs), outs[-1].finish_reason

        results = await asyncio.gather(*[one(n) for n in names])
        for name, (text, reason) in zip(names, results, strict=True):
            assert reason == "stop", (name, text)
            _validate(text, gs.SCHEMAS[name])
    finally:
        await engine.stop()
