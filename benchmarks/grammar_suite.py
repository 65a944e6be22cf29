"""The structured-generation suite: JSON Schemas written for radixd (flat, nested, arrays,
enums, optional fields, patterns, formats, anyOf, $ref and recursion), regexes and Lark
grammars, plus a seeded generator of documents valid under each schema.

Used by tests/test_grammars.py and benchmarks/grammar_bench.py.
"""

from __future__ import annotations

import random
import string

S = {"type": "string"}
INT = {"type": "integer"}
N = {"type": "number"}
B = {"type": "boolean"}


def obj(props: dict, required=None, **kw) -> dict:
    return {"type": "object", "properties": props, "required": list(props) if required is None else required, **kw}


SCHEMAS: dict[str, dict] = {
    # flat
    "flat_person": obj({"name": S, "age": INT}),
    "flat_product": obj({"id": INT, "title": S, "price": N, "in_stock": B}),
    "flat_point": obj({"x": N, "y": N}),
    "flat_bools": obj({"a": B, "b": B, "c": B}),
    "flat_nullable": obj({"note": {"type": ["string", "null"]}, "count": INT}),
    "flat_strlen": obj({"code": {"type": "string", "minLength": 2, "maxLength": 6}, "label": {"type": "string", "maxLength": 12}}),
    "flat_int_range": obj({"percent": {"type": "integer", "minimum": 0, "maximum": 100},
                           "temp": {"type": "integer", "minimum": -40, "maximum": 60}}),
    "flat_int_open": obj({"positive": {"type": "integer", "minimum": 1}, "nonpos": {"type": "integer", "maximum": 0}}),
    "flat_exclusive": obj({"n": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10}}),
    "flat_nonneg_number": obj({"amount": {"type": "number", "minimum": 0}}),
    "flat_many": obj({f"f{i}": (S if i % 3 == 0 else INT if i % 3 == 1 else B) for i in range(12)}),
    "flat_unicode_keys": obj({"名前": S, "âge": INT}),
    # optional fields
    "opt_all": obj({"a": S, "b": INT, "c": B}, required=[]),
    "opt_some": obj({"id": INT, "nickname": S, "email": {"type": "string", "format": "email"}, "active": B}, required=["id", "active"]),
    "opt_last_required": obj({"x": INT, "y": INT, "z": INT}, required=["z"]),
    "opt_first_required": obj({"x": INT, "y": INT, "z": INT}, required=["x"]),
    "opt_nested": obj({"user": obj({"name": S, "bio": S}, required=["name"]), "meta": obj({"v": INT}, required=[])}, required=["user"]),
    # enums and consts
    "enum_color": obj({"color": {"enum": ["red", "green", "blue"]}}),
    "enum_mixed": obj({"v": {"enum": ["on", "off", 1, 0, True, None]}}),
    "enum_status": obj({"status": {"type": "string", "enum": ["todo", "doing", "done"]}, "priority": {"enum": [1, 2, 3]}}),
    "const_version": obj({"version": {"const": "1.0"}, "kind": {"const": "event"}, "payload": S}),
    "enum_top": {"enum": ["yes", "no", "maybe"]},
    # patterns and formats
    "pattern_phone": obj({"phone": {"type": "string", "pattern": r"^\+?[0-9]{3}-[0-9]{3}-[0-9]{4}$", "examples": ["+123-456-7890", "555-123-4567"]}}),
    "pattern_zip": obj({"zip": {"type": "string", "pattern": r"^[0-9]{5}(-[0-9]{4})?$", "examples": ["12345", "12345-6789"]}}),
    "pattern_sku": obj({"sku": {"type": "string", "pattern": r"^[A-Z]{3}-[0-9]{2,4}$", "examples": ["ABC-12", "XYZ-9876"]}}),
    "pattern_hex": obj({"color": {"type": "string", "pattern": r"^#[0-9a-f]{6}$", "examples": ["#a0b1c2", "#ffffff"]}}),
    "format_date": obj({"born": {"type": "string", "format": "date"}}),
    "format_datetime": obj({"at": {"type": "string", "format": "date-time"}, "tz": S}),
    "format_uuid": obj({"id": {"type": "string", "format": "uuid"}}),
    "format_email": obj({"to": {"type": "string", "format": "email"}, "cc": {"type": "array", "items": {"type": "string", "format": "email"}, "maxItems": 3}}),
    "format_time_ip": obj({"t": {"type": "string", "format": "time"}, "ip": {"type": "string", "format": "ipv4"}}),
    # arrays
    "array_ints": {"type": "array", "items": INT},
    "array_bounded": obj({"tags": {"type": "array", "items": S, "minItems": 1, "maxItems": 4}}),
    "array_exact": obj({"rgb": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 255}, "minItems": 3, "maxItems": 3}}),
    "array_objects": {"type": "array", "items": obj({"k": S, "v": INT}), "maxItems": 5},
    "array_nested": obj({"matrix": {"type": "array", "items": {"type": "array", "items": N, "maxItems": 4}, "maxItems": 4}}),
    "array_enum_items": obj({"days": {"type": "array", "items": {"enum": ["mon", "tue", "wed", "thu", "fri"]}}}),
    # nested
    "nested_address": obj({"name": S, "address": obj({"street": S, "city": S, "zip": {"type": "string", "pattern": r"^[0-9]{5}$", "examples": ["90210"]}})}),
    "nested_order": obj({"order_id": INT, "customer": obj({"id": INT, "name": S}),
                         "items": {"type": "array", "items": obj({"sku": S, "qty": {"type": "integer", "minimum": 1, "maximum": 99}}), "minItems": 1, "maxItems": 5},
                         "total": N}),
    "nested_deep": obj({"a": obj({"b": obj({"c": obj({"d": obj({"e": INT})})})})}),
    "nested_event": obj({"event": {"enum": ["click", "view"]}, "at": {"type": "string", "format": "date-time"},
                         "context": obj({"page": S, "ref": {"type": ["string", "null"]}}, required=["page"])}),
    "nested_config": obj({"server": obj({"host": S, "port": {"type": "integer", "minimum": 1, "maximum": 65535}}),
                          "debug": B, "workers": {"type": "integer", "minimum": 1, "maximum": 64}}),
    # anyOf / oneOf
    "anyof_scalar": obj({"value": {"anyOf": [INT, S, B]}}),
    "oneof_shape": obj({"shape": {"oneOf": [obj({"circle": N}), obj({"square": N})]}}),
    "anyof_nullable_obj": obj({"owner": {"anyOf": [obj({"login": S}), {"type": "null"}]}}),
    "anyof_list_or_str": obj({"items": {"anyOf": [{"type": "array", "items": INT, "maxItems": 4}, S]}}),
    # $ref and recursion
    "ref_defs": {"$defs": {"money": obj({"amount": N, "currency": {"enum": ["USD", "EUR"]}})},
                 **obj({"price": {"$ref": "#/$defs/money"}, "tax": {"$ref": "#/$defs/money"}})},
    "recursive_tree": {"$defs": {"node": obj({"value": INT, "children": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 3}}, required=["value"])},
                       "$ref": "#/$defs/node"},
    "recursive_list": {"$defs": {"cell": obj({"head": INT, "tail": {"anyOf": [{"type": "null"}, {"$ref": "#/$defs/cell"}]}})},
                       "$ref": "#/$defs/cell"},
    "recursive_comment": obj({"text": S, "replies": {"type": "array", "items": {"$ref": "#"}, "maxItems": 2}}, required=["text"]),
    # free-form
    "json_object": {"type": "object"},
    "free_map": obj({"labels": {"type": "object", "additionalProperties": S}}),
    "any_value": obj({"data": {}}),
    # number bounds, pattern with length, extra keys beside properties, allOf, exact oneOf, tuples
    "number_bounds": obj({"lat": {"type": "number", "minimum": -90, "maximum": 90},
                          "ratio": {"type": "number", "exclusiveMinimum": 0, "maximum": 1}}),
    "pattern_length": obj({"slug": {"type": "string", "pattern": "^[a-z0-9-]+$", "minLength": 3, "maxLength": 8,
                                    "examples": ["abc", "a-b-c-9", "hello-42"]}}),
    "extra_props": obj({"id": INT}, additionalProperties=S),
    "pattern_props": {"type": "object", "patternProperties": {"^x-": INT}, "additionalProperties": False},
    "allof_merge": {"allOf": [obj({"id": {"type": "integer", "minimum": 1}}), obj({"name": S}, required=[])]},
    "oneof_tagged": {"oneOf": [obj({"kind": {"const": "cat"}, "lives": {"type": "integer", "minimum": 0, "maximum": 9}}),
                               obj({"kind": {"const": "dog"}, "good": B})]},
    "tuple_point": {"type": "array", "prefixItems": [N, N], "items": False, "minItems": 2},
}

REGEXES: dict[str, tuple[str, list[str]]] = {
    "phone": (r"\(\d{3}\) \d{3}-\d{4}", ["(555) 123-4567"]),
    "iso_date": (r"\d{4}-\d{2}-\d{2}", ["2024-02-29"]),
    "ipv4": (r"((25[0-5]|2[0-4]\d|1?\d?\d)\.){3}(25[0-5]|2[0-4]\d|1?\d?\d)", ["192.168.0.1"]),
    "answer": (r"(yes|no)(, because [a-z ]{1,40})?\.", ["yes, because it is sunny.", "no."]),
    "words": (r"[A-Z][a-z]+( [a-z]+){2,6}\.", ["The cat sat on mats."]),
}

LARK: dict[str, tuple[str, list[str]]] = {
    "arithmetic": ("""
start: expr
?expr: term (("+" | "-") term)*
?term: factor (("*" | "/") factor)*
?factor: NUMBER | "(" expr ")" | "-" factor
NUMBER: /[0-9]+(\\.[0-9]+)?/
%ignore " "
""", ["1+2*3", "(4 - 2) * 7.5", "-(1+(2*(3)))/4"]),
    "sql": ("""
start: select
select: "SELECT"i columns "FROM"i NAME where? order? limit? ";"?
columns: "*" | NAME ("," NAME)*
where: "WHERE"i cond (("AND"i | "OR"i) cond)*
cond: NAME OP value
order: "ORDER"i "BY"i NAME ("ASC"i | "DESC"i)?
limit: "LIMIT"i INT
?value: INT | STRING | NAME
OP: "=" | "<" | ">" | "<=" | ">=" | "!="
NAME: /[a-z_][a-z0-9_]*/
INT: /[0-9]+/
STRING: /'[^']*'/
%ignore /[ \\t\\n]+/
""", ["SELECT name, age FROM users WHERE age > 30 AND city = 'Paris' ORDER BY age DESC LIMIT 10;",
      "select * from t"]),
}

# ---------------------------------------------------------------------------------------------
# Valid documents
# ---------------------------------------------------------------------------------------------

_ALPHABET = string.ascii_letters + string.digits + " .,-_!?'" + "é中ß" + '"\\/'
_FORMAT_SAMPLES = {
    "date": lambda r: f"{r.randint(1900, 2099)}-{r.randint(1, 12):02d}-{r.randint(1, 28):02d}",
    "time": lambda r: f"{r.randint(0, 23):02d}:{r.randint(0, 59):02d}:{r.randint(0, 59):02d}",
    "date-time": lambda r: f"{r.randint(1900, 2099)}-{r.randint(1, 12):02d}-{r.randint(1, 28):02d}T"
                           f"{r.randint(0, 23):02d}:{r.randint(0, 59):02d}:{r.randint(0, 59):02d}Z",
    "uuid": lambda r: "-".join("".join(r.choice("0123456789abcdef") for _ in range(n)) for n in (8, 4, 4, 4, 12)),
    "email": lambda r: "".join(r.choice(string.ascii_lowercase) for _ in range(r.randint(1, 8))) + "@example.com",
    "ipv4": lambda r: ".".join(str(r.randint(0, 255)) for _ in range(4)),
}


def example(schema, rng: random.Random, root=None, depth: int = 0):
    """A random document valid under ``schema`` (the suite's subset of JSON Schema)."""
    root = schema if root is None else root
    if schema is True or schema == {}:
        return rng.choice([1, "x", None, True, [1, 2], {"k": "v"}])
    if "$ref" in schema:
        node = root
        for part in [p for p in schema["$ref"][1:].split("/") if p]:
            node = node[part]
        return example(node, rng, root, depth + 1)
    if "const" in schema:
        return schema["const"]
    if "enum" in schema:
        return rng.choice(schema["enum"])
    if "allOf" in schema:  # the suite's allOf branches are objects: their union, in order
        merged = {"type": "object", "properties": {}, "required": []}
        for branch in schema["allOf"]:
            merged["properties"].update(branch.get("properties", {}))
            merged["required"] += branch.get("required", [])
        return example(merged, rng, root, depth)
    for kw in ("anyOf", "oneOf"):
        if kw in schema:
            alts = schema[kw]
            return example(alts[0] if depth > 4 else rng.choice(alts), rng, root, depth + 1)
    if schema.get("nullable") and rng.random() < 0.3:
        return None
    t = schema.get("type")
    if isinstance(t, list):
        return example({**schema, "type": rng.choice(t)}, rng, root, depth)
    if t == "string":
        if "examples" in schema:
            return rng.choice(schema["examples"])
        if "format" in schema:
            return _FORMAT_SAMPLES[schema["format"]](rng)
        lo = schema.get("minLength", 0)
        hi = min(schema.get("maxLength", lo + 10), lo + 10)
        return "".join(rng.choice(_ALPHABET) for _ in range(rng.randint(lo, hi)))
    if t == "integer":
        lo = schema.get("minimum", -1000)
        hi = schema.get("maximum", 1000)
        if "exclusiveMinimum" in schema:
            lo = schema["exclusiveMinimum"] + 1
        if "exclusiveMaximum" in schema:
            hi = schema["exclusiveMaximum"] - 1
        return rng.randint(lo, hi)
    if t == "number":
        lo = schema.get("minimum", schema.get("exclusiveMinimum", -1000))
        hi = schema.get("maximum", schema.get("exclusiveMaximum", 1000))
        while True:
            v = rng.choice([lo, hi]) if rng.random() < 0.2 else round(rng.uniform(lo, hi), rng.randint(0, 3))
            v = int(v) if rng.random() < 0.3 and lo <= int(v) <= hi else v
            if schema.get("exclusiveMinimum") != v and schema.get("exclusiveMaximum") != v:
                return v
    if t == "boolean":
        return rng.random() < 0.5
    if t == "null":
        return None
    if t == "object":
        props = schema.get("properties", {})
        patterns = schema.get("patternProperties", {})
        extra = schema.get("additionalProperties", not props and not patterns)
        req = set(schema.get("required", []))
        doc = {k: example(v, rng, root, depth + 1) for k, v in props.items()
               if k in req or (depth < 4 and rng.random() < 0.6)}
        for i in range(rng.randint(0, 3)):  # extra keys after the declared ones
            if patterns and (extra is False or rng.random() < 0.5):
                prefix, sub = rng.choice(sorted(patterns.items()))
                doc[prefix.lstrip("^") + f"k{i}"] = example(sub, rng, root, depth + 1)
            elif extra is not False:
                doc[f"k{i}"] = example(extra if isinstance(extra, dict) else {}, rng, root, depth + 1)
        return doc
    if t == "array" and "prefixItems" in schema:
        head = schema["prefixItems"]
        n = rng.randint(schema.get("minItems", 0), len(head))
        return [example(sub, rng, root, depth + 1) for sub in head[:n]]
    if t == "array":
        lo = schema.get("minItems", 0)
        hi = min(schema.get("maxItems", lo + 3), lo + 3)
        n = lo if depth > 4 else rng.randint(lo, hi)
        return [example(schema.get("items", {}), rng, root, depth + 1) for _ in range(n)]
    raise ValueError(f"no example for {schema}")
