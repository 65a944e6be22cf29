"""JSON Schema algebra for the grammar builder: ``allOf`` merged into one schema, and ``oneOf``
branches proven mutually exclusive, each only when the result is exact.

``merge_all_of`` returns one schema accepting exactly the documents every branch accepts (or
raises ``SchemaError`` naming allOf and what cannot be merged). ``excludes(a, b)`` is True
only when no document the grammar generates for ``a`` is valid under ``b``; a ``oneOf`` whose
branches pairwise exclude each other can be generated as their union, since every generated
document then matches exactly one branch.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from radixd.grammars.schema_model import (
    ANNOTATIONS,
    SchemaError,
    fits_type,
    implied_types,
    json_type,
    value_key,
)

ALL_TYPES = frozenset({"null", "boolean", "number", "string", "array", "object"})
MAX_DEPTH = 16

Resolve = Callable[[str], object]


def _types_of(t) -> set[str]:
    """Type names with integer folded into number (the two overlap: 1 is both)."""
    names = t if isinstance(t, list) else [t]
    return {"number" if n == "integer" else n for n in names if isinstance(n, str)}


class Algebra:
    """Bound to one root schema (``resolve`` follows its local ``$ref``s)."""

    def __init__(self, resolve: Resolve):
        self.resolve = resolve

    def deref(self, s, depth: int = 0):
        while isinstance(s, dict) and "$ref" in s and depth < MAX_DEPTH:
            s = self.resolve(s["$ref"])
            depth += 1
        return s

    # ------------------------------------------------------------------ oneOf

    def gen_types(self, s, depth: int = 0) -> set[str]:
        """The JSON types of the documents the grammar generates for ``s``."""
        s = self.deref(s)
        if s is True or s == {} or not isinstance(s, dict) or depth > MAX_DEPTH:
            return set(ALL_TYPES)
        for kw in ("anyOf", "oneOf"):
            if isinstance(s.get(kw), list):
                return set().union(*(self.gen_types(a, depth + 1) for a in s[kw]))
        out = self.valid_types(s, depth)
        if "type" not in s and "const" not in s and "enum" not in s:
            implied = _types_of(implied_types(s))
            if implied:
                out = implied | ({"null"} if s.get("nullable") is True else set())
        return out

    def valid_types(self, s, depth: int = 0) -> set[str]:
        """The JSON types of the documents valid under ``s`` (a superset is fine)."""
        s = self.deref(s)
        if s is False:
            return set()
        if not isinstance(s, dict) or depth > MAX_DEPTH:
            return set(ALL_TYPES)
        out = set(ALL_TYPES)
        if "type" in s:
            out = _types_of(s["type"]) | ({"null"} if s.get("nullable") is True else set())
        if "const" in s:
            out &= {json_type(s["const"])}
        if isinstance(s.get("enum"), list):
            out &= {json_type(v) for v in s["enum"]}
        for kw in ("anyOf", "oneOf"):
            if isinstance(s.get(kw), list):
                out &= set().union(*(self.valid_types(a, depth + 1) for a in s[kw]))
        for a in s.get("allOf", []) if isinstance(s.get("allOf"), list) else []:
            out &= self.valid_types(a, depth + 1)
        return out

    @staticmethod
    def values(s) -> set[str] | None:
        """The finite set of values ``s`` allows (canonical keys), None when not finite."""
        if not isinstance(s, dict):
            return None
        if "const" in s:
            return {value_key(s["const"])}
        if isinstance(s.get("enum"), list):
            return {value_key(v) for v in s["enum"]}
        return None

    def excludes(self, a, b, depth: int = 0) -> bool:
        """True only if no document generated for ``a`` is valid under ``b``."""
        a, b = self._merged(self.deref(a)), self._merged(self.deref(b))
        if b is False:
            return True
        if depth > MAX_DEPTH or a is True or b is True or not isinstance(a, dict) or not isinstance(b, dict):
            return False
        for kw in ("anyOf", "oneOf"):
            if isinstance(a.get(kw), list):
                return all(self.excludes(x, b, depth + 1) for x in a[kw])
            if isinstance(b.get(kw), list):
                return all(self.excludes(a, y, depth + 1) for y in b[kw])
        shared = self.gen_types(a) & self.valid_types(b)
        if not shared:
            return True
        va, vb = self.values(a), self.values(b)
        if va is not None and vb is not None and not va & vb:
            return True
        if shared == {"object"} and va is None:
            return self._objects_exclude(a, b, depth)
        return False

    def _objects_exclude(self, a: dict, b: dict, depth: int) -> bool:
        pa, pb = a.get("properties") or {}, b.get("properties") or {}
        a_extras = a.get("additionalProperties", not pa and "patternProperties" not in a) is not False \
            or bool(a.get("patternProperties"))
        req_a, req_b = a.get("required") or [], b.get("required") or []
        # b requires a key a never writes
        if not a_extras and any(k not in pa for k in req_b):
            return True
        # a always writes a key whose value b refuses
        for k in req_a:
            if k in pb and k in pa and self.excludes(pa[k], pb[k], depth + 1):
                return True
        # b allows no extra keys and a always writes one b does not declare
        if b.get("additionalProperties") is False and not b.get("patternProperties"):
            if any(k not in pb for k in req_a):
                return True
        return False

    def _merged(self, s):
        """``s`` with its allOf merged (as the grammar will), or as it is when that fails."""
        if isinstance(s, dict) and "allOf" in s:
            try:
                return self.merge_all_of(s, "#")
            except ValueError:
                return s
        return s

    def check_one_of(self, alts: list, path: str) -> None:
        for i, x in enumerate(alts):
            for j, y in enumerate(alts):
                if i != j and not self.excludes(x, y):
                    raise SchemaError("oneOf", f"oneOf branches {i} and {j} at {path} are not provably exclusive "
                                               "(a document could match both): use anyOf, or tell them apart by "
                                               "type, by const/enum values, or by a required property")

    # ------------------------------------------------------------------ allOf

    def branches(self, s: dict, path: str, depth: int = 0) -> list[dict]:
        """``s`` without its allOf, then its allOf branches, flattened and dereferenced."""
        if depth > MAX_DEPTH:
            raise SchemaError("allOf", f"allOf nested or referenced too deeply to merge (at {path})")
        base = {k: v for k, v in s.items() if k != "allOf" and k not in ANNOTATIONS}
        out = [base] if base else []
        alts = s["allOf"]
        if not isinstance(alts, list) or not alts:
            raise SchemaError("allOf", f"allOf must be a non-empty list (at {path})")
        for i, br in enumerate(alts):
            br = self.deref(br)
            if br is True or br == {}:
                continue
            if br is False:
                raise SchemaError("allOf", f"allOf branch {i} at {path} allows no value")
            if not isinstance(br, dict):
                raise SchemaError("allOf", f"allOf branch {i} at {path} is not a schema")
            if "$ref" in br:
                raise SchemaError("allOf", f"allOf branch {i} at {path}: a $ref cycle")
            if "allOf" in br:
                out += self.branches(br, f"{path}/allOf/{i}", depth + 1)
            else:
                out.append({k: v for k, v in br.items() if k not in ANNOTATIONS})
        return out

    def merge_all_of(self, s: dict, path: str) -> dict:
        parts = [_const_as_enum(p) for p in self.branches(s, path)]
        choices = [p for p in parts if "anyOf" in p or "oneOf" in p]
        if choices:  # allOf [A, anyOf [B1, B2]] is anyOf [allOf [A, B1], allOf [A, B2]]; same for oneOf
            if len(choices) > 1 or ("anyOf" in choices[0] and "oneOf" in choices[0]):
                raise SchemaError("allOf", f"allOf at {path} holds more than one anyOf/oneOf: not merged")
            p = choices[0]
            kw = "anyOf" if "anyOf" in p else "oneOf"
            if not isinstance(p[kw], list) or not p[kw]:
                raise SchemaError(kw, f"{kw} must be a non-empty list (at {path})")
            rest = [q for q in parts if q is not p] + [{k: v for k, v in p.items() if k != kw}]
            rest = [q for q in rest if q]
            return {kw: [{"allOf": [*rest, alt]} for alt in p[kw]]}
        merged: dict = {}
        for kw in dict.fromkeys(k for p in parts for k in p):
            vals = [p[kw] for p in parts if kw in p]
            merged[kw] = self._merge_keyword(kw, vals, path)
        if "additionalProperties" in merged or any("properties" in p for p in parts):
            self._check_extra_keys(parts, merged, path)
        if "type" in merged and isinstance(merged.get("enum"), list):
            types = set(merged["type"]) if isinstance(merged["type"], list) else {merged["type"]}
            merged["enum"] = [v for v in merged["enum"] if fits_type(v, types)]
            if not merged["enum"]:
                raise SchemaError("allOf", f"no enum/const value has the type the allOf at {path} requires")
        if merged.get("enum") == []:
            raise SchemaError("allOf", f"the allOf branches at {path} share no enum/const value")
        return merged

    def _merge_keyword(self, kw: str, vals: list, path: str):
        """One keyword's values from several branches, merged exactly (or SchemaError)."""
        if kw == "additionalProperties":  # exact once _check_extra_keys has passed
            vals = [v for v in vals if v is not True and v != {}] or [True]
            if len(vals) > 1:
                return False if False in vals else {"allOf": vals}
        if len(vals) == 1:
            return vals[0]
        if all(json.dumps(v, sort_keys=True) == json.dumps(vals[0], sort_keys=True) for v in vals):
            return vals[0]
        if kw == "type":
            common = None
            for v in vals:
                names = set(v if isinstance(v, list) else [v])
                if "number" in names:
                    names.add("integer")
                common = names if common is None else {n for n in common if n in names}
            if "number" in common:  # every branch allows any number: integer is inside it
                common.discard("integer")
            if not common:
                raise SchemaError("allOf", f"the allOf branches at {path} share no type")
            order = [n for n in ("null", "boolean", "integer", "number", "string", "array", "object") if n in common]
            return order[0] if len(order) == 1 else order
        if kw in ("minimum", "exclusiveMinimum", "minLength", "minItems"):
            return self._numbers(kw, vals, path, max)
        if kw in ("maximum", "exclusiveMaximum", "maxLength", "maxItems"):
            return self._numbers(kw, vals, path, min)
        if kw == "enum":
            keep = set.intersection(*({value_key(x) for x in v} for v in vals))
            out = [x for x in vals[0] if value_key(x) in keep]
            if not out:
                raise SchemaError("allOf", f"the allOf branches at {path} share no enum/const value")
            return out
        if kw == "required":
            return list(dict.fromkeys(k for v in vals for k in v))
        if kw == "properties":
            out: dict = {}
            for v in vals:
                for name, sub in v.items():
                    out[name] = sub if name not in out or out[name] == sub else {"allOf": [out[name], sub]}
            return out
        if kw == "items" and all(not isinstance(v, list | bool) for v in vals):
            return {"allOf": vals}
        raise SchemaError("allOf", f"allOf at {path}: the branches give {kw} different values; radixd cannot merge them exactly")

    @staticmethod
    def _numbers(kw: str, vals: list, path: str, pick):
        if any(isinstance(v, bool) or not isinstance(v, int | float) for v in vals):
            raise SchemaError("allOf", f"allOf at {path}: {kw} values {vals} cannot be merged")
        return pick(vals)

    @staticmethod
    def _check_extra_keys(parts: list[dict], merged: dict, path: str) -> None:
        """Exact only when every branch that limits extra keys declares all the properties
        the others declare (else a property of one would be an extra key of another)."""
        names = set(merged.get("properties") or {})
        for p in parts:
            extra = p.get("additionalProperties", True)
            if extra is True or extra == {}:
                continue
            missing = names - set(p.get("properties") or {})
            if missing:
                raise SchemaError("allOf", f"allOf at {path}: a branch with additionalProperties does not declare "
                                           f"{sorted(missing)}, which other branches declare; not mergeable exactly")
        if "patternProperties" in merged:
            raise SchemaError("allOf", f"allOf at {path}: patternProperties inside allOf is not supported")


def _const_as_enum(p: dict) -> dict:
    if "const" not in p:
        return p
    vals = [p["const"]]
    if isinstance(p.get("enum"), list):
        vals = [v for v in vals if value_key(v) in {value_key(x) for x in p["enum"]}]
    return {**{k: v for k, v in p.items() if k != "const"}, "enum": vals}

