"""JSON Schema numbers as regexes over their decimal digits: ``minimum``/``maximum`` (and the
exclusive bounds) as exact digit ranges, ``multipleOf`` where the last digits decide it, and
the same keywords checked against a const/enum value.

Every regex here matches JSON number text without an exponent once a bound or a step applies
(``number_range_regex`` says why); an unbounded number is ``NUMBER``, any integer ``INTEGER``.
"""

from __future__ import annotations

from decimal import ROUND_CEILING, ROUND_FLOOR, Decimal, InvalidOperation

from radixd.grammars.regex_dfa import is_empty
from radixd.grammars.schema_model import SchemaError, exact_decimal

INTEGER = r"-?(?:0|[1-9][0-9]*)"
NUMBER = r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?"
BOUND_KEYWORDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


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
        return NUMBER
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
        return INTEGER if 10**k % a == 0 else None  # ... divides 1 (0.5, 0.25, 0.01)
    k = -e
    if j > k:  # the divisibility reaches into the integer part
        return None
    if 10**k // a > MAX_MULTIPLE_SUFFIXES:
        return None
    fracs = sorted({f"{v:0{k}d}".rstrip("0") for v in range(0, 10**k, a)} - {""})
    frac = r"(?:\.0+)?" + ("|" + r"\.(?:" + "|".join(fracs) + ")0*" if fracs else "")
    return rf"-?{_MAG}(?:{frac})"


def _bounds(s: dict, path: str) -> tuple[Decimal | None, bool, Decimal | None, bool]:
    """(lo, lo exclusive, hi, hi exclusive) as exact decimals; ``exclusiveMinimum``/
    ``exclusiveMaximum`` as numbers (draft 6+) or booleans beside minimum/maximum (draft 4)."""
    out = {}
    for kw in BOUND_KEYWORDS:
        v = s.get(kw)
        if v is None or (isinstance(v, bool) and kw.startswith("exclusive")):
            continue
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise SchemaError(kw, f"{kw} must be a number (at {path})")
        try:
            d = exact_decimal(v)
        except InvalidOperation:
            raise SchemaError(kw, f"{kw} must be a finite number (at {path})") from None
        if not d.is_finite() or abs(d.adjusted()) > MAX_BOUND_DIGITS:
            raise SchemaError(kw, f"{kw} {v!r} is outside what radixd can write as a digit range "
                                  f"(at most {MAX_BOUND_DIGITS} digits) at {path}")
        out[kw] = d
    ends = []
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
        ends += [b, strict]
    lo, ls, hi, hs = ends
    if lo is not None and hi is not None and (lo > hi or (lo == hi and (ls or hs))):
        raise SchemaError("minimum", f"no number lies between the lower bound {lo} and the upper bound {hi} (at {path})")
    return lo, ls, hi, hs


def integer_regex(s: dict, path: str) -> str:
    """The integers within the bounds of ``s`` that are multiples of its ``multipleOf``."""
    lo, ls, hi, hs = _bounds(s, path)
    ilo = ihi = None
    if lo is not None:
        ilo = int(lo.to_integral_value(ROUND_FLOOR)) + 1 if ls else int(lo.to_integral_value(ROUND_CEILING))
    if hi is not None:
        ihi = int(hi.to_integral_value(ROUND_CEILING)) - 1 if hs else int(hi.to_integral_value(ROUND_FLOOR))
    if ilo is not None and ihi is not None and ilo > ihi:
        raise SchemaError("minimum", f"no integer lies between the bounds {lo} and {hi} (at {path})")
    rx = INTEGER if ilo is None and ihi is None else int_range_regex(ilo, ihi)
    return _multiple(s, rx, True, path)


def number_regex(s: dict, path: str) -> str:
    """The numbers within the bounds of ``s`` that are multiples of its ``multipleOf``."""
    return _multiple(s, number_range_regex(*_bounds(s, path)), False, path)


def _step(s: dict, path: str) -> Decimal:
    """``multipleOf`` of ``s`` as an exact decimal."""
    m = s["multipleOf"]
    if isinstance(m, bool) or not isinstance(m, int | float) or m <= 0:
        raise SchemaError("multipleOf", f"multipleOf must be a number above 0 (at {path})")
    return exact_decimal(m)


def _multiple(s: dict, rx: str, integer: bool, path: str) -> str:
    """``rx`` narrowed to the multiples of ``multipleOf`` (a look-ahead intersection)."""
    if "multipleOf" not in s:
        return rx
    m = s["multipleOf"]
    step = multiple_regex(_step(s, path), integer)
    if step is None:
        raise SchemaError("multipleOf", f"multipleOf {m} is not supported (at {path}): radixd writes multiples "
                                        "of steps whose digits end the number, a*10^k with a dividing 10^j "
                                        "(2, 5, 25, 0.5, 0.01, 100, ...), and only where the step's own "
                                        "digits do not reach into the integer part")
    out = f"(?=(?:{step})\\Z){rx}"
    if is_empty(out):
        raise SchemaError("multipleOf", f"no multiple of {m} lies within the bounds (at {path})")
    return out


def admits_number(v: int | float, s: dict, path: str) -> bool:
    """Whether the number ``v`` lies within the bounds of ``s`` and is a multiple of its
    ``multipleOf`` (refusing the keyword values the grammar would refuse)."""
    if any(kw in s for kw in BOUND_KEYWORDS):
        lo, ls, hi, hs = _bounds(s, path)
        d = exact_decimal(v)
        if (lo is not None and (d <= lo if ls else d < lo)) or (hi is not None and (d >= hi if hs else d > hi)):
            return False
    if "multipleOf" in s:
        step = _step(s, path)
        if exact_decimal(v) % step != 0:
            return False
    return True
