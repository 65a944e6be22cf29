"""Structured generation: regex DFAs, JSON Schema and Lark grammars as token masks.

The schema suite (benchmarks/grammar_suite.py) is shared with benchmarks/grammar_bench.py.
"""

from __future__ import annotations

import asyncio
import functools
import json
import random
import re
from decimal import Decimal
from pathlib import Path

import jsonschema
import numpy as np
import pytest
from conftest import grammar_suite
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from radixd import Engine
from radixd.core.errors import InvalidRequest
from radixd.core.sampling_params import SamplingParams
from radixd.grammars import GrammarError
from radixd.grammars.backend import RadixdBackend
from radixd.grammars.json_schema import SchemaError, SchemaGrammar
from radixd.grammars.regex_dfa import RegexError, compile_dfa, utf8_sequences
from radixd.grammars.schema_numbers import int_range_regex, multiple_regex, number_range_regex

gs = grammar_suite()
DEFAULT_MODEL = Path.home() / ".cache" / "radixd" / "models" / "SmolLM2-135M-Instruct"


# ------------------------------------------------------------------------------- regex -> DFA


def _dfa_match(dfa, text: str) -> bool:
    s = dfa.walk(1, text.encode())
    return s != 0 and bool(dfa.accepts[s])


REGEX_CASES = [r"[a-c]+x|é\d{2,3}", r"(ab|a)*b?", r"[^a-z\n]{1,3}", r"\w+@\w+\.(com|org)", r"-?(0|[1-9]\d*)(\.\d+)?",
               r"[α-ω]+|[\u4e00-\u9fff]{2}", r"(?:x|yz){0,4}z",
               # look-aheads to the end of the text: intersections and differences
               r"(?=[a-z]{2,4}\Z)[a-c]+x?", r"(?![0-9]+\Z)[0-9a-c]{1,3}", r"x(?=.*1\Z)(?!.*0.*\Z)\w*",
               r"(?:a(?=b*\Z)[bc]*|c(?!b\Z)[bc]*)|(?=9\Z|é\Z).", r"(?=\w{1,3}\Z)(?=.*z\Z)(?!yz\Z)[xyz]*"]


@pytest.mark.parametrize("pattern", REGEX_CASES)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(alphabet="abcxyz019.-@éαβω中文\n ", max_size=8))
@example(text="xé1")  # a non-ASCII letter where \w stands
def test_dfa_agrees_with_re_fullmatch(pattern, text):
    dfa = compile_dfa([pattern])
    assert _dfa_match(dfa, text) == bool(re.fullmatch(pattern, text, re.ASCII))  # \d, \w, \s are ASCII classes


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


@pytest.mark.parametrize("bad", [r"(a", r"a{2,1}", r"(?<=a)b", r"(a)\1", r"(?i)abc", r"\bword",
                                 r"(?=a)a", r"(a(?=b\Z))b", r"(?=a|b\Z)b", r"(?:a(?=b*\Z)|c)[bc]*"])
def test_bad_regexes_are_refused_with_a_message(bad):
    with pytest.raises(RegexError) as info:
        compile_dfa([bad])
    assert str(info.value)


def test_empty_intersection_leaves_no_trap_state():
    dfa = compile_dfa([r"x(?=ab\Z)[cd]*"])
    assert dfa.walk(1, b"x") == 0 and not any(dfa.accepts)


_DEC = st.one_of(st.none(), st.decimals(-200, 200, places=2))


@given(lo=_DEC, hi=_DEC, ls=st.booleans(), hs=st.booleans(), sign=st.sampled_from(["", "-"]), whole=st.integers(0, 300),
       frac=st.one_of(st.just(""), st.text("0123456789", min_size=1, max_size=4)))
@settings(max_examples=400, deadline=None)
def test_number_range_regex(lo, hi, ls, hs, sign, whole, frac):
    if lo is not None and hi is not None and lo > hi:
        return
    text = f"{sign}{whole}" + (f".{frac}" if frac else "")
    v = Decimal(text)
    inside = (lo is None or (v > lo if ls else v >= lo)) and (hi is None or (v < hi if hs else v <= hi))
    dfa = compile_dfa([number_range_regex(lo, ls, hi, hs)])
    if not (v == 0 and sign == "-" and inside):  # -0 is 0, written 0: not generating "-0" is fine
        assert _dfa_match(dfa, text) == inside, (lo, ls, hi, hs, text)
    if lo is not None or hi is not None:  # bounded numbers are written without an exponent
        assert not _dfa_match(dfa, text + "e0")


def _escape_all(text: str) -> str:
    return "".join(f"\\u{ord(c):04X}" if ord(c) <= 0xFFFF else c for c in text)


@functools.cache
def _extra_key_dfas():
    declared, patterns = ["a", "ba", "é-"], {"^x": {"type": "integer"}, "b$": {"type": "string"}}
    g = SchemaGrammar({"type": "object", "properties": {k: {} for k in declared}, "patternProperties": patterns,
                       "additionalProperties": {"type": "boolean"}}, 2)
    g.build()
    firsts = [rx for rx in g.terminals if rx.startswith(('"(?=', '"(?!'))]  # extra keys, first in an object
    return declared, patterns, [compile_dfa([rx]) for rx in firsts]


@given(key=st.text(alphabet='abxé-"\\\n/😀', max_size=4), spelling=st.sampled_from(["ascii", "utf8", "escaped"]))
@settings(max_examples=300, deadline=None)
def test_extra_key_terminals_classify_decoded_keys(key, spelling):
    """The extra-key terminals of an object: never a declared name in any spelling; a key
    sorted to a pattern matches it and no other; the rest match no pattern."""
    declared, patterns, firsts = _extra_key_dfas()
    assert len(firsts) == 3
    text = {"ascii": json.dumps(key), "utf8": json.dumps(key, ensure_ascii=False),
            "escaped": '"' + _escape_all(key) + '"'}[spelling]
    hits = [i for i, dfa in enumerate(firsts) if _dfa_match(dfa, text)]
    assert len(hits) <= 1
    matched = [p for p in patterns if re.search(p, key)]
    if hits:
        assert key not in declared
        assert matched == ([list(patterns)[hits[0]]] if hits[0] < len(patterns) else [])
    elif key not in declared and len(matched) <= 1 and text == json.dumps(key, ensure_ascii=False) \
            and not set(key) & set('"\\\n'):
        raise AssertionError(f"the unescaped key {text} fits no class")


_BRANCH = st.fixed_dictionaries({}, optional={
    "type": st.sampled_from(["integer", "number", "string", ["number", "null"], ["string", "integer"]]),
    "minimum": st.integers(-5, 5), "maximum": st.integers(-5, 5), "exclusiveMinimum": st.integers(-5, 5),
    "exclusiveMaximum": st.floats(-5, 5).map(lambda x: round(x, 1)), "minLength": st.integers(0, 3),
    "maxLength": st.integers(0, 3), "enum": st.lists(st.sampled_from([0, 1, 2.5, -3, "a", "bb", None, True]), min_size=1),
    "properties": st.fixed_dictionaries({}, optional={"a": st.sampled_from([{"type": "integer"}, {"maximum": 1}]),
                                                      "b": st.just({"type": "string"})}),
    "required": st.lists(st.sampled_from(["a", "b"]), unique=True),
    "additionalProperties": st.sampled_from([False, True, {"type": "string"}, {"type": "integer"}]),
})
_VALUES = st.one_of(st.integers(-7, 7), st.floats(-7, 7).map(lambda x: round(x, 2)), st.text("ab", max_size=4),
                    st.none(), st.booleans(), st.fixed_dictionaries({}, optional={"a": st.integers(-2, 2), "b": st.text("x", max_size=1),
                                                           "c": st.sampled_from([1, "z"])}))


@given(branches=st.lists(_BRANCH, min_size=1, max_size=3), values=st.lists(_VALUES, min_size=1, max_size=8))
@settings(max_examples=300, deadline=None)
def test_all_of_merge_is_exact(branches, values):
    """allOf merged into one schema accepts exactly what the allOf accepts (or is refused)."""
    schema = {"allOf": branches}
    try:
        merged = SchemaGrammar(schema, 2).algebra.merge_all_of(schema, "#")
    except SchemaError as exc:
        assert exc.keyword == "allOf"
        return
    for v in values:
        assert jsonschema.Draft202012Validator(schema).is_valid(v) == jsonschema.Draft202012Validator(merged).is_valid(v), (merged, v)


def _random_branch(rng: random.Random):
    """(schema, generator of documents the grammar may write for it): a scalar or an object."""
    scalars = [({"type": "integer"}, lambda: rng.randint(-3, 3)), ({"type": "string"}, lambda: rng.choice(["a", "b", ""])),
               ({"const": "a"}, lambda: "a"), ({"const": "b"}, lambda: "b"), ({"enum": [1, 2]}, lambda: rng.choice([1, 2])),
               ({"enum": [2, 3]}, lambda: rng.choice([2, 3])), ({"type": "boolean"}, lambda: rng.random() < 0.5),
               ({"type": "null"}, lambda: None), ({"type": "number"}, lambda: rng.choice([0.5, 1, -2.25]))]
    if rng.random() < 0.4:
        return rng.choice(scalars)
    props = {n: rng.choice(scalars) for n in rng.sample(["k", "x", "y"], rng.randint(1, 3))}
    req = [n for n in props if rng.random() < 0.6]
    schema = {"type": "object", "properties": {n: p[0] for n, p in props.items()}, "required": req}
    if rng.random() < 0.3:
        schema["additionalProperties"] = False
    return schema, lambda: {n: p[1]() for n, p in props.items() if n in req or rng.random() < 0.5}


@pytest.mark.parametrize("seed", range(4))
def test_one_of_is_compiled_only_when_exclusive(seed):
    """A oneOf radixd compiles: every document a branch may generate matches exactly one
    branch (jsonschema's oneOf); the others are refused naming oneOf."""
    rng = random.Random(seed)
    compiled = 0
    for _ in range(150):
        branches = [_random_branch(rng) for _ in range(rng.randint(2, 3))]
        schema = {"oneOf": [b[0] for b in branches]}
        try:
            SchemaGrammar(schema, 2).build()
        except SchemaError as exc:
            assert exc.keyword == "oneOf"
            continue
        compiled += 1
        for _, gen in branches:
            for _ in range(6):
                doc = gen()
                assert jsonschema.Draft202012Validator(schema).is_valid(doc), (schema, doc)
    assert compiled >= 50  # the check proves most of these exclusive


@given(step=st.sampled_from(["2", "5", "10", "25", "100", "8", "40", "0.5", "0.25", "0.01", "0.05", "1", "0.1", "3", "0.08"]),
       integer=st.booleans(), sign=st.sampled_from(["", "-"]), whole=st.integers(0, 10**6),
       frac=st.one_of(st.just(""), st.text("0123456789", min_size=1, max_size=4)))
@settings(max_examples=400, deadline=None)
def test_multiple_regex(step, integer, sign, whole, frac):
    rx = multiple_regex(Decimal(step), integer)
    if rx is None:
        assert step in ("3", "0.08")  # divisibility that is not decided by the last digits
        return
    text = f"{sign}{whole}" + (f".{frac}" if frac and not integer else "")
    assert _dfa_match(compile_dfa([rx]), text) == (Decimal(text) % Decimal(step) == 0), (step, text)


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


_S, _I, _N, _B = {"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"}
# (schema, valid documents as JSON text, invalid ones): boundary values on both sides
KEYWORD_CASES = {
    "number_0_1": ({"type": "number", "minimum": 0, "maximum": 1},
                   ["0", "1", "0.5", "1.000", "0.0001", "0.999"], ["1.01", "-0.1", "2", "10", "1.0001"]),
    "number_lat": ({"type": "number", "minimum": -90, "maximum": 90},
                   ["-90", "90", "-89.5", "0", "45.25", "-0.5"], ["-90.5", "90.01", "100", "-91", "-900"]),
    "number_exclusive": ({"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
                         ["0.5", "0.0001", "0.9999"], ["0", "1", "0.0", "1.0", "1.5", "-0.5"]),
    "number_max_only": ({"type": "number", "maximum": -1.5}, ["-1.5", "-2", "-100.25", "-1.50"], ["-1.49", "0", "5", "-1"]),
    "number_min_only": ({"type": "number", "minimum": 0.25}, ["0.25", "1", "1000.5"], ["0.2", "0", "-3", "0.249"]),
    "number_draft4": ({"$schema": "http://json-schema.org/draft-04/schema#", "type": "number", "minimum": 2.5,
                       "exclusiveMinimum": True}, ["2.51", "3"], ["2.5", "2"]),
    "integer_negative": ({"type": "integer", "minimum": -1000, "exclusiveMaximum": -5}, ["-1000", "-6", "-999"],
                         ["-5", "-1001", "0", "-4"]),
    "integer_float_bounds": ({"type": "integer", "minimum": 0.5, "maximum": 9.5}, ["1", "9"], ["0", "10"]),
    "multiple_int": ({"type": "integer", "multipleOf": 5, "minimum": -10, "maximum": 20}, ["-10", "0", "15", "20"],
                     ["-15", "7", "25", "21"]),
    # (radixd compares decimals exactly; jsonschema divides floats, so 19.99 / 0.01 is no
    # integer to it: the valid examples here are ones floats divide exactly as well)
    "multiple_price": ({"type": "number", "multipleOf": 0.01, "minimum": 0}, ["0", "3.75", "5.5", "1.50"],
                       ["0.001", "-1", "2.555"]),
    "multiple_half": ({"type": "number", "multipleOf": 0.5, "exclusiveMaximum": 2}, ["1.5", "-3", "0"], ["2", "0.25", "1.75"]),
    "pattern_length": ({"type": "string", "pattern": "^[a-z]+$", "minLength": 2, "maxLength": 4},
                       ['"ab"', '"abcd"'], ['"a"', '"abcde"', '"AB"', '""']),
    "pattern_unanchored": ({"type": "string", "pattern": "[0-9]{2}", "maxLength": 4},
                           ['"12"', '"a12b"', '"x99"'], ['"1a2"', '"a12bc"']),
    "pattern_anchored_end": ({"type": "string", "pattern": "ab$"}, ['"ab"', '"xxab"'], ['"abx"', '"a"']),
    "pattern_sees_the_string": ({"type": "string", "pattern": "^.{2}$"}, ['"ab"', '"é中"'], ['"\\n"', '"a\\u0062c"']),
    "length_counts_code_points": ({"type": "string", "minLength": 2, "maxLength": 2}, ['"😀😀"', '"\\u00e9\\n"'],
                                  ['"\\ud83d\\ude00"', '"\\ud800"']),
    "format_length": ({"type": "string", "format": "email", "maxLength": 12}, ['"a@b.co"', '"abcd@efg.hi"'],
                      ['"abcdefgh@example.com"', '"ab"']),
    "pattern_format": ({"type": "string", "format": "date", "pattern": "^2024-"}, ['"2024-02-29"'], ['"2023-01-01"']),
    "additional_schema": ({"type": "object", "properties": {"a": _I}, "required": ["a"], "additionalProperties": _S},
                          ['{"a": 1}', '{"a": 1, "b": "x"}', '{"a":1,"ab":"x","b":"y"}', '{"a": 1, "": ""}'],
                          ['{"a": 1, "b": 2}', '{"a": 1, "a": "x"}', '{"a": 1, "\\u0061": "x"}', '{"b": "x"}']),
    "additional_true": ({"type": "object", "properties": {"a": _S}, "additionalProperties": True},
                        ['{}', '{"x": [1, {"y": null}]}', '{"a": "s", "b": 1}', '{"ab": 1}'], ['{"a": 1}', '{"a": "s", "a": 2}']),
    "pattern_properties": ({"type": "object", "patternProperties": {"^x-": _I}, "additionalProperties": False},
                           ['{}', '{"x-a": 1}', '{"x-a": 1, "x-": 2}'], ['{"y": 1}', '{"x-a": "s"}', '{"X-a": 1}']),
    "pattern_keys_unescaped": ({"type": "object", "patternProperties": {"^x-": _I}, "additionalProperties": True},
                               ['{"x-a": 1, "y": "s"}', '{"y": [true]}'], ['{"\\u0078-a": "s"}', '{"x-a": "s"}']),
    "pattern_keys_overlapping": ({"type": "object", "patternProperties": {"^a$": _I, "^[a]$": {"minimum": 0}},
                                  "additionalProperties": False}, ["{}"], ['{"b": 1}', '{"a": -1}']),
    "pattern_and_additional": ({"type": "object", "properties": {"id": _I}, "required": ["id"],
                                "patternProperties": {"^n_": _N}, "additionalProperties": _B},
                               ['{"id": 1, "n_a": 1.5, "z": true}', '{"id": 1}', '{"id": 2, "zz": false, "n_": 0}'],
                               ['{"id": 1, "n_a": true}', '{"id": 1, "z": 1}', '{"id": 1, "id": true}']),
    "allof_objects": ({"allOf": [{"type": "object", "properties": {"a": _I}, "required": ["a"]},
                                 {"properties": {"b": _S}, "required": ["b"]}]},
                      ['{"a": 1, "b": "x"}'], ['{"a": 1}', '{"b": "x"}', '{"a": "1", "b": "x"}']),
    "allof_bounds": ({"allOf": [{"type": "number", "minimum": 0}, {"type": "integer", "maximum": 10}]},
                     ["0", "10", "7"], ["11", "1.5", "-1"]),
    "allof_extra_keys": ({"allOf": [
        {"type": "object", "properties": {"a": _I}, "additionalProperties": {"type": ["string", "integer"]}},
        {"properties": {"a": {"minimum": 0}}, "additionalProperties": {"type": ["string", "boolean"]}}]},
        ['{"a": 0, "b": "x"}', '{"c": "y"}'], ['{"a": -1}', '{"a": 1, "b": 2}', '{"b": true}']),
    "allof_enums": ({"allOf": [{"enum": ["a", "b", "c"]}, {"enum": ["b", "c", "d"]}, {"type": "string"}]},
                    ['"b"', '"c"'], ['"a"', '"d"']),
    "allof_ref": ({"$defs": {"base": {"type": "object", "properties": {"id": _I}, "required": ["id"]}},
                   "allOf": [{"$ref": "#/$defs/base"}, {"properties": {"id": {"minimum": 1}, "name": _S}}]},
                  ['{"id": 1}', '{"id": 5, "name": "x"}'], ['{"id": 0}', '{"name": "x"}']),
    "allof_enum_bound": ({"allOf": [{"enum": [1, 2, "x"]}, {"maximum": 1}]}, ["1", '"x"'], ["2"]),
    "enum_siblings": ({"enum": [1, 50, "x", 2.5, "toolong"], "maximum": 10, "maxLength": 3}, ["1", '"x"', "2.5"],
                      ["50", '"toolong"']),
    "enum_multiple": ({"enum": [0, 5, 7, 2.5, "a"], "multipleOf": 2.5}, ["0", "5", "2.5", '"a"'], ["7"]),
    "const_in_enum": ({"const": "b", "enum": ["a", "b"]}, ['"b"'], ['"a"']),
    "ref_with_siblings": ({"$defs": {"n": {"type": "integer", "minimum": 0}}, "$ref": "#/$defs/n", "maximum": 5},
                          ["0", "5"], ["6", "-1"]),
    "oneof_discriminator": ({"oneOf": [
        {"type": "object", "properties": {"kind": {"const": "a"}, "x": _I}, "required": ["kind", "x"]},
        {"type": "object", "properties": {"kind": {"const": "b"}, "y": _S}, "required": ["kind", "y"]}]},
        ['{"kind": "a", "x": 1}', '{"kind": "b", "y": "s"}'], ['{"kind": "a", "y": "s"}', '{"kind": "c", "x": 1}']),
    "allof_oneof_distributed": ({"allOf": [
        {"type": "object", "properties": {"id": _I}, "required": ["id"]},
        {"oneOf": [{"properties": {"kind": {"const": "a"}}, "required": ["kind"]},
                   {"properties": {"kind": {"const": "b"}, "x": _S}, "required": ["kind", "x"]}]}]},
        ['{"id": 1, "kind": "a"}', '{"id": 2, "kind": "b", "x": "s"}'], ['{"id": 1, "kind": "b"}', '{"kind": "a"}']),
    "allof_number_types": ({"allOf": [{"type": ["number", "null"]}, {"type": "number", "maximum": 2}]},
                           ["2", "1.5", "-3"], ["null", "2.5"]),
    "oneof_types": ({"oneOf": [_S, _I, {"type": "null"}]}, ['"s"', "3", "null"], ["true", "1.5"]),
    "prefix_items": ({"type": "array", "prefixItems": [_S, _I], "items": False},
                     ['[]', '["a"]', '["a", 1]'], ['["a", 1, 2]', '[1]', '["a", "b"]']),
    "prefix_then_items": ({"type": "array", "prefixItems": [_B], "items": _I, "minItems": 2},
                          ['[true, 1]', '[false, 1, 2, 3]'], ['[true]', '[true, "x"]', '[1, 1]']),
    "items_list_draft7": ({"$schema": "http://json-schema.org/draft-07/schema#", "type": "array", "items": [_S, _N], "additionalItems": False, "minItems": 1},
                          ['["a"]', '["a", 2.5]'], ['[]', '["a", 2.5, 1]']),
}


@pytest.mark.parametrize("name", sorted(KEYWORD_CASES))
def test_keyword_documents(smol, name):
    """Valid documents (boundary values included) pass the mask at every step through EOS;
    documents just outside are refused. jsonschema is the oracle for both lists."""
    tok, backend = smol
    schema, valid, invalid = KEYWORD_CASES[name]
    compiled = _compile(backend, "json_schema", json.dumps(schema))
    checker = jsonschema.FormatChecker()
    for text in valid:
        jsonschema.validate(json.loads(text), schema, format_checker=checker)
        ok, where = _feed(tok, compiled, text)
        assert ok, f"{name}: valid {text!r} refused at {where!r}"
    for text in invalid:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(json.loads(text), schema, format_checker=checker)
        assert not _feed(tok, compiled, text)[0], f"{name}: invalid {text!r} accepted"


def _stepping_mask(g, config) -> np.ndarray:
    """The mask by definition: each token stepped on its own (``advance``), no scans."""
    want = np.zeros(g.vocab.vocab_size, dtype=bool)
    if not g.finished(config):
        for t, data in enumerate(g.vocab.token_bytes):
            want[t] = bool(data) and g.advance(config, data) is not None
    if not want.any() or g.end_ok(config):
        want[list(g.vocab.eos_ids)] = True
    return want


def test_small_and_vectorized_trie_walks_agree(smol):
    """The plain-Python walk of a few trie nodes and the vectorized one give the same tokens
    and the same nodes where walks leave a lexeme, from every lexer state's leaving nodes
    (and from the first trie level) through every lexer of a grammar."""
    from radixd.grammars.json_schema import schema_to_lark
    from radixd.grammars.lark_grammar import compile_lark
    from radixd.grammars.lexers import SharedLexers, node_walk_small, node_walk_vectorized

    tok, backend = smol
    g = compile_lark(schema_to_lark(json.dumps(gs.SCHEMAS["any_value"]), 2), backend.vocab, shared=SharedLexers(),
                     warm_budget_s=30.0)
    tr = g.vocab.trie
    lexers = list(g._lexers.values())
    starts = [np.arange(tr.levels[1], tr.levels[2])]  # every first byte
    for sc in list(g.shared.tries.values()):
        starts += [nodes for _, nodes in sc.groups]
    compared = 0
    for nodes in starts:
        for lx in lexers:
            states = np.ones(nodes.size, dtype=np.int64)
            small = node_walk_small(g.vocab, lx, nodes.tolist(), states.tolist())
            big = node_walk_vectorized(g.vocab, lx, nodes, states)  # (however few the nodes)
            assert sorted(small[0].tolist()) == sorted(big[0].tolist())
            assert [(s, sorted(n.tolist())) for s, n in small[1]] == [(s, sorted(n.tolist())) for s, n in big[1]]
            compared += bool(big[1])
    assert compared > 10  # (walks that leave a lexeme were compared)


@pytest.mark.parametrize("name", ["nested_order", "format_email", "anyof_scalar", "flat_strlen", "json_object"])
def test_masks_warmed_cold_and_stepped_agree(smol, name):
    """Masks built from scans made at compile time (every lexer state, and the tokens leaving
    a lexeme walked on through the lexers that may follow), from scans made on first use
    (no warm-up, a fresh lexer cache) and by stepping every token on its own are the same
    at every step of a document (spaced, so whitespace lexemes end inside tokens)."""
    from radixd.grammars.json_schema import schema_to_lark
    from radixd.grammars.lark_grammar import compile_lark
    from radixd.grammars.lexers import SharedLexers

    tok, backend = smol
    schema = gs.SCHEMAS[name]
    lark = schema_to_lark(json.dumps(schema), 2)
    warm = compile_lark(lark, backend.vocab, shared=SharedLexers(), warm_budget_s=30.0)
    cold = compile_lark(lark, backend.vocab, shared=SharedLexers(), warm_budget_s=0.0)
    assert len(warm.shared.tries) > len(cold.shared.tries)
    assert warm.shared.scans  # (continuations through the lexers that may follow, too)
    assert warm._fresh and not cold._fresh  # (and walks at the first lexeme starts)
    text = json.dumps(gs.example(schema, random.Random(7)), ensure_ascii=False, separators=(", ", ": "))
    config, config_cold = warm.start, cold.start  # (parser states may be numbered apart)
    for i, t in enumerate(tok(text).input_ids):
        got_warm, got_cold = warm.mask(config)[0], cold.mask(config_cold)[0]
        assert np.array_equal(got_warm, got_cold), (name, i)
        want = _stepping_mask(warm, config)
        assert np.array_equal(got_warm, want), (name, i, np.flatnonzero(got_warm != want)[:5])
        config, config_cold = warm.step(config, t), cold.step(config_cold, t)
        assert config is not None and config_cold is not None


@pytest.mark.parametrize("schema,keyword", [
    ({"type": "string", "contentEncoding": "base64"}, "contentEncoding"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
    ({"type": "string", "format": "hostname"}, "format"),
    ({"$ref": "https://example.com/s.json"}, "$ref"),
    ({"not": {"type": "string"}}, "not"),
    # number bounds radixd cannot write as a digit range, or that leave nothing
    ({"type": "number", "minimum": 1e300}, "minimum"),
    ({"type": "number", "minimum": 2, "maximum": 1}, "minimum"),
    ({"type": "number", "exclusiveMinimum": 1, "maximum": 1}, "minimum"),
    ({"type": "integer", "exclusiveMinimum": 1, "exclusiveMaximum": 2}, "minimum"),
    ({"type": "number", "exclusiveMinimum": True}, "exclusiveMinimum"),
    # intersections that are empty, anchors inside a pattern
    ({"type": "string", "pattern": "^[a-z]{2}$", "minLength": 3}, "pattern"),
    ({"type": "string", "format": "uuid", "maxLength": 10}, "format"),
    ({"type": "string", "pattern": "^a|b$"}, "pattern"),
    # a pattern property that would also apply to a declared property
    ({"type": "object", "properties": {"ab": {"type": "integer"}}, "patternProperties": {"^a": {"type": "string"}}},
     "patternProperties"),
    # allOf that does not merge exactly
    ({"allOf": [{"type": "string", "pattern": "^a"}, {"pattern": "b$"}]}, "allOf"),
    ({"allOf": [{"properties": {"a": {"type": "string"}}, "additionalProperties": False},
                {"properties": {"b": {"type": "string"}}}]}, "allOf"),
    ({"allOf": [{"type": "string"}, {"type": "integer"}]}, "allOf"),
    ({"allOf": [{"enum": [1, 2]}, {"enum": [3]}]}, "allOf"),
    ({"allOf": [{"type": "object"}, {"type": "array"}]}, "allOf"),
    # const/enum beside keywords: filtered by scalar ones, refused beside others, never ignored
    ({"enum": [{"a": 1}], "properties": {"a": {"type": "integer"}}}, "properties"),
    ({"enum": [5, 6], "maximum": 4}, "enum"),
    ({"const": "a", "enum": ["b"]}, "enum"),
    # oneOf whose branches may overlap
    ({"oneOf": [{"type": "number"}, {"type": "integer"}]}, "oneOf"),
    ({"oneOf": [{"type": "string"}, {"type": "string", "maxLength": 3}]}, "oneOf"),
    ({"oneOf": [{"type": "object", "properties": {"a": {"type": "string"}}},
                {"type": "object", "properties": {"b": {"type": "string"}}}]}, "oneOf"),
    ({"oneOf": [{"enum": ["a", "b"]}, {"enum": ["b", "c"]}]}, "oneOf"),
    # arrays: fewer items allowed than required
    ({"type": "array", "prefixItems": [{"type": "string"}], "items": False, "minItems": 2}, "items"),
    ({"type": "integer", "multipleOf": 3}, "multipleOf"),
    ({"type": "integer", "multipleOf": 10, "minimum": 1, "maximum": 9}, "multipleOf"),
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
    """Every suite schema on the random-weight model: every output closes within max_tokens
    (each schema's shortest document fits in 200) and validates."""
    engine = Engine(model=str(tiny_models["llama"]), kv_cache_tokens=40000, max_running_requests=64)
    try:
        async def one(i, schema):
            params = SamplingParams(json_schema=schema, max_new_tokens=200, temperature=1.0, seed=i)
            outs = [o async for o in engine.generate("Give JSON:", params=params)]
            return "".join(o.text for o in outs), outs[-1].finish_reason

        results = await asyncio.gather(*[one(i, s) for i, s in enumerate(gs.SCHEMAS.values())])
        for (text, reason), (name, schema) in zip(results, gs.SCHEMAS.items(), strict=True):
            assert reason == "stop", (name, reason, text)
            _validate(text, schema)
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
