"""JSON strings as regexes: the characters JSON allows (raw, escaped), the spellings of a
given text, ``pattern`` (search semantics, anchors only at the ends) and ``format``, the
length bounds, and the same keywords checked against a const/enum value.

Where a pattern or format applies, the string is written with unescaped characters only
(``RAW``) so that the look-ahead sees the string's text itself.
"""

from __future__ import annotations

import re

from radixd.grammars.regex_dfa import C, RegexError, is_empty, parse
from radixd.grammars.schema_model import SchemaError, count_bounds

# one character of a JSON string: raw, a short escape, or \uXXXX outside the surrogates (a lone
# surrogate is no character, and a pair would count as two toward a length bound)
CHAR = r'(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u(?:[0-9a-cA-CefEF][0-9a-fA-F]{3}|[dD][0-7][0-9a-fA-F]{2}))'
# an unescaped character: where a pattern applies, the written text is the string itself
RAW = r'[^"\\\x00-\x1f]'
FORMATS = {
    "date": r"[0-9]{4}-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12][0-9]|3[01])",
    "time": r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\.[0-9]{1,6})?(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])?",
    "date-time": r"[0-9]{4}-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12][0-9]|3[01])T(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9]"
                 r"(?:\.[0-9]{1,6})?(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])",
    "uuid": r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}",
    "email": r"[a-zA-Z0-9_+-]+(?:\.[a-zA-Z0-9_+-]+)*@[a-zA-Z0-9-]+(?:\.[a-zA-Z0-9-]+)*\.[a-zA-Z]{2,}",
    "ipv4": r"(?:(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])\.){3}(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])",
}
_AT, _AT_BEGIN, _AT_BEGIN_STRING, _AT_END, _AT_END_STRING = C.AT, C.AT_BEGINNING, C.AT_BEGINNING_STRING, C.AT_END, C.AT_END_STRING


def spelled_regex(text: str) -> str:
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


def not_any(contents: list[str]) -> str:
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


def string_regex(s: dict, path: str) -> str:
    """The terminal of a string: its JSON characters, repeated within the length bounds, and
    each of pattern/format as a look-ahead over the same text (an intersection). Under a
    pattern the characters are written unescaped, so the pattern sees the string itself."""
    conds = []
    if "pattern" in s:
        conds.append(("pattern", pattern_content(s["pattern"], path)))
    if "format" in s:
        fmt = s["format"]
        if fmt not in FORMATS:
            raise SchemaError("format", f"string format {fmt!r} is not supported (supported: {', '.join(sorted(FORMATS))})")
        conds.append(("format", FORMATS[fmt]))
    lo, hi = count_bounds(s, "minLength", "maxLength", path)
    if hi is not None and hi < lo:
        raise SchemaError("maxLength", f"maxLength {hi} is below minLength {lo} (at {path})")
    rep = "*" if lo == 0 and hi is None else f"{{{lo},{'' if hi is None else hi}}}"
    if not conds:
        return '"' + CHAR + rep + '"'
    if len(conds) == 1 and conds[0][0] == "format" and rep == "*":
        return '"' + conds[0][1] + '"'  # a format is JSON string characters already
    rx = '"' + "".join(f'(?=(?:{c})"\\Z)' for _, c in conds) + RAW + rep + '"'
    try:
        empty = is_empty(rx)
    except RegexError as exc:
        raise SchemaError(conds[0][0], f"{conds[0][0]} at {path}: {exc}") from None
    if empty:
        kws = [kw for kw, _ in conds] + [kw for kw in ("minLength", "maxLength") if kw in s]
        raise SchemaError(conds[0][0], f"no string satisfies {' together with '.join(kws)} (at {path})")
    return rx


def pattern_content(pat, path: str) -> str:
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
    return ("" if head else RAW + "*") + "(?:" + core + ")" + ("" if tail else RAW + "*")

def admits_string(v: str, s: dict, path: str) -> bool:
    """Whether the string ``v`` satisfies the length bounds, pattern and format of ``s``
    (refusing the pattern and format values the grammar would refuse)."""
    if len(v) < s.get("minLength", 0) or len(v) > s.get("maxLength", len(v)):
        return False
    if "pattern" in s:
        pattern_content(s["pattern"], path)  # refuses what the grammar would refuse
        if not re.search(s["pattern"], v):
            return False
    if "format" in s:
        if s["format"] not in FORMATS:
            raise SchemaError("format", f"string format {s['format']!r} is not supported (at {path})")
        if not re.fullmatch(FORMATS[s["format"]], v):
            return False
    return True
