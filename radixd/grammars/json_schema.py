"""JSON Schema -> a Lark grammar (LALR) whose terminals are regexes.

Supported: ``type`` (one or a list), ``properties``/``required`` (properties appear in their
declared order; ``additionalProperties`` must be false or absent when ``properties`` are given),
an object without ``properties`` (any keys, values under ``additionalProperties`` if a
schema), ``enum``, ``const``, string ``minLength``/``maxLength``/``pattern``/``format`` (date,
time, date-time, uuid, email, ipv4), integer ``minimum``/``maximum``/``exclusiveMinimum``/
``exclusiveMaximum``, number ``minimum: 0``, array ``items``/``minItems``/``maxItems``,
``anyOf``/``oneOf`` (oneOf as anyOf: branches should not overlap), ``nullable``, ``$ref`` to
``#``, ``#/$defs/..`` and ``#/definitions/..`` (recursion included). Annotations (title,
description, default, examples, ...) are accepted. Anything else raises ``SchemaError`` naming
the keyword, so nothing is silently left unenforced.

Whitespace between tokens is one ignored terminal of 1..``max_ws`` characters, never two in
a row, so a model cannot loop on blanks.
"""

from __future__ import annotations

import json
import math
import re

from radixd.grammars.regex_dfa import RegexError, parse

ANNOTATIONS = {"title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated",
               "readOnly", "writeOnly", "$defs", "definitions", "strict", "name"}
_CHAR = r'(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})'
_INT = r"-?(?:0|[1-9][0-9]*)"
_NUM = r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?"
FORMATS = {
    "date": r"[0-9]{4}-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12][0-9]|3[01])",
    "time": r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\.[0-9]{1,6})?(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])?",
    "date-time": r"[0-9]{4}-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12][0-9]|3[01])T(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9]"
                 r"(?:\.[0-9]{1,6})?(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])",
    "uuid": r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}",
    "email": r"[a-zA-Z0-9_+-]+(?:\.[a-zA-Z0-9_+-]+)*@[a-zA-Z0-9-]+(?:\.[a-zA-Z0-9-]+)*\.[a-zA-Z]{2,}",
    "ipv4": r"(?:(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])\.){3}(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])",
}
MAX_EXPANDED_ITEMS = 64


class SchemaError(ValueError):
    """A schema radixd cannot enforce; ``keyword`` names the keyword."""

    def __init__(self, keyword: str, message: str):
        super().__init__(message)
        self.keyword = keyword


def _lark_regex(rx: str) -> str:
    return "/" + rx.replace("/", "\\/") + "/"


def _literal_regex(value) -> str:
    return re.escape(json.dumps(value, ensure_ascii=False, separators=(",", ":")))


def int_range_regex(lo: int | None, hi: int | None) -> str:
    """A regex for the decimal integers in [lo, hi] (either end may be open)."""
    if lo is not None and hi is not None and lo > hi:
        raise SchemaError("minimum", f"minimum {lo} is above maximum {hi}")
    parts = []
    if lo is None or lo < 0:  # the negative part: -[max(1, -hi) .. -lo]
        nlo = 1 if hi is None or hi >= 0 else -hi
        nhi = None if lo is None else -lo
        parts.append("-(?:" + _nonneg_range(nlo, nhi) + ")")
    if hi is None or hi >= 0:
        parts.append(_nonneg_range(max(lo or 0, 0) if lo is not None else 0, hi))
    return "(?:" + "|".join(parts) + ")"


def _nonneg_range(lo: int, hi: int | None) -> str:
    if hi is None:
        d = len(str(lo))
        top = 10**d - 1
        return "|".join(filter(None, [_bounded(lo, top), f"[1-9][0-9]{{{d},}}"]))
    return _bounded(lo, hi)


def _bounded(lo: int, hi: int) -> str:
    """Regex alternatives for [lo, hi], 0 <= lo <= hi (split by digit count, then by prefix)."""
    out = []
    while lo <= hi:
        d = len(str(lo))
        top = min(hi, 10**d - 1)
        out += _same_len(str(lo), str(top))
        lo = top + 1
    return "|".join(out)


def _same_len(a: str, b: str) -> list[str]:
    if a == b:
        return [a]
    if len(a) == 1:
        return [f"[{a}-{b}]"]
    if a[0] == b[0]:
        return [a[0] + "(?:" + "|".join(_same_len(a[1:], b[1:])) + ")"]
    n = len(a) - 1
    out = []
    lo_full = a[1:] == "0" * n
    hi_full = b[1:] == "9" * n
    first_lo = int(a[0]) if lo_full else int(a[0]) + 1
    last_hi = int(b[0]) if hi_full else int(b[0]) - 1
    if not lo_full:
        out.append(a[0] + "(?:" + "|".join(_same_len(a[1:], "9" * n)) + ")")
    if first_lo <= last_hi:
        out.append(f"[{first_lo}-{last_hi}][0-9]{{{n}}}")
    if not hi_full:
        out.append(b[0] + "(?:" + "|".join(_same_len("0" * n, b[1:])) + ")")
    return out


class SchemaGrammar:
    """Builds the Lark grammar text for one schema."""

    def __init__(self, schema, max_ws: int):
        self.root = schema
        self.max_ws = max_ws
        self.rules: dict[str, str] = {}
        self.terminals: dict[str, str] = {}     # regex -> terminal name
        self.memo: dict[str, str] = {}          # canonical schema / ref -> rule name
        self._n = 0

    def build(self) -> str:
        top = self.value(self.root, "#")
        lines = [f"start: {top}"]
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
            if extra:
                raise SchemaError(sorted(extra)[0], f"keywords beside $ref are not supported ({sorted(extra)}) at {path}")
            ref = schema["$ref"]
            name = self.memo.get("ref:" + str(ref))
            if name is None:
                name = self.memo["ref:" + str(ref)] = self._name("ref")
                self.rules[name] = ""  # reserve: recursion refers to it before it is built
                self.rules[name] = self.value(self.resolve(ref), str(ref))
            return name
        key = json.dumps(schema, sort_keys=True)
        if key in self.memo:
            return self.memo[key]
        name = self._name("v")
        self.memo[key] = name
        self.rules[name] = ""
        self.rules[name] = self._body(schema, path)
        return name

    def _body(self, s: dict, path: str) -> str:
        if "allOf" in s:
            raise SchemaError("allOf", f"allOf is not supported (at {path})")
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
                return " | ".join(self.value(a, f"{path}/{kw}/{i}") for i, a in enumerate(alts))
        if s.get("nullable") is True:
            inner = {k: v for k, v in s.items() if k != "nullable"}
            return f"{self.value(inner, path)} | {self.term('null')}"
        if "const" in s:
            return self.term(_literal_regex(s["const"]))
        if "enum" in s:
            vals = s["enum"]
            if not isinstance(vals, list) or not vals:
                raise SchemaError("enum", f"enum must be a non-empty list (at {path})")
            return " | ".join(self.term(_literal_regex(v)) for v in vals)
        t = s.get("type")
        if isinstance(t, list):
            if not t:
                raise SchemaError("type", f"type must not be an empty list (at {path})")
            return " | ".join(self.value({**s, "type": one}, path) for one in t)
        if t is None:  # untyped: the type its keywords imply, else any value
            implied = [name for name, kws in (("object", {"properties", "required", "additionalProperties"}),
                                              ("array", {"items", "minItems", "maxItems"}),
                                              ("string", {"minLength", "maxLength", "pattern", "format"}))
                       if kws & s.keys()]
            if not implied:
                self._check(s, set(), path)
                return self.any_value()
            t = implied[0]
        builder = {"string": self._string, "integer": self._integer, "number": self._number,
                   "boolean": self._boolean, "null": self._null, "object": self._object, "array": self._array}
        if t not in builder:
            raise SchemaError("type", f"unknown type {t!r} at {path}")
        return builder[t](s, path)

    def _check(self, s: dict, allowed: set[str], path: str) -> None:
        extra = set(s) - allowed - ANNOTATIONS - {"type", "nullable"}
        if extra:
            kw = sorted(extra)[0]
            raise SchemaError(kw, f"keyword {kw!r} is not supported for type {s.get('type')!r} (at {path})")

    def _string(self, s: dict, path: str) -> str:
        self._check(s, {"minLength", "maxLength", "pattern", "format"}, path)
        if "pattern" in s:
            if {"minLength", "maxLength", "format"} & s.keys():
                raise SchemaError("pattern", f"pattern together with minLength/maxLength/format is not supported (at {path})")
            pat = s["pattern"]
            if not isinstance(pat, str):
                raise SchemaError("pattern", f"pattern must be a string (at {path})")
            try:
                parse(pat)
            except RegexError as exc:
                raise SchemaError("pattern", f"pattern at {path}: {exc}") from None
            body = pat
            body = body[1:] if body.startswith("^") else _CHAR + "*(?:" + body
            if not pat.startswith("^"):
                body += ")"
            tail_anchor = body.endswith("$") and not body.endswith("\\$")
            body = body[:-1] if tail_anchor else body + _CHAR + "*"
            return self.term('"(?:' + body + ')"')
        if "format" in s:
            if {"minLength", "maxLength"} & s.keys():
                raise SchemaError("format", f"format together with minLength/maxLength is not supported (at {path})")
            fmt = s["format"]
            if fmt not in FORMATS:
                raise SchemaError("format", f"string format {fmt!r} is not supported (supported: {', '.join(sorted(FORMATS))})")
            return self.term('"' + FORMATS[fmt] + '"')
        lo = s.get("minLength", 0)
        hi = s.get("maxLength")
        for kw, v in (("minLength", lo), ("maxLength", hi)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise SchemaError(kw, f"{kw} must be a non-negative integer (at {path})")
        if hi is not None and hi < lo:
            raise SchemaError("maxLength", f"maxLength {hi} is below minLength {lo} (at {path})")
        rep = "*" if lo == 0 and hi is None else f"{{{lo},{'' if hi is None else hi}}}"
        return self.term('"' + _CHAR + rep + '"')

    def _integer(self, s: dict, path: str) -> str:
        self._check(s, {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"}, path)
        lo, hi = s.get("minimum"), s.get("maximum")
        for kw in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
            v = s.get(kw)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int | float)):
                raise SchemaError(kw, f"{kw} must be a number (at {path})")
        if lo is not None:
            lo = math.ceil(lo)
        if hi is not None:
            hi = math.floor(hi)
        if s.get("exclusiveMinimum") is not None:
            e = math.floor(s["exclusiveMinimum"]) + 1
            lo = e if lo is None else max(lo, e)
        if s.get("exclusiveMaximum") is not None:
            e = math.ceil(s["exclusiveMaximum"]) - 1
            hi = e if hi is None else min(hi, e)
        if lo is None and hi is None:
            return self.term(_INT)
        return self.term(int_range_regex(lo, hi))

    def _number(self, s: dict, path: str) -> str:
        self._check(s, {"minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"}, path)
        for kw in ("maximum", "exclusiveMaximum", "exclusiveMinimum"):
            if kw in s:
                raise SchemaError(kw, f"{kw} on type number is not supported (use type integer for ranges) at {path}")
        if "minimum" in s:
            if s["minimum"] != 0:
                raise SchemaError("minimum", f"on type number only minimum 0 is supported (at {path})")
            return self.term(_NUM[2:])
        return self.term(_NUM)

    def _boolean(self, s: dict, path: str) -> str:
        self._check(s, set(), path)
        return f"{self.term('true')} | {self.term('false')}"

    def _null(self, s: dict, path: str) -> str:
        self._check(s, set(), path)
        return self.term("null")

    def _object(self, s: dict, path: str) -> str:
        self._check(s, {"properties", "required", "additionalProperties"}, path)
        props = s.get("properties") or {}
        required = s.get("required") or []
        if not isinstance(props, dict):
            raise SchemaError("properties", f"properties must be an object (at {path})")
        if not isinstance(required, list) or any(r not in props for r in required):
            missing = [r for r in required if r not in props] if isinstance(required, list) else required
            raise SchemaError("required", f"required names properties that are not declared: {missing} (at {path})")
        extra = s.get("additionalProperties", False if props else True)
        lb, rb = self.term(r"\{"), self.term(r"\}")
        if not props:
            if extra is False:
                return f"{lb} {rb}"
            return self._free_object(self.value(extra, path + "/additionalProperties"))
        if extra is not False:
            raise SchemaError("additionalProperties",
                              f"additionalProperties must be false (or absent) when properties are given (at {path})")
        names = list(props)
        colon = self.term(":")
        ws = f"[ \\t\\n\\r]{{0,{self.max_ws}}}"
        items = []
        for k in names:
            v = self.value(props[k], f"{path}/properties/{k}")
            key = _literal_regex(k)
            items.append((self.term(key), self.term("," + ws + key), colon, v, k in required))
        # tails[i]: properties i.. once one was written (their comma-prefixed keys tell
        # LALR(1) which comes next); the object opens with any optional property up to the
        # first required one.
        tails: list[str | None] = [None] * (len(items) + 1)
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
        inner = self.rule(" | ".join(alts), "props")
        all_optional = not required
        return f"{lb} {inner} {rb}" + (f" | {lb} {rb}" if all_optional else "")

    def _free_object(self, value: str) -> str:
        lb, rb, colon, comma = self.term(r"\{"), self.term(r"\}"), self.term(":"), self.term(",")
        key = self.term('"' + _CHAR + '*"')
        pair = self.rule(f"{key} {colon} {value}", "pair")
        return f"{lb} [{pair} ({comma} {pair})*] {rb}"

    def _array(self, s: dict, path: str) -> str:
        self._check(s, {"items", "minItems", "maxItems"}, path)
        item = self.value(s.get("items", True), path + "/items")
        lo = s.get("minItems", 0)
        hi = s.get("maxItems")
        for kw, v in (("minItems", lo), ("maxItems", hi)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise SchemaError(kw, f"{kw} must be a non-negative integer (at {path})")
        if hi is not None and hi < lo:
            raise SchemaError("maxItems", f"maxItems {hi} is below minItems {lo} (at {path})")
        if lo > MAX_EXPANDED_ITEMS or (hi is not None and hi > MAX_EXPANDED_ITEMS and hi != lo):
            if hi is not None and hi > MAX_EXPANDED_ITEMS:
                raise SchemaError("maxItems", f"maxItems above {MAX_EXPANDED_ITEMS} is not supported (at {path})")
            raise SchemaError("minItems", f"minItems above {MAX_EXPANDED_ITEMS} is not supported (at {path})")
        lb, rb, comma = self.term(r"\["), self.term(r"\]"), self.term(",")
        if hi is None:
            more = f"({comma} {item})*"
        else:
            more = ""
            for _ in range(hi - max(lo, 1)):  # nested optional tails: at most hi items
                more = f"[{comma} {item} {more}]".replace(" ]", "]")
        if lo == 0:
            seq = f"{item} {more}".strip()
            return f"{lb} [{seq}] {rb}" if hi != 0 else f"{lb} {rb}"
        body = " ".join([item] + [f"{comma} {item}"] * (lo - 1) + ([more] if more else []))
        return f"{lb} {body} {rb}"

    def any_value(self) -> str:
        name = self.memo.get("any")
        if name is not None:
            return name
        name = self.memo["any"] = self._name("any")
        self.rules[name] = ""
        obj = self._free_object(name)
        lb, rb, comma = self.term(r"\["), self.term(r"\]"), self.term(",")
        arr = f"{lb} [{name} ({comma} {name})*] {rb}"
        scalars = [self.term('"' + _CHAR + '*"'), self.term(_NUM), self.term("true"), self.term("false"), self.term("null")]
        self.rules[name] = " | ".join([self.rule(obj, "obj"), self.rule(arr, "arr")] + scalars)
        return name


def schema_to_lark(schema, max_ws: int = 2) -> str:
    """The Lark grammar for ``schema`` (a dict/bool, or its JSON text)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise SchemaError("json_schema", f"the schema is not valid JSON: {exc}") from None
    return SchemaGrammar(schema, max_ws).build()
