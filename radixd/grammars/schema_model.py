"""What a JSON Schema says, apart from how a grammar is built for it: the error naming a
keyword radixd cannot enforce, the keywords that only annotate, the keywords of each type
(which say nothing of instances of other types) and so the types an untyped schema's keywords
imply, length and size ranges, and JSON values compared, typed and read as exact
decimals as JSON Schema does.

Shared by the grammar builder (``json_schema`` and the terminal modules beside it) and the
allOf/oneOf algebra (``schema_algebra``); it imports neither, so their imports point one way.
"""

from __future__ import annotations

import json
from decimal import Decimal


class SchemaError(ValueError):
    """A schema radixd cannot enforce; ``keyword`` names the keyword."""

    def __init__(self, keyword: str, message: str):
        super().__init__(message)
        self.keyword = keyword


ANNOTATIONS = {"title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated",
               "readOnly", "writeOnly", "$defs", "definitions", "strict", "name"}
# The keywords that apply to the instances of one type only: a keyword says nothing about
# instances of the other types (JSON Schema), so {"type": ["string", "null"], "maxLength": 3}
# allows null. radixd enforces some of each type's and refuses the others by name.
TYPE_KEYWORDS: dict[str, frozenset[str]] = {
    "object": frozenset({"properties", "required", "additionalProperties", "patternProperties", "minProperties",
                         "maxProperties", "propertyNames", "dependentRequired", "dependentSchemas", "dependencies",
                         "unevaluatedProperties"}),
    "array": frozenset({"items", "minItems", "maxItems", "prefixItems", "additionalItems", "uniqueItems", "contains",
                        "minContains", "maxContains", "unevaluatedItems"}),
    "string": frozenset({"minLength", "maxLength", "pattern", "format", "contentEncoding", "contentMediaType",
                         "contentSchema"}),
    "number": frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"}),
}
_TYPED = frozenset().union(*TYPE_KEYWORDS.values())


def for_type(s: dict, t: str) -> dict:
    """``s`` as it applies to the instances of type ``t``: less the keywords of other types."""
    own = TYPE_KEYWORDS.get("number" if t == "integer" else t, frozenset())
    return {k: v for k, v in s.items() if k in own or k not in _TYPED}


def implied_types(s: dict) -> list[str]:
    """The types whose keywords an untyped schema has, in the order object, array, string,
    number: it is generated as those types (valid: values of other types pass too)."""
    return [t for t, kws in TYPE_KEYWORDS.items() if kws & s.keys()]


def foreign_to(s: dict, values: list) -> set[str]:
    """The keywords of ``s`` that apply to no type among ``values`` (they say nothing of them)."""
    kinds = {json_type(v) for v in values}
    return {k for k in s if any(k in kws and t not in kinds for t, kws in TYPE_KEYWORDS.items())}


def count_bounds(s: dict, lo_kw: str, hi_kw: str, path: str) -> tuple[int, int | None]:
    """A length or size range (minLength/maxLength, minItems/maxItems): (lo, hi), lo 0 and hi
    None when absent; each must be a non-negative integer."""
    lo = s.get(lo_kw, 0)
    hi = s.get(hi_kw)
    for kw, v in ((lo_kw, lo), (hi_kw, hi)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            raise SchemaError(kw, f"{kw} must be a non-negative integer (at {path})")
    return lo, hi


def exact_decimal(v: int | float) -> Decimal:
    """The exact decimal a JSON number is written as (a float by its shortest repr)."""
    return Decimal(v) if isinstance(v, int) else Decimal(repr(v))


def value_key(v) -> str:
    """A canonical text for a JSON value under JSON Schema equality (1 == 1.0, true != 1)."""
    if isinstance(v, bool) or v is None or isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, int | float):
        return "n:" + str(exact_decimal(v).normalize())
    if isinstance(v, list):
        return "[" + ",".join(value_key(x) for x in v) + "]"
    return "{" + ",".join(json.dumps(k) + ":" + value_key(v[k]) for k in sorted(v)) + "}"


def json_type(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int | float):
        return "number"
    return {str: "string", list: "array", dict: "object"}[type(v)]


def fits_type(v, types: set[str]) -> bool:
    """Whether the JSON value ``v`` has one of the type names ``types`` (an integral number
    is an integer too)."""
    t = json_type(v)
    if t == "number":
        integral = isinstance(v, int) or (isinstance(v, float) and v.is_integer())
        return "number" in types or ("integer" in types and integral)
    return t in types
