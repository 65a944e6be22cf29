"""JSON Schema -> a Lark grammar (LALR) whose terminals are regexes.

Supported: ``type`` (one or a list), ``properties``/``required`` (properties appear in their
declared order), ``additionalProperties`` and ``patternProperties`` (extra keys follow the
declared ones; a key is a terminal with look-aheads: not a declared name in any JSON spelling,
matching its pattern and no other), an object without ``properties`` (any keys), ``enum``,
``const``, string ``minLength``/``maxLength``/``pattern``/``format`` (date, time, date-time,
uuid, email, ipv4) combined by look-ahead intersection, integer and number ``minimum``/
``maximum``/``exclusiveMinimum``/``exclusiveMaximum`` (exact decimal digit ranges; bounded
numbers have no exponent) and ``multipleOf`` where the last digits decide it, array ``items``/``prefixItems``/``minItems``/``maxItems``,
``anyOf``, ``oneOf`` (branches proven mutually exclusive) and ``allOf`` (merged when exact; see
``schema_algebra``), ``nullable``, ``$ref`` to ``#``, ``#/$defs/..`` and ``#/definitions/..``
(recursion included; keywords beside a ``$ref`` are merged with it as an allOf).
Annotations (title, description, default, examples, ...) are accepted. Anything else raises
``SchemaError`` naming the keyword, so nothing is silently left unenforced.

Whitespace between tokens is one ignored terminal of 1..``max_ws`` characters, never two in
a row, so a model cannot loop on blanks.

This module walks the schema: ``$ref``, choices and type dispatch, and the rules of objects
(declared properties, then extra keys) and arrays. The terminals of strings come from
``schema_strings``, of numbers from ``schema_numbers``; allOf and oneOf go through
``schema_algebra``; the error and the keyword tables are ``schema_model``'s.
"""

from __future__ import annotations

import json
import re

from radixd.grammars.regex_dfa import is_empty
from radixd.grammars.schema_algebra import Algebra
from radixd.grammars.schema_model import (
    ANNOTATIONS,
    SchemaError,
    count_bounds,
    fits_type,
    implied_type,
    value_key,
)
from radixd.grammars.schema_numbers import NUMBER, admits_number, integer_regex, number_regex
from radixd.grammars.schema_strings import (
    CHAR,
    RAW,
    admits_string,
    not_any,
    pattern_content,
    spelled_regex,
    string_regex,
)

MAX_EXPANDED_ITEMS = 64


def _lark_regex(rx: str) -> str:
    return "/" + rx.replace("/", "\\/") + "/"


def _literal_regex(value) -> str:
    return re.escape(json.dumps(value, ensure_ascii=False, separators=(",", ":")))


class SchemaGrammar:
    """Builds the Lark grammar text for one schema."""

    def __init__(self, schema, max_ws: int):
        self.root = schema
        self.max_ws = max_ws
        self.rules: dict[str, str] = {}
        self.terminals: dict[str, str] = {}     # regex -> terminal name
        self.memo: dict[str, str] = {}          # canonical schema / ref -> rule name
        self._n = 0
        self._roots = 0  # memo keys are per root: the same $ref means another schema elsewhere
        self.algebra = Algebra(self.resolve)

    def build(self) -> str:
        return self.grammar(f"start: {self.top(self.root)}")

    def top(self, schema) -> str:
        """The symbol of the documents valid under the root ``schema``. One grammar may hold
        several roots (a structural tag's structures), each resolving its own ``$ref``s."""
        self.root = schema
        self._roots += 1
        return self.value(schema, "#")

    def grammar(self, start: str) -> str:
        """The grammar text: the ``start`` rule, then the rules and terminals made so far."""
        lines = [start]
        lines += [f"{name}: {body}" for name, body in self.rules.items()]
        lines += [f"{name}: {_lark_regex(rx)}" for rx, name in self.terminals.items()]
        if self.max_ws > 0:
            lines += [f"WS: /[ \\t\\n\\r]{{1,{self.max_ws}}}/", "%ignore WS"]
        return "\n".join(lines) + "\n"

    # -------------------------------------------------------------- helpers

    def _name(self, prefix: str) -> str:
        self._n += 1
        return f"{prefix}{self._n}"

    def term(self, rx: str) -> str:
        name = self.terminals.get(rx)
        if name is None:
            name = self.terminals[rx] = self._name("T")
        return name

    def rule(self, body: str, prefix: str = "r") -> str:
        name = self._name(prefix)
        self.rules[name] = body
        return name

    def resolve(self, ref: str):
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise SchemaError("$ref", f"only local references (#...) are supported, got {ref!r}")
        node = self.root
        for part in [p for p in ref[1:].split("/") if p]:
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(node, dict) or part not in node:
                raise SchemaError("$ref", f"reference {ref!r} does not resolve")
            node = node[part]
        return node

    # -------------------------------------------------------------- schemas

    def value(self, schema, path: str) -> str:
        """The grammar symbol for values valid under ``schema``."""
        if schema is True or schema == {}:
            return self.any_value()
        if schema is False:
            raise SchemaError("false", f"the schema at {path} allows no value")
        if not isinstance(schema, dict):
            raise SchemaError("schema", f"a schema must be an object or a boolean, got {schema!r} at {path}")
        if "$ref" in schema:
            extra = set(schema) - {"$ref"} - ANNOTATIONS
            if extra:  # keywords beside $ref apply as well (2019-09 on): an allOf of the two
                rest = {k: v for k, v in schema.items() if k != "$ref"}
                return self.value({"allOf": [{"$ref": schema["$ref"]}, rest]}, path)
            ref = schema["$ref"]
            key = f"ref:{self._roots}:{ref}"
            name = self.memo.get(key)
            if name is None:
                name = self.memo[key] = self._name("ref")
                self.rules[name] = ""  # reserve: recursion refers to it before it is built
                self.rules[name] = self.value(self.resolve(ref), str(ref))
            return name
        key = f"{self._roots}:{json.dumps(schema, sort_keys=True)}"
        if key in self.memo:
            return self.memo[key]
        name = self._name("v")
        self.memo[key] = name
        self.rules[name] = ""
        self.rules[name] = self._body(schema, path)
        return name

    def _body(self, s: dict, path: str) -> str:
        if "allOf" in s:
            return self.value(self.algebra.merge_all_of(s, path), path)
        if "not" in s:
            raise SchemaError("not", f"not is not supported (at {path})")
        for kw in ("anyOf", "oneOf"):
            if kw in s:
                alts = s[kw]
                if not isinstance(alts, list) or not alts:
                    raise SchemaError(kw, f"{kw} must be a non-empty list (at {path})")
                rest = {k: v for k, v in s.items() if k != kw and k not in ANNOTATIONS}
                if rest:
                    raise SchemaError(sorted(rest)[0], f"keywords beside {kw} are not supported ({sorted(rest)}) at {path}")
                if kw == "oneOf":
                    self.algebra.check_one_of(alts, path)
                return " | ".join(self.value(a, f"{path}/{kw}/{i}") for i, a in enumerate(alts))
        if s.get("nullable") is True:
            inner = {k: v for k, v in s.items() if k != "nullable"}
            return f"{self.value(inner, path)} | {self.term('null')}"
        if "const" in s or "enum" in s:
            return " | ".join(self.term(_literal_regex(v)) for v in self._listed_values(s, path))
        t = s.get("type")
        if isinstance(t, list):
            if not t:
                raise SchemaError("type", f"type must not be an empty list (at {path})")
            return " | ".join(self.value({**s, "type": one}, path) for one in t)
        if t is None:  # untyped: the type its keywords imply, else any value
            t = implied_type(s)
            if t is None:
                self._check(s, set(), path)
                return self.any_value()
        builder = {"string": self._string, "integer": self._integer, "number": self._number,
                   "boolean": self._boolean, "null": self._null, "object": self._object, "array": self._array}
        if t not in builder:
            raise SchemaError("type", f"unknown type {t!r} at {path}")
        return builder[t](s, path)

    def _listed_values(self, s: dict, path: str) -> list:
        """The const/enum values that also satisfy the keywords beside them (scalar ones:
        type, bounds, lengths, pattern, format); other keywords beside them are refused."""
        vals = [s["const"]] if "const" in s else s["enum"]
        if not isinstance(vals, list) or not vals:
            raise SchemaError("enum", f"enum must be a non-empty list (at {path})")
        rest = {k: v for k, v in s.items() if k not in ANNOTATIONS and k not in ("const", "nullable")}
        if "const" in s and "enum" in s:
            listed = {value_key(v) for v in s["enum"]} if isinstance(s["enum"], list) else set()
            vals = [v for v in vals if value_key(v) in listed]
            del rest["enum"]
        else:
            rest.pop("enum", None)
        scalar = {"type", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "minLength",
                  "maxLength", "pattern", "format"}
        if set(rest) - scalar:
            kw = sorted(set(rest) - scalar)[0]
            raise SchemaError(kw, f"keyword {kw!r} beside const/enum is not supported (at {path})")
        if rest:
            vals = [v for v in vals if _admits(v, rest, path)]
        if not vals:
            beside = f"the keywords beside it ({', '.join(sorted(rest))})" if rest else "both const and enum"
            raise SchemaError("enum", f"no const/enum value satisfies {beside} at {path}")
        return vals

    def _check(self, s: dict, allowed: set[str], path: str) -> None:
        extra = set(s) - allowed - ANNOTATIONS - {"type", "nullable"}
        if extra:
            kw = sorted(extra)[0]
            raise SchemaError(kw, f"keyword {kw!r} is not supported for type {s.get('type')!r} (at {path})")

    def _string(self, s: dict, path: str) -> str:
        self._check(s, {"minLength", "maxLength", "pattern", "format"}, path)
        return self.term(string_regex(s, path))

    def _integer(self, s: dict, path: str) -> str:
        self._check(s, {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"}, path)
        return self.term(integer_regex(s, path))

    def _number(self, s: dict, path: str) -> str:
        self._check(s, {"minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum", "multipleOf"}, path)
        return self.term(number_regex(s, path))

    def _boolean(self, s: dict, path: str) -> str:
        self._check(s, set(), path)
        return f"{self.term('true')} | {self.term('false')}"

    def _null(self, s: dict, path: str) -> str:
        self._check(s, set(), path)
        return self.term("null")

    def _object(self, s: dict, path: str) -> str:
        """Declared properties first, in their order (each written once), then extra keys:
        strings that are none of the declared names, with their values under the schema of
        the ``patternProperties`` pattern they match, else under ``additionalProperties``.
        ``additionalProperties`` absent beside ``properties`` writes no extra keys."""
        self._check(s, {"properties", "required", "additionalProperties", "patternProperties"}, path)
        props = s.get("properties") or {}
        required = s.get("required") or []
        if not isinstance(props, dict):
            raise SchemaError("properties", f"properties must be an object (at {path})")
        if not isinstance(required, list) or any(r not in props for r in required):
            missing = [r for r in required if r not in props] if isinstance(required, list) else required
            raise SchemaError("required", f"required names properties that are not declared: {missing} (at {path})")
        patterns = s.get("patternProperties") or {}
        if not isinstance(patterns, dict):
            raise SchemaError("patternProperties", f"patternProperties must be an object (at {path})")
        extra = s.get("additionalProperties", False if props or patterns else True)
        lb, rb = self.term(r"\{"), self.term(r"\}")
        if not props and not patterns:
            if extra is False:
                return f"{lb} {rb}"
            return self._free_object(self.value(extra, path + "/additionalProperties"))
        colon = self.term(":")
        ws = f"[ \\t\\n\\r]{{0,{self.max_ws}}}"
        kinds = self._extra_keys(props, patterns, extra, path)  # (key text regex, value symbol)
        if not props and not kinds:  # no pattern can make a key: only the empty object
            return f"{lb} {rb}"
        extra_first = self.rule(" | ".join(f"{self.term(k)} {colon} {v}" for k, v in kinds), "xfirst") if kinds else None
        extra_next = self.rule(" | ".join(f"{self.term(',' + ws + k)} {colon} {v}" for k, v in kinds), "xnext") if kinds else None
        items = []
        for k in props:
            v = self.value(props[k], f"{path}/properties/{k}")
            key = _literal_regex(k)
            items.append((self.term(key), self.term("," + ws + key), colon, v, k in required))
        # tails[i]: properties i.. once one was written (their comma-prefixed keys tell
        # LALR(1) which comes next), then the extra keys; the object opens with any optional
        # property up to the first required one, or (none required) with an extra key.
        tails: list[str | None] = [None] * (len(items) + 1)
        if extra_next:
            tails[-1] = self.rule(f"{extra_next}*", "xtail")
        for i in reversed(range(len(items))):
            _, comma_key, c, v, req = items[i]
            rest = f" {tails[i + 1]}" if tails[i + 1] else ""
            tails[i] = self.rule(f"{comma_key} {c} {v}{rest}" if req else f"[{comma_key} {c} {v}]{rest}", "tail")
        alts = []
        for i, (first_key, _, c, v, req) in enumerate(items):
            rest = f" {tails[i + 1]}" if tails[i + 1] else ""
            alts.append(f"{first_key} {c} {v}{rest}")
            if req:
                break
        if extra_first and not required:
            alts.append(f"{extra_first} {tails[-1]}")
        inner = self.rule(" | ".join(alts), "props")
        return f"{lb} {inner} {rb}" + (f" | {lb} {rb}" if not required else "")

    def _extra_keys(self, props: dict, patterns: dict, extra, path: str) -> list[tuple[str, str]]:
        """The classes of extra keys as (regex of the quoted key, value symbol): one per
        pattern (keys it matches and no other pattern does), one for additionalProperties
        (keys no pattern matches); declared names, in any JSON spelling, are never extra."""
        declared = [spelled_regex(k) for k in props]
        contents = []
        for pat, sub in patterns.items():
            content = pattern_content(pat, f"{path}/patternProperties")
            clash = [k for k in props if re.search(pat, k)]
            if clash:
                raise SchemaError("patternProperties", f"patternProperties {pat!r} matches the declared propert"
                                                       f"{'ies' if len(clash) > 1 else 'y'} {clash}: its schema would "
                                                       f"apply to them as well (at {path})")
            contents.append((pat, content, sub))
        kinds = []
        for i, (pat, content, sub) in enumerate(contents):
            others = declared + [c for j, (_, c, _) in enumerate(contents) if j != i]
            rx = f'"(?=(?:{content})"\\Z)' + not_any(others) + RAW + '*"'
            if not is_empty(rx):
                kinds.append((rx, self.value(sub, f"{path}/patternProperties/{pat}")))
        if extra is not False:
            rx = '"' + not_any(declared + [c for _, c, _ in contents]) + (RAW if contents else CHAR) + '*"'
            kinds.append((rx, self.value(extra, f"{path}/additionalProperties")))
        return kinds

    def _free_object(self, value: str) -> str:
        lb, rb, colon, comma = self.term(r"\{"), self.term(r"\}"), self.term(":"), self.term(",")
        key = self.term('"' + CHAR + '*"')
        pair = self.rule(f"{key} {colon} {value}", "pair")
        return f"{lb} [{pair} ({comma} {pair})*] {rb}"

    def _array(self, s: dict, path: str) -> str:
        """Positions 0.. take ``prefixItems`` (or a draft-2019 ``items`` list), the rest
        ``items`` (``additionalItems`` beside an items list; false: no more items); the length
        bounds unroll into nested optional tails, or a star when unbounded."""
        self._check(s, {"items", "minItems", "maxItems", "prefixItems", "additionalItems"}, path)
        if isinstance(s.get("items"), list):
            if "prefixItems" in s:
                raise SchemaError("items", f"items as a list beside prefixItems (at {path})")
            prefix, rest, rest_kw = s["items"], s.get("additionalItems", True), "additionalItems"
        else:
            if "additionalItems" in s:
                raise SchemaError("additionalItems", f"additionalItems needs items as a list (at {path})")
            prefix, rest, rest_kw = s.get("prefixItems", []), s.get("items", True), "items"
            if not isinstance(prefix, list):
                raise SchemaError("prefixItems", f"prefixItems must be a list of schemas (at {path})")
        lo, hi = count_bounds(s, "minItems", "maxItems", path)
        if rest is False:
            hi = len(prefix) if hi is None else min(hi, len(prefix))
        if hi is not None and hi < lo:
            kw = "maxItems" if "maxItems" in s and s["maxItems"] < lo else rest_kw
            raise SchemaError(kw, f"at most {hi} items fit, below minItems {lo} (at {path})")
        if lo > MAX_EXPANDED_ITEMS or (hi is not None and hi > MAX_EXPANDED_ITEMS and hi != lo):
            if hi is not None and hi > MAX_EXPANDED_ITEMS:
                raise SchemaError("maxItems", f"maxItems above {MAX_EXPANDED_ITEMS} is not supported (at {path})")
            raise SchemaError("minItems", f"minItems above {MAX_EXPANDED_ITEMS} is not supported (at {path})")
        if len(prefix) > MAX_EXPANDED_ITEMS:
            raise SchemaError("prefixItems", f"more than {MAX_EXPANDED_ITEMS} prefixItems are not supported (at {path})")
        lb, rb, comma = self.term(r"\["), self.term(r"\]"), self.term(",")
        if hi == 0:
            return f"{lb} {rb}"
        prefix_kw = "items" if rest_kw == "additionalItems" else "prefixItems"
        at = [self.value(p, f"{path}/{prefix_kw}/{i}") for i, p in enumerate(prefix)]
        count = max(len(prefix), lo, 1) if hi is None else hi
        item = None if rest is False else self.value(rest, f"{path}/{rest_kw}")
        at += [item] * (count - len(at))
        more = f"({comma} {item})*" if hi is None else ""
        for i in reversed(range(max(lo, 1), count)):  # optional positions: nested tails
            more = f"[{comma} {at[i]} {more}]".replace(" ]", "]")
        body = " ".join([at[0]] + [f"{comma} {at[i]}" for i in range(1, lo)] + ([more] if more else []))
        return f"{lb} {body} {rb}" if lo else f"{lb} [{body}] {rb}"

    def any_value(self) -> str:
        name = self.memo.get("any")
        if name is not None:
            return name
        name = self.memo["any"] = self._name("any")
        self.rules[name] = ""
        obj = self._free_object(name)
        lb, rb, comma = self.term(r"\["), self.term(r"\]"), self.term(",")
        arr = f"{lb} [{name} ({comma} {name})*] {rb}"
        scalars = [self.term('"' + CHAR + '*"'), self.term(NUMBER), self.term("true"), self.term("false"), self.term("null")]
        self.rules[name] = " | ".join([self.rule(obj, "obj"), self.rule(arr, "arr")] + scalars)
        return name


def _admits(v, s: dict, path: str) -> bool:
    """Whether the value ``v`` satisfies the scalar keywords of ``s``."""
    t = s.get("type")
    types = set(t) if isinstance(t, list) else {t} if t else None
    if types is not None and not fits_type(v, types):
        return False
    is_num = isinstance(v, int | float) and not isinstance(v, bool)
    if is_num and not admits_number(v, s, path):
        return False
    if isinstance(v, str) and not admits_string(v, s, path):
        return False
    return True


def schema_to_lark(schema, max_ws: int = 2) -> str:
    """The Lark grammar for ``schema`` (a dict/bool, or its JSON text)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise SchemaError("json_schema", f"the schema is not valid JSON: {exc}") from None
    return SchemaGrammar(schema, max_ws).build()
