"""Structural tags: free text in which each trigger opens a structure of a JSON Schema.

The spec is SGLang's (``response_format: {"type": "structural_tag", ...}``)::

    {"type": "structural_tag",                    # optional here
     "structures": [{"begin": "<tool_call>\\n{\\"name\\": \\"f\\", \\"arguments\\": ",
                     "schema": {...JSON Schema...},   # absent/null: any JSON value
                     "end": "}\\n</tool_call>"}, ...],
     "triggers": ["<tool_call>"]}

The output is free text (any token, EOS included) until it reaches a trigger (``triggers``:
found in the tokens' text, so a trigger may be one special token or plain text; a token
that would run past a trigger is masked out). The structures whose ``begin`` starts with
that trigger then compete: the rest of one ``begin``, a JSON document valid for its
``schema`` (the JSON Schema compiler's grammar), then its ``end``, exactly (no whitespace
before the rest of ``begin`` or before ``end``); tokens that would run past ``end`` are
masked out. Then free text again, triggers looked for afresh. EOS is allowed only in free
text (and where a structure is complete).

Each trigger's structures are one Lark grammar (``TokenGrammar``), compiled like any other;
the free text is ``triggers.Triggers``. Every ``begin`` must start with exactly one trigger,
every trigger open a structure, and no trigger contain another.
"""

from __future__ import annotations

import json
import re

import numpy as np

from radixd.grammars import GrammarError
from radixd.grammars.automaton import Matcher, TokenGrammar
from radixd.grammars.json_schema import SchemaError, SchemaGrammar, unsupported
from radixd.grammars.lark_grammar import GrammarSyntaxError, compile_lark
from radixd.grammars.triggers import Triggers
from radixd.grammars.vocab import TokenizerInfo

FIELD = "structural_tag"


def parse_spec(spec: str | dict) -> tuple[list[str], list[tuple[str, object, str]]]:
    """(triggers, [(begin, schema, end)]) of a structural tag, checked; GrammarError names
    what is wrong."""
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except json.JSONDecodeError as exc:
            raise GrammarError(FIELD, f"the structural tag is not valid JSON: {exc}") from None
    if not isinstance(spec, dict):
        raise GrammarError(FIELD, "a structural tag must be an object with 'structures' and 'triggers'")
    if "format" in spec:
        raise GrammarError(FIELD, "the structural tag's 'format' form is not supported; give 'structures' "
                                  "and 'triggers'")
    unknown = set(spec) - {"type", "structures", "triggers"}
    if unknown:
        raise GrammarError(FIELD, f"unrecognized structural tag field {sorted(unknown)[0]!r}")
    if spec.get("type", FIELD) != FIELD:
        raise GrammarError(FIELD, f"the structural tag's 'type' must be 'structural_tag', got {spec['type']!r}")
    structures, triggers = spec.get("structures"), spec.get("triggers")
    if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
        raise GrammarError(FIELD, "'triggers' must be a non-empty list of non-empty strings")
    if not isinstance(structures, list) or not structures:
        raise GrammarError(FIELD, "'structures' must be a non-empty list")
    out = []
    for i, s in enumerate(structures):
        if not isinstance(s, dict) or not isinstance(s.get("begin"), str) or not isinstance(s.get("end"), str):
            raise GrammarError(FIELD, f"structures[{i}] must be an object with string 'begin' and 'end'")
        extra = set(s) - {"begin", "schema", "end"}
        if extra:
            raise GrammarError(FIELD, f"unrecognized field structures[{i}].{sorted(extra)[0]}")
        schema = s.get("schema")
        if schema is not None and not isinstance(schema, dict | bool):
            raise GrammarError(FIELD, f"structures[{i}].schema must be a JSON Schema (an object)")
        out.append((s["begin"], True if schema is None else schema, s["end"]))
    for text in [*triggers, *(t for b, _, e in out for t in (b, e))]:
        if not text.isascii() and not _encodable(text):
            raise GrammarError(FIELD, f"{text!r} is not valid Unicode (a lone surrogate)")
    return triggers, out


def _encodable(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


class StructuralTag:
    """A compiled structural tag: ``matcher()`` as the backend contract (no closing within
    a budget: free text may end anywhere)."""

    def __init__(self, triggers: Triggers, groups: list[TokenGrammar]):
        self.triggers = triggers
        self.groups = groups  # groups[i]: the structures opened by trigger i

    def matcher(self) -> StructuralTagMatcher:
        return StructuralTagMatcher(self)


class StructuralTagMatcher:
    """Free text in automaton state ``state`` (``inner`` None), or inside a structure."""

    __slots__ = ("tag", "state", "inner")

    def __init__(self, tag: StructuralTag):
        self.tag = tag
        self.state = 0
        self.inner: Matcher | None = None

    def fill_mask(self, out: np.ndarray) -> None:
        m = self.inner
        if m is None:
            out[:] = self.tag.triggers.scan(self.state).allowed
            return
        m.fill_mask(out)
        if m.grammar.end_ok(m.config):  # complete but extendable (an empty end): or free text
            out |= self.tag.triggers.scan(0).allowed

    def accept_token(self, token: int) -> bool:
        m = self.inner
        if m is None:
            sc = self.tag.triggers.scan(self.state)
            if not sc.allowed[token]:
                return False
            h = int(sc.hit[token])
            if h >= 0:
                self.inner = Matcher(self.tag.groups[h])
            else:
                self.state = int(sc.nxt[token])
            return True
        if m.accept_token(token):
            if m.is_terminated():  # the structure is complete: free text again
                self.inner, self.state = None, 0
            return True
        if m.grammar.end_ok(m.config):
            self.inner, self.state = None, 0
            return self.accept_token(token)
        return False

    def is_terminated(self) -> bool:
        return False  # free text follows every structure

    def fork(self) -> StructuralTagMatcher:
        """A copy at the same position (``Forks``)."""
        m = StructuralTagMatcher(self.tag)
        m.state, m.inner = self.state, self.inner.fork() if self.inner is not None else None
        return m


def compile_structural_tag(spec: str, vocab: TokenizerInfo, *, max_ws: int, mask_cache_size: int, shared,
                           warm_budget_s: float) -> StructuralTag:
    triggers, structures = parse_spec(spec)
    try:
        scan = Triggers([t.encode() for t in triggers], vocab, warm_budget_s / 2)
    except ValueError as exc:
        raise GrammarError(FIELD, f"'triggers': {exc}") from None
    opened: list[list[int]] = [[] for _ in triggers]
    for i, (begin, _, _) in enumerate(structures):
        at = [j for j, t in enumerate(triggers) if begin.startswith(t)]
        if len(at) != 1:
            raise GrammarError(FIELD, f"structures[{i}].begin {begin!r} must start with exactly one trigger "
                                      f"(it starts with {len(at)})")
        opened[at[0]].append(i)
    for j, t in enumerate(triggers):
        if not opened[j]:
            raise GrammarError(FIELD, f"trigger {t!r} opens no structure (no begin starts with it)")
    groups = [_group(triggers[j], [(i, structures[i]) for i in opened[j]], vocab, max_ws, mask_cache_size,
                     shared, warm_budget_s / 2 / len(triggers)) for j in range(len(triggers))]
    return StructuralTag(scan, groups)


def _group(trigger: str, structures: list[tuple[int, tuple[str, object, str]]], vocab: TokenizerInfo, max_ws: int,
           mask_cache_size: int, shared, warm_budget_s: float) -> TokenGrammar:
    """One grammar for the structures that ``trigger`` opens: what follows the trigger."""
    g = SchemaGrammar(None, max_ws)
    alts, tight = [], set()
    for i, (begin, schema, end) in structures:
        try:
            value = g.top(schema)
        except SchemaError as exc:
            raise unsupported(exc, FIELD, f"structures[{i}].schema: ") from None
        parts = []
        for text in (begin[len(trigger):], None, end):
            if text is None:
                parts.append(value)
            elif text:  # a literal, kept apart from the JSON's own terminals of the same text
                name = g.term(f"(?:{_literal(text)})")
                tight.add(name)
                parts.append(name)
        alts.append(" ".join(parts))
    try:  # (a structure given twice is one alternative)
        return compile_lark(g.grammar("start: " + " | ".join(dict.fromkeys(alts))), vocab, mask_cache_size=mask_cache_size,
                            shared=shared, warm_budget_s=warm_budget_s, tight=frozenset(tight))
    except GrammarSyntaxError as exc:
        raise GrammarError(FIELD, f"the structures opened by trigger {trigger!r} cannot be told apart "
                                  f"(their grammar is not LALR(1)): {exc}") from None


def _literal(text: str) -> str:
    """A regex for exactly ``text``, with control characters escaped (Lark refuses raw newlines)."""
    return "".join(re.escape(c) if c.isprintable() else f"\\x{ord(c):02x}" if ord(c) < 256 else f"\\u{ord(c):04x}"
                   for c in text)
