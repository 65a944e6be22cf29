"""The OpenAI routes' fields beyond radixd's own: the ones that ask for nothing, and vLLM's extras.

Clients written for OpenAI's or vLLM's server send fields whatever they want; a field radixd
has no behaviour for is accepted only at a value that asks for nothing (``NO_OPS``: null,
its default, an empty list, ``best_of`` equal to ``n``) and is otherwise a 400 naming it.
vLLM's extras that radixd does implement are read here into what the rest of the server
takes: ``structured_outputs`` and the older ``guided_*`` fields into radixd's constraints
(``regex`` / ``json_schema`` / ``ebnf``), ``logit_bias`` and ``include_stop_str_in_output``
into ``SamplingParams`` fields, and the prompt and template options into ``Extras``.
The schemas here join ``protocol``'s field tables (and so ``/openapi.json``).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from radixd.core.sampling_params import LOGIT_BIAS_MAX
from radixd.server.errors import ApiError

_NULL = {"type": "null"}
_BOOL = {"type": "boolean"}
_STR = {"type": "string"}
_EMPTY = {"type": "array", "maxItems": 0}


def nullable(schema: dict) -> dict:
    """A field that may also be null (the parsers treat null as absent)."""
    return {"anyOf": [schema, _NULL]}


_opt = nullable


@dataclass(frozen=True)
class NoOp:
    """A field accepted only where it asks for nothing: ``schema`` says which values those are
    (``/openapi.json``), ``idle(value, body)`` checks one (null is always idle)."""

    schema: dict
    idle: Callable[[Any, dict], bool]
    meaning: str  # what radixd does with it (the README's table)


def _is(expected: Any) -> Callable[[Any, dict], bool]:
    return lambda value, body: value == expected and type(value) is type(expected)


def _empty(value: Any, body: dict) -> bool:
    return value == [] and isinstance(value, list)


def _no_keys(value: Any, body: dict) -> bool:
    return value == {} and isinstance(value, dict)


def _best_of(value: Any, body: dict) -> bool:
    n = body.get("n")
    return type(value) is int and value == (1 if n is None else n)


def _boolean(value: Any, body: dict) -> bool:
    return isinstance(value, bool)


_BOTH = ("chat", "completion")
_CHAT = ("chat",)
_COMPLETION = ("completion",)

# name -> (routes, NoOp)
NO_OPS: dict[str, tuple[tuple[str, ...], NoOp]] = {
    "best_of": (_BOTH, NoOp({"type": "integer", "minimum": 1, "description": "equal to n"}, _best_of,
                            "accepted equal to `n` (one candidate per returned sample)")),
    "use_beam_search": (_BOTH, NoOp({"const": False}, _is(False), "accepted `false`: sampling, no beam search")),
    "length_penalty": (_BOTH, NoOp({"const": 1.0}, lambda v, b: v == 1 and not isinstance(v, bool),
                                   "accepted `1.0` (it only weighs beams)")),
    "store": (_CHAT, NoOp({"const": False}, _is(False), "accepted `false`: nothing is stored")),
    "metadata": (_CHAT, NoOp({"type": "object", "maxProperties": 0}, _no_keys, "accepted `{}` (it tags stored "
                                                                             "completions)")),
    "functions": (_CHAT, NoOp(_EMPTY, _empty, "accepted `[]` (the legacy form of `tools`; send `tools`)")),
    "function_call": (_CHAT, NoOp({"const": "none"}, _is("none"), "accepted `\"none\"` (the legacy form of "
                                                                 "`tool_choice`; send `tool_choice`)")),
    "service_tier": (_CHAT, NoOp({"enum": ["auto", "default"]}, lambda v, b: v in ("auto", "default"),
                                 "accepted `\"auto\"` / `\"default\"`: one tier")),
    "modalities": (_CHAT, NoOp({"type": "array", "items": {"const": "text"}},
                               lambda v, b: isinstance(v, list) and all(m == "text" for m in v),
                               "accepted `[\"text\"]`: text out")),
    "audio": (_CHAT, NoOp(_NULL, lambda v, b: False, "accepted null: no audio")),
    "prediction": (_CHAT, NoOp(_NULL, lambda v, b: False, "accepted null: no predicted outputs")),
    "reasoning_effort": (_CHAT, NoOp(_NULL, lambda v, b: False, "accepted null")),
    "suffix": (_COMPLETION, NoOp({"const": ""}, _is(""), "accepted `\"\"`: no insertion")),
    "lora_path": (_BOTH, NoOp(_NULL, lambda v, b: False, "accepted null: the base model")),
    "allowed_token_ids": (_BOTH, NoOp(_NULL, lambda v, b: False, "accepted null")),
    "bad_words": (_BOTH, NoOp(_EMPTY, _empty, "accepted `[]`")),
    "logits_processors": (_BOTH, NoOp(_EMPTY, _empty, "accepted `[]`")),
    "return_tokens_as_token_ids": (_BOTH, NoOp({"const": False}, _is(False), "accepted `false`")),
    "return_token_ids": (_BOTH, NoOp({"const": False}, _is(False), "accepted `false`")),
    "chat_template": (_CHAT, NoOp(_NULL, lambda v, b: False, "accepted null: the model's template")),
    "documents": (_CHAT, NoOp(_EMPTY, _empty, "accepted `[]`")),
    "mm_processor_kwargs": (_CHAT, NoOp({"type": "object", "maxProperties": 0}, _no_keys, "accepted `{}`: text only")),
    "guided_decoding_backend": (_BOTH, NoOp(_NULL, lambda v, b: False, "accepted null: radixd's grammar backend")),
    "guided_whitespace_pattern": (_BOTH, NoOp(_NULL, lambda v, b: False, "accepted null")),
    "structural_tag": (_BOTH, NoOp(_NULL, lambda v, b: False, "accepted null")),
    "cache_salt": (_BOTH, NoOp(_NULL, lambda v, b: False, "accepted null")),
    "kv_transfer_params": (_BOTH, NoOp(_NULL, lambda v, b: False, "accepted null")),
    "vllm_xargs": (_BOTH, NoOp(_NULL, lambda v, b: False, "accepted null")),
}


def no_op_schemas(route: str) -> dict[str, dict]:
    return {k: _opt(op.schema) for k, (routes, op) in NO_OPS.items() if route in routes}


def check_no_op(key: str, body: dict, route_takes: bool, table: dict | None = None) -> None:
    """A ``NO_OPS`` field (or one of ``table``, a route's own table of that shape): fine, on a
    route that takes it, at a value that asks for nothing; a 400 naming it otherwise."""
    value = body[key]
    op = (NO_OPS if table is None else table)[key][1]
    if route_takes and (value is None or op.idle(value, body)):
        return
    how = f" ({key}: {op.meaning})" if route_takes else ""
    raise ApiError(400, f"'{key}' is not supported by this server{how}", param=key, code="unsupported_parameter")


# ------------------------------------------------------------------------ vLLM's extras

_CHOICE = {"type": "array", "minItems": 1, "items": _STR}
_JSON = {"type": ["object", "string", "boolean"]}
STRUCTURED = {"type": "object", "additionalProperties": False, "properties": {
    "json": _opt(_JSON), "regex": _opt(_STR), "choice": _opt(_CHOICE), "grammar": _opt(_STR),
    "json_object": _opt(_BOOL), "disable_fallback": _opt(_BOOL), "disable_any_whitespace": _opt({"const": False}),
    "disable_additional_properties": _opt({"const": False}), "whitespace_pattern": _NULL,
    "structural_tag": _NULL}}
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
_LOGIT_BIAS = {"type": "object", "propertyNames": {"pattern": "^[0-9]+$"},
               "additionalProperties": {"type": "number", "minimum": -LOGIT_BIAS_MAX, "maximum": LOGIT_BIAS_MAX}}
EXTRA_SCHEMAS: dict[str, dict] = {  # both OpenAI routes
    "structured_outputs": _opt(STRUCTURED),
    "guided_json": _opt(_JSON), "guided_regex": _opt(_STR), "guided_choice": _opt(_CHOICE),
    "guided_grammar": _opt(_STR),
    "logit_bias": _opt(_LOGIT_BIAS),
    "include_stop_str_in_output": _opt(_BOOL),
    "spaces_between_special_tokens": _opt(_BOOL),
    "truncate_prompt_tokens": _opt({"type": "integer", "minimum": -1}),
    "prompt_logprobs": _opt({"type": "integer", "minimum": 0, "maximum": 20, "x-radixd": "top_logprobs"}),
}
CHAT_EXTRA_SCHEMAS = {"add_generation_prompt": _opt(_BOOL), "continue_final_message": _opt(_BOOL), "echo": _opt(_BOOL),
                      "chat_template_kwargs": _opt({"type": "object"})}


@dataclass
class Extras:
    """What vLLM's extras ask of the route (besides ``SamplingParams``)."""

    truncate_prompt_tokens: int | None = None  # keep the last N prompt tokens (-1: what fits)
    prompt_logprobs: int | None = None         # the prompt tokens' logprobs in the response, and
                                               # this many alternatives for each
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    echo: str = ""  # chat's ``echo``: the last message's text when it is the assistant's


def _typed(body: dict, key: str, kind: type | tuple, what: str) -> Any:
    value = body.get(key)
    if value is not None and (isinstance(value, bool) and kind is not bool or not isinstance(value, kind)):
        raise ApiError(400, f"'{key}' must be {what}", param=key)
    return value


def read_extras(body: dict, *, chat: bool) -> Extras:
    _typed(body, "spaces_between_special_tokens", bool, "a boolean")
    ex = Extras()
    trunc = _typed(body, "truncate_prompt_tokens", int, "an integer")
    if trunc is not None and (trunc == 0 or trunc < -1):
        raise ApiError(400, f"'truncate_prompt_tokens' must be >= 1 or -1, got {trunc}", param="truncate_prompt_tokens")
    ex.truncate_prompt_tokens = trunc
    plp = _typed(body, "prompt_logprobs", int, "an integer")
    if plp is not None and plp < 0:
        raise ApiError(400, f"'prompt_logprobs' must be >= 0, got {plp}", param="prompt_logprobs")
    ex.prompt_logprobs = plp
    if chat:
        agp = _typed(body, "add_generation_prompt", bool, "a boolean")
        cfm = _typed(body, "continue_final_message", bool, "a boolean")
        ex.continue_final_message = bool(cfm)
        ex.add_generation_prompt = (not cfm) if agp is None else agp
        if ex.continue_final_message and ex.add_generation_prompt:
            raise ApiError(400, "'continue_final_message' cannot be used with 'add_generation_prompt': true",
                           param="continue_final_message")
        ex.template_kwargs = _typed(body, "chat_template_kwargs", dict, "an object") or {}
        if _typed(body, "echo", bool, "a boolean"):
            ex.echo = _last_assistant_text(body.get("messages"))
        reserved = set(ex.template_kwargs) & {"messages", "add_generation_prompt", "continue_final_message",
                                              "tokenize", "conversation"}
        if reserved:
            raise ApiError(400, f"'chat_template_kwargs.{sorted(reserved)[0]}' is set by the request itself",
                           param="chat_template_kwargs")
    return ex


def _last_assistant_text(messages: Any) -> str:
    """vLLM's chat ``echo``: the reply leads with the last message when it is the assistant's
    (a prefill the model continues); its text parts joined by newlines."""
    last = messages[-1] if isinstance(messages, list) and messages else None
    if not isinstance(last, dict) or last.get("role") != "assistant":
        return ""
    content = last.get("content") or ""
    if isinstance(content, list):
        return "\n".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content if isinstance(content, str) else ""


def sampling_extras(body: dict) -> dict[str, Any]:
    """``SamplingParams`` fields from ``logit_bias`` and ``include_stop_str_in_output``."""
    kw: dict[str, Any] = {}
    if _typed(body, "include_stop_str_in_output", bool, "a boolean"):
        kw["include_stop_str_in_output"] = True
    bias = _typed(body, "logit_bias", dict, "an object mapping token ids to biases")
    if bias:
        out = {}
        for key, value in bias.items():
            if not (isinstance(key, str) and key.isascii() and key.isdigit()):
                raise ApiError(400, f"'logit_bias' keys must be token ids, got {key!r}", param="logit_bias")
            out[int(key)] = value
        kw["logit_bias"] = out
    return kw


def structured_constraint(body: dict) -> dict[str, Any]:
    """``structured_outputs`` / ``guided_*`` as radixd's constraint fields (``regex``,
    ``json_schema``, ``ebnf``); each given field counts, so two are refused by the caller."""
    given: list[tuple[str, str, Any]] = []  # (field as the client named it, kind, value)
    so = body.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise ApiError(400, "'structured_outputs' must be an object", param="structured_outputs")
        unknown = set(so) - set(STRUCTURED["properties"])
        if unknown:
            raise ApiError(400, f"unrecognized field 'structured_outputs.{sorted(unknown)[0]}'",
                           param="structured_outputs")
        for key in ("disable_any_whitespace", "disable_additional_properties", "whitespace_pattern",
                    "structural_tag"):
            if so.get(key):
                raise ApiError(400, f"'structured_outputs.{key}' is not supported by this server",
                               param="structured_outputs", code="unsupported_parameter")
        if so.get("disable_fallback") is not None and not isinstance(so["disable_fallback"], bool):
            raise ApiError(400, "'structured_outputs.disable_fallback' must be a boolean", param="structured_outputs")
        jo = so.get("json_object")
        if jo is not None and not isinstance(jo, bool):
            raise ApiError(400, "'structured_outputs.json_object' must be a boolean", param="structured_outputs")
        if jo:
            given.append(("structured_outputs.json_object", "json", {"type": "object"}))
        given += [(f"structured_outputs.{k}", k, so[k]) for k in ("json", "regex", "choice", "grammar")
                  if so.get(k) is not None]
    given += [(name, kind, body[name]) for name, kind in GUIDED.items() if body.get(name) is not None]
    out: dict[str, Any] = {}
    for name, kind, value in given:
        param = name.split(".")[0]
        if kind == "json":
            if not isinstance(value, dict | str | bool):
                raise ApiError(400, f"'{name}' must be a JSON Schema (an object) or its JSON text", param=param)
            target, spec = "json_schema", value
        elif kind == "choice":
            if not (isinstance(value, list) and value and all(isinstance(c, str) for c in value)):
                raise ApiError(400, f"'{name}' must be a non-empty list of strings", param=param)
            target, spec = "regex", "|".join(f"(?:{re.escape(c)})" for c in value)
        else:
            if not isinstance(value, str):
                raise ApiError(400, f"'{name}' must be a string", param=param)
            target, spec = ("regex", value) if kind == "regex" else ("ebnf", _lark(name, param, value))
        if target in out or len(given) > 1:
            raise ApiError(400, f"give at most one structured output (got {', '.join(g[0] for g in given)})",
                           param=param)
        out[target] = spec
    return out


_GBNF = re.compile(r"^\s*[A-Za-z_][\w-]*\s*::=", re.M)


def _lark(name: str, param: str, grammar: str) -> str:
    """A grammar in Lark's syntax (radixd's ``ebnf``); GBNF (``rule ::= ...``, llama.cpp's and
    xgrammar's dialect) is refused by name rather than misread."""
    if _GBNF.search(grammar):
        raise ApiError(400, f"'{name}' is GBNF ('rule ::= ...'); this server takes grammars in Lark's syntax "
                            "('rule: ...', start rule 'start')", param=param, code="unsupported_parameter")
    return grammar
