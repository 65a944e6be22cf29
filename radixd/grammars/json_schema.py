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
"""

from __future__ import annotations

import json
import re
from decimal import ROUND_CEILING, ROUND_FLOOR, Decimal, InvalidOperation

from radixd.grammars.regex_dfa import C, RegexError, is_empty, parse
from radixd.grammars.schema_algebra import Algebra
from radixd.grammars.schema_model import (
    ANNOTATIONS,
    IMPLIED_TYPES,
    SchemaError,
    json_type,
    value_key,
)

# one character of a JSON string: raw, a short escape, or \uXXXX outside the surrogates (a lone
# surrogate is no character, and a pair would count as two toward a length bound)
_CHAR = r'(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u(?:[0-9a-cA-CefEF][0-9a-fA-F]{3}|[dD][0-7][0-9a-fA-F]{2}))'
# an unescaped character: where a pattern applies, the written text is the string itself
_RAW = r'[^"\\\x00-\x1f]'
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
_AT, _AT_BEGIN, _AT_BEGIN_STRING, _AT_END, _AT_END_STRING = C.AT, C.AT_BEGINNING, C.AT_BEGINNING_STRING, C.AT_END, C.AT_END_STRING


def _lark_regex(rx: str) -> str:
    return "/" + rx.replace("/", "\\/") + "/"


def _literal_regex(value) -> str:
    return re.escape(json.dumps(value, ensure_ascii=False, separators=(",", ":")))


def _spelled_regex(text: str) -> str:
    """Every JSON spelling of the string content ``text``: each character raw (where JSON
    allows it), as a short escape, or as \\uXXXX (hex digits in either case; a surrogate
    pair above U+FFFF)."""
    short = {'"': '"', "\\": "\\", "/": "/", "\b": "b", "\f": "f", "\n": "n", "\r": "r", "\t": "t"}

    def hex4(n: int) -> str:
        return "".join(f"[{d.lower()}{d.upper()}]" if d.isalpha() else d for d in f"{n:04x}")

    out = []
    for ch in text:
        cp = ord(ch)
        alts = [] if ch in '"\\' or cp < 0x20 else [re.escape(ch)]
        if ch in short:
            alts.append(re.escape("\\" + short[ch]))
        if cp > 0xFFFF:
            hi, lo = 0xD800 + ((cp - 0x10000) >> 10), 0xDC00 + ((cp - 0x10000) & 0x3FF)
            alts.append(r"\\u" + hex4(hi) + r"\\u" + hex4(lo))
        else:
            alts.append(r"\\u" + hex4(cp))
        out.append("(?:" + "|".join(alts) + ")")
    return "".join(out)


def _not_any(contents: list[str]) -> str:
    """A look-ahead refusing the string contents ``contents`` (before the closing quote)."""
    return f'(?!(?:{"|".join(contents)})"\\Z)' if contents else ""


def _has_anchor(items) -> bool:
    """Whether a parsed pattern has ^/$/\\A/\\Z anywhere (nested groups included)."""
    for op, av in items:
        if op is _AT:
            return True
        if op is C.BRANCH:
            subs = av[1]
        elif op is C.SUBPATTERN:
            subs = [av[3]]
        elif op in (C.MAX_REPEAT, C.MIN_REPEAT):
            subs = [av[2]]
        elif op in (C.ASSERT, C.ASSERT_NOT):
            subs = [av[1]]
        else:
            subs = []
        if any(_has_anchor(list(sub)) for sub in subs):
            return True
    return False


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


_MAG = r"(?:0|[1-9][0-9]*)"
_FRAC = r"(?:\.[0-9]+)?"
MAX_BOUND_DIGITS = 60


def _split(m: Decimal) -> tuple[int, str]:
    """A non-negative decimal as (integer part, fraction digits without trailing zeros)."""
    whole, _, frac = f"{m:f}".partition(".")
    return int(whole), frac.rstrip("0")


def _frac_ge(f: str, strict: bool) -> list[str]:
    """Fraction parts (``""`` = none) whose value is >= 0.f (> when ``strict``)."""
    if not f:
        return [r"\.[0-9]*[1-9][0-9]*"] if strict else ["", r"\.[0-9]+"]
    out = [rf"\.{f[:k]}[{int(d) + 1}-9][0-9]*" for k, d in enumerate(f) if d != "9"]
    return out + [rf"\.{f}[0-9]*[1-9][0-9]*" if strict else rf"\.{f}[0-9]*"]


def _frac_le(f: str, strict: bool) -> list[str]:
    """Fraction parts (``""`` = none) whose value is <= 0.f (< when ``strict``)."""
    if not f:
        return [] if strict else ["", r"\.0+"]
    out = [""] + [rf"\.{f[:k]}[0-{int(d) - 1}][0-9]*" for k, d in enumerate(f) if d != "0"]
    out += [rf"\.{f[:k]}" for k in range(1, len(f))]
    return out + ([] if strict else [rf"\.{f}0*"])


def _alts(parts: list[str]) -> str | None:
    return "(?:" + "|".join(parts) + ")" if parts else None


def _mag_ge(m: Decimal, strict: bool) -> str:
    """Non-negative decimals (no exponent) >= m (> when ``strict``), m >= 0."""
    a, f = _split(m)
    parts = [f"(?:{_nonneg_range(a + 1, None)}){_FRAC}"]
    fr = _alts(_frac_ge(f, strict))
    if fr:
        parts.append(f"{a}{fr}")
    return _alts(parts)


def _mag_le(m: Decimal, strict: bool) -> str | None:
    """Non-negative decimals (no exponent) <= m (< when ``strict``), m >= 0; None if none."""
    a, f = _split(m)
    parts = [f"(?:{_bounded(0, a - 1)}){_FRAC}"] if a >= 1 else []
    fr = _alts(_frac_le(f, strict))
    if fr:
        parts.append(f"{a}{fr}")
    return _alts(parts)


def number_range_regex(lo: Decimal | None, lo_strict: bool, hi: Decimal | None, hi_strict: bool) -> str:
    """A regex for JSON numbers written without an exponent whose exact decimal value lies
    between the bounds (either may be None; ``*_strict`` makes that end exclusive). With an
    exponent the set is not regular (``0.000...1e+N`` against a bound needs counting), so
    bounded numbers are generated in positional notation, which can write every value."""
    any_mag = _MAG + _FRAC
    ge = le = None
    if lo is not None:
        if lo >= 0:
            ge = _mag_ge(lo, lo_strict)
        else:
            neg = _mag_le(-lo, lo_strict)
            ge = f"(?:{any_mag}|-{neg})" if neg else any_mag
    if hi is not None:
        if hi > 0 or (hi == 0 and not hi_strict):
            le = f"(?:-{any_mag}|{_mag_le(hi, hi_strict)})"
        else:
            le = "-" + _mag_ge(-hi, hi_strict)
    if ge is None and le is None:
        return _NUM
    if ge is None or le is None:
        return ge or le
    return f"(?=(?:{ge})\\Z){le}"


MAX_MULTIPLE_SUFFIXES = 1000


def multiple_regex(m: Decimal, integer: bool) -> str | None:
    """A regex for the JSON numbers (no exponent) that are multiples of ``m`` > 0, when the
    last digits decide it: ``m = a * 10^e`` with ``a`` dividing a power of ten. None otherwise
    (3, 0.3, 0.08: divisibility that reaches further left, not written here)."""
    sign, digits, e = m.normalize().as_tuple()
    a = int("".join(map(str, digits)))
    j = next((j for j in range(7) if 10**j % a == 0), None)
    if j is None:
        return None
    if e >= 0:  # an integer step D = a * 10^e: the last J digits decide, D divides 10^J
        d, big = a * 10**e, 10 ** (j + e)
        if big // d > MAX_MULTIPLE_SUFFIXES:
            return None
        width = j + e
        small = "|".join(str(v) for v in range(0, big, d))
        tails = "|".join(f"{v:0{width}d}" for v in range(0, big, d)) if width else ""
        body = f"(?:{small})" + (f"|[1-9][0-9]*(?:{tails})" if width else "|[1-9][0-9]*")
        return f"-?(?:{body})" + ("" if integer else r"(?:\.0+)?")
    if integer:  # every integer is a multiple of a step whose fraction ...
        k = -e
        return _INT if 10**k % a == 0 else None  # ... divides 1 (0.5, 0.25, 0.01)
    k = -e
    if j > k:  # the divisibility reaches into the integer part
        return None
    if 10**k // a > MAX_MULTIPLE_SUFFIXES:
        return None
    fracs = sorted({f"{v:0{k}d}".rstrip("0") for v in range(0, 10**k, a)} - {""})
    frac = r"(?:\.0+)?" + ("|" + r"\.(?:" + "|".join(fracs) + ")0*" if fracs else "")
    return rf"-?{_MAG}(?:{frac})"


class SchemaGrammar:
    """Builds the Lark grammar text for one schema."""

    def __init__(self, schema, max_ws: int):
        self.root = schema
        self.max_ws = max_ws
        self.rules: dict[str, str] = {}
        self.terminals: dict[str, str] = {}     # regex -> terminal name
        self.memo: dict[str, str] = {}          # canonical schema / ref -> rule name
        self._n = 0
        self.algebra = Algebra(self.resolve)

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
            if extra:  # keywords beside $ref apply as well (2019-09 on): an allOf of the two
                rest = {k: v for k, v in schema.items() if k != "$ref"}
                return self.value({"allOf": [{"$ref": schema["$ref"]}, rest]}, path)
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
            implied = [name for name, kws in IMPLIED_TYPES if kws & s.keys()]
            if not implied:
                self._check(s, set(), path)
                return self.any_value()
            t = implied[0]
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
            vals = [v for v in vals if self._admits(v, rest, path)]
        if not vals:
            beside = f"the keywords beside it ({', '.join(sorted(rest))})" if rest else "both const and enum"
            raise SchemaError("enum", f"no const/enum value satisfies {beside} at {path}")
        return vals

    def _admits(self, v, s: dict, path: str) -> bool:
        """Whether the value ``v`` satisfies the scalar keywords of ``s``."""
        t = s.get("type")
        types = set(t) if isinstance(t, list) else {t} if t else None
        is_num = isinstance(v, int | float) and not isinstance(v, bool)
        integral = is_num and (isinstance(v, int) or v.is_integer())
        if types is not None and not any(jt == json_type(v) or (jt == "integer" and integral) for jt in types):
            return False
        if is_num and {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"} & s.keys():
            lo, ls, hi, hs = self._bounds(s, path)
            d = Decimal(v) if isinstance(v, int) else Decimal(repr(v))
            if (lo is not None and (d <= lo if ls else d < lo)) or (hi is not None and (d >= hi if hs else d > hi)):
                return False
        if is_num and "multipleOf" in s:
            m = s["multipleOf"]
            if isinstance(m, bool) or not isinstance(m, int | float) or m <= 0:
                raise SchemaError("multipleOf", f"multipleOf must be a number above 0 (at {path})")
            d = Decimal(v) if isinstance(v, int) else Decimal(repr(v))
            if d % (Decimal(m) if isinstance(m, int) else Decimal(repr(m))) != 0:
                return False
        if isinstance(v, str):
            if len(v) < s.get("minLength", 0) or len(v) > s.get("maxLength", len(v)):
                return False
            if "pattern" in s:
                self.pattern_content(s["pattern"], path)  # refuses what the grammar would refuse
                if not re.search(s["pattern"], v):
                    return False
            if "format" in s:
                if s["format"] not in FORMATS:
                    raise SchemaError("format", f"string format {s['format']!r} is not supported (at {path})")
                if not re.fullmatch(FORMATS[s["format"]], v):
                    return False
        return True

    def _check(self, s: dict, allowed: set[str], path: str) -> None:
        extra = set(s) - allowed - ANNOTATIONS - {"type", "nullable"}
        if extra:
            kw = sorted(extra)[0]
            raise SchemaError(kw, f"keyword {kw!r} is not supported for type {s.get('type')!r} (at {path})")

    def _string(self, s: dict, path: str) -> str:
        """One terminal: the JSON string characters, repeated within the length bounds, and
        each of pattern/format as a look-ahead over the same text (an intersection). Under a
        pattern the characters are written unescaped, so the pattern sees the string itself."""
        self._check(s, {"minLength", "maxLength", "pattern", "format"}, path)
        conds = []
        if "pattern" in s:
            conds.append(("pattern", self.pattern_content(s["pattern"], path)))
        if "format" in s:
            fmt = s["format"]
            if fmt not in FORMATS:
                raise SchemaError("format", f"string format {fmt!r} is not supported (supported: {', '.join(sorted(FORMATS))})")
            conds.append(("format", FORMATS[fmt]))
        lo = s.get("minLength", 0)
        hi = s.get("maxLength")
        for kw, v in (("minLength", lo), ("maxLength", hi)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise SchemaError(kw, f"{kw} must be a non-negative integer (at {path})")
        if hi is not None and hi < lo:
            raise SchemaError("maxLength", f"maxLength {hi} is below minLength {lo} (at {path})")
        rep = "*" if lo == 0 and hi is None else f"{{{lo},{'' if hi is None else hi}}}"
        if not conds:
            return self.term('"' + _CHAR + rep + '"')
        if len(conds) == 1 and conds[0][0] == "format" and rep == "*":
            return self.term('"' + conds[0][1] + '"')  # a format is JSON string characters already
        rx = '"' + "".join(f'(?=(?:{c})"\\Z)' for _, c in conds) + _RAW + rep + '"'
        try:
            empty = is_empty(rx)
        except RegexError as exc:
            raise SchemaError(conds[0][0], f"{conds[0][0]} at {path}: {exc}") from None
        if empty:
            kws = [kw for kw, _ in conds] + [kw for kw in ("minLength", "maxLength") if kw in s]
            raise SchemaError(conds[0][0], f"no string satisfies {' together with '.join(kws)} (at {path})")
        return self.term(rx)

    def pattern_content(self, pat, path: str) -> str:
        """A regex for the string text a JSON Schema ``pattern`` matches (search semantics:
        an end without its anchor may have any characters beyond it)."""
        if not isinstance(pat, str):
            raise SchemaError("pattern", f"pattern must be a string (at {path})")
        try:
            items = list(parse(pat)[0])
        except RegexError as exc:
            raise SchemaError("pattern", f"pattern at {path}: {exc}") from None
        head = bool(items) and items[0] in ((_AT, _AT_BEGIN), (_AT, _AT_BEGIN_STRING))
        tail = len(items) > head and items[-1] in ((_AT, _AT_END), (_AT, _AT_END_STRING))
        if _has_anchor(items[int(head):len(items) - int(tail)]):
            raise SchemaError("pattern", f"pattern {pat!r} at {path}: anchors (^, $) are supported only at "
                                         "the start and the end of the pattern")
        core = pat[(2 if pat.startswith("\\A") else 1) if head else 0:]
        core = core[:-(2 if core.endswith("\\Z") else 1)] if tail else core
        return ("" if head else _RAW + "*") + "(?:" + core + ")" + ("" if tail else _RAW + "*")

    def _bounds(self, s: dict, path: str) -> tuple[Decimal | None, bool, Decimal | None, bool]:
        """(lo, lo exclusive, hi, hi exclusive) as exact decimals; ``exclusiveMinimum``/
        ``exclusiveMaximum`` as numbers (draft 6+) or booleans beside minimum/maximum (draft 4)."""
        out = {}
        for kw in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
            v = s.get(kw)
            if v is None or (isinstance(v, bool) and kw.startswith("exclusive")):
                continue
            if isinstance(v, bool) or not isinstance(v, int | float):
                raise SchemaError(kw, f"{kw} must be a number (at {path})")
            try:
                d = Decimal(v) if isinstance(v, int) else Decimal(repr(v))
            except InvalidOperation:
                raise SchemaError(kw, f"{kw} must be a finite number (at {path})") from None
            if not d.is_finite() or abs(d.adjusted()) > MAX_BOUND_DIGITS:
                raise SchemaError(kw, f"{kw} {v!r} is outside what radixd can write as a digit range "
                                      f"(at most {MAX_BOUND_DIGITS} digits) at {path}")
            out[kw] = d
        bounds = []
        for inc, exc in (("minimum", "exclusiveMinimum"), ("maximum", "exclusiveMaximum")):
            b, strict = out.get(inc), False
            flag = s.get(exc)
            if isinstance(flag, bool):
                if flag and b is None:
                    raise SchemaError(exc, f"{exc}: true needs {inc} beside it (at {path})")
                strict = flag
            elif exc in out:
                e = out[exc]
                tighter = b is None or (e >= b if inc == "minimum" else e <= b)
                b, strict = (e, True) if tighter else (b, False)
            bounds += [b, strict]
        lo, ls, hi, hs = bounds
        if lo is not None and hi is not None and (lo > hi or (lo == hi and (ls or hs))):
            raise SchemaError("minimum", f"no number lies between the lower bound {lo} and the upper bound {hi} (at {path})")
        return lo, ls, hi, hs

    def _integer(self, s: dict, path: str) -> str:
        self._check(s, {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"}, path)
        lo, ls, hi, hs = self._bounds(s, path)
        ilo = ihi = None
        if lo is not None:
            ilo = int(lo.to_integral_value(ROUND_FLOOR)) + 1 if ls else int(lo.to_integral_value(ROUND_CEILING))
        if hi is not None:
            ihi = int(hi.to_integral_value(ROUND_CEILING)) - 1 if hs else int(hi.to_integral_value(ROUND_FLOOR))
        if ilo is not None and ihi is not None and ilo > ihi:
            raise SchemaError("minimum", f"no integer lies between the bounds {lo} and {hi} (at {path})")
        rx = _INT if ilo is None and ihi is None else int_range_regex(ilo, ihi)
        return self.term(self._multiple(s, rx, True, path))

    def _number(self, s: dict, path: str) -> str:
        self._check(s, {"minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum", "multipleOf"}, path)
        return self.term(self._multiple(s, number_range_regex(*self._bounds(s, path)), False, path))

    def _multiple(self, s: dict, rx: str, integer: bool, path: str) -> str:
        """``rx`` narrowed to the multiples of ``multipleOf`` (a look-ahead intersection)."""
        if "multipleOf" not in s:
            return rx
        m = s["multipleOf"]
        if isinstance(m, bool) or not isinstance(m, int | float) or m <= 0:
            raise SchemaError("multipleOf", f"multipleOf must be a number above 0 (at {path})")
        step = multiple_regex(Decimal(m) if isinstance(m, int) else Decimal(repr(m)), integer)
        if step is None:
            raise SchemaError("multipleOf", f"multipleOf {m} is not supported (at {path}): radixd writes multiples "
                                            "of steps whose digits end the number, a*10^k with a dividing 10^j "
                                            "(2, 5, 25, 0.5, 0.01, 100, ...), and only where the step's own "
                                            "digits do not reach into the integer part")
        out = f"(?=(?:{step})\\Z){rx}"
        if is_empty(out):
            raise SchemaError("multipleOf", f"no multiple of {m} lies within the bounds (at {path})")
        return out

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
        declared = [_spelled_regex(k) for k in props]
        contents = []
        for pat, sub in patterns.items():
            content = self.pattern_content(pat, f"{path}/patternProperties")
            clash = [k for k in props if re.search(pat, k)]
            if clash:
                raise SchemaError("patternProperties", f"patternProperties {pat!r} matches the declared propert"
                                                       f"{'ies' if len(clash) > 1 else 'y'} {clash}: its schema would "
                                                       f"apply to them as well (at {path})")
            contents.append((pat, content, sub))
        kinds = []
        for i, (pat, content, sub) in enumerate(contents):
            others = declared + [c for j, (_, c, _) in enumerate(contents) if j != i]
            rx = f'"(?=(?:{content})"\\Z)' + _not_any(others) + _RAW + '*"'
            if not is_empty(rx):
                kinds.append((rx, self.value(sub, f"{path}/patternProperties/{pat}")))
        if extra is not False:
            rx = '"' + _not_any(declared + [c for _, c, _ in contents]) + (_RAW if contents else _CHAR) + '*"'
            kinds.append((rx, self.value(extra, f"{path}/additionalProperties")))
        return kinds

    def _free_object(self, value: str) -> str:
        lb, rb, colon, comma = self.term(r"\{"), self.term(r"\}"), self.term(":"), self.term(",")
        key = self.term('"' + _CHAR + '*"')
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
        lo = s.get("minItems", 0)
        hi = s.get("maxItems")
        for kw, v in (("minItems", lo), ("maxItems", hi)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise SchemaError(kw, f"{kw} must be a non-negative integer (at {path})")
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
