"""JSON Schema keywords apply only to the instances of the types they are for: under type
lists, untyped schemas, const/enum, anyOf/oneOf siblings and allOf, each family of keywords
(string, number, array, object) constrains its own type and says nothing of the others; what
radixd cannot enforce is still named (``check_schema``, for ``strict: true`` tools)."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

from radixd.grammars import GrammarError
from radixd.grammars.automaton import Matcher
from radixd.grammars.json_schema import check_schema, schema_to_lark
from radixd.grammars.lark_grammar import compile_lark
from radixd.grammars.lexers import SharedLexers
from radixd.grammars.vocab import TokenizerInfo

EOS = 256
VOCAB = TokenizerInfo([bytes([b]) for b in range(256)] + [None], 257, (EOS,))
SHARED = SharedLexers()

# (schema, documents it allows, documents it refuses); every one is checked with jsonschema too
CASES = {
    "string keywords beside null": ({"type": ["string", "null"], "maxLength": 24},
                                    ["abc", None, "x" * 24], ["x" * 25, 3]),
    "string keywords beside integer": ({"type": ["string", "integer"], "pattern": "^a+$", "minLength": 2},
                                       ["aa", 7, -3], ["a", "ab", 1.5]),
    "string keywords on other types": ({"type": "integer", "format": "int32", "maxLength": 1}, [12345], ["1"]),
    "number keywords beside string": ({"type": ["number", "string"], "minimum": 0, "maximum": 10, "maxLength": 2},
                                      [0, 9.5, "ab", "-5"], [11, -1, "abc"]),
    "multipleOf beside string": ({"type": ["integer", "string"], "multipleOf": 5}, [10, "7"], [7]),
    "array keywords beside null": ({"type": ["array", "null"], "items": {"type": "integer"}, "maxItems": 2},
                                   [[1, 2], None, []], [[1, 2, 3], ["a"], 1]),
    "object keywords beside string": ({"type": ["object", "string"], "properties": {"a": {"type": "integer"}},
                                       "required": ["a"], "maxLength": 2},
                                      [{"a": 1}, "ab"], [{}, "abc", {"a": "x"}]),
    "array and object keywords together": ({"type": ["array", "object"], "items": {"type": "boolean"},
                                            "properties": {"k": {"type": "null"}}},
                                           [[True], {"k": None}, {}], [[1], {"k": 1}]),
    "keywords of a type not listed": ({"type": "null", "minLength": 3, "minimum": 1, "minItems": 1}, [None], [1]),
    "enum beside keywords of no listed value's type": ({"enum": ["a", "bb", None], "minItems": 1, "maxLength": 1},
                                                       ["a", None], ["bb"]),
    "const beside a type list": ({"type": ["string", "null"], "const": None, "maxLength": 0}, [None], ["", "a"]),
    "untyped keywords of several types": ({"minLength": 2, "minimum": 3}, ["ab", 3, 10], ["a", 2]),
    "untyped object keywords beside string ones": ({"properties": {"a": {"type": "integer"}}, "required": ["a"],
                                                    "maxLength": 2},
                                                   [{"a": 1}, "ab"], [{}, "abc"]),
    "keywords beside anyOf": ({"anyOf": [{"type": "string"}, {"type": "null"}], "maxLength": 3},
                              ["abc", None], ["abcd", 1]),
    "keywords beside oneOf": ({"oneOf": [{"type": "integer"}, {"type": "string"}], "minimum": 2, "maxLength": 1},
                              [2, "a"], [1, "ab"]),
    "nullable anyOf with keywords in each branch": ({"anyOf": [{"type": "string", "maxLength": 2, "minimum": 1},
                                                               {"type": "null", "maxLength": 2}]},
                                                    ["ab", None], ["abc"]),
    "allOf of a type list and keywords": ({"allOf": [{"type": ["string", "null"]}, {"maxLength": 2}]},
                                          ["ab", None], ["abc", 1]),
    "properties of a nullable object": ({"type": "object", "properties": {
        "tags": {"type": ["array", "null"], "items": {"type": "string", "maxLength": 3}, "maxItems": 2}}},
                                        [{"tags": None}, {"tags": ["abc"]}], [{"tags": ["abcd"]}, {"tags": 1}]),
}


def _allows(grammar, doc) -> bool:
    m = Matcher(grammar)
    row = np.zeros(VOCAB.vocab_size, dtype=bool)
    for b in json.dumps(doc, separators=(",", ":")).encode():
        m.fill_mask(row)
        if not row[b]:
            return False
        assert m.accept_token(b)
    m.fill_mask(row)
    return bool(row[EOS])


@pytest.mark.parametrize("name", sorted(CASES))
def test_keywords_apply_to_their_own_type(name):
    schema, good, bad = CASES[name]
    check_schema(schema)
    g = compile_lark(schema_to_lark(json.dumps(schema)), VOCAB, shared=SHARED, warm_budget_s=0.0)
    for doc in good:
        jsonschema.validate(doc, schema)
        assert _allows(g, doc), (name, doc)
    for doc in bad:
        assert not jsonschema.Draft202012Validator(schema).is_valid(doc), (name, doc)
        assert not _allows(g, doc), (name, doc)


@pytest.mark.parametrize("schema, keyword", [
    ({"type": ["array", "null"], "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
    ({"type": ["object", "null"], "minProperties": 1}, "minProperties"),
    ({"type": ["string", "null"], "contentEncoding": "base64"}, "contentEncoding"),
    ({"type": ["string", "null"], "frobnicate": 1}, "frobnicate"),  # a keyword of no type: refused anywhere
    ({"anyOf": [{"type": "string"}, {"type": "null"}], "not": {"const": "a"}}, "not"),
    ({"enum": [[1], "a"], "minItems": 1}, "minItems"),  # a listed value is an array: it applies
    ({"type": "object", "properties": {"a": {"type": ["integer", "null"], "propertyNames": {}}}}, None),
])
def test_check_schema_names_what_cannot_be_enforced(schema, keyword):
    if keyword is None:  # (propertyNames applies to objects only: nothing to enforce here)
        check_schema(schema)
        return
    with pytest.raises(GrammarError) as info:
        check_schema(schema, "tools[0].function.parameters")
    assert info.value.field == "tools[0].function.parameters"
    assert f"unsupported JSON Schema keyword '{keyword}'" in info.value.message
