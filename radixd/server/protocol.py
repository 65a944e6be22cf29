"""Parse OpenAI-style and native request bodies into prompts and ``SamplingParams``.

Unknown fields are refused (400 naming them) rather than ignored; radixd's extensions in the
style of vLLM/SGLang (``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``,
``ignore_eos``, ``stop_token_ids``, ``skip_special_tokens``) are accepted on both routes, and so are the grammar constraints ``regex``, ``json_schema`` and
``ebnf`` (Lark) besides OpenAI's ``response_format``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from radixd.core.errors import InvalidRequest
from radixd.core.sampling_params import SamplingParams
from radixd.server.errors import ApiError

EXTENSIONS = {
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "min_tokens": "min_new_tokens",
    "ignore_eos": "ignore_eos",
    "stop_token_ids": "stop_token_ids",
    "skip_special_tokens": "skip_special_tokens",
}

# The request fields of each route as JSON Schema: the one description of what radixd
# accepts. The field sets the parsers below allow (``check_fields``) are these tables' keys,
# and ``radixd.server.openapi`` publishes them at ``/openapi.json``. Ranges are the ones
# ``SamplingParams`` and the parsers enforce (a test sends the schema's edges).


def _opt(schema: dict) -> dict:
    """A field that may also be null (the parsers treat null as absent)."""
    return {"anyOf": [schema, {"type": "null"}]}


# "x-radixd" marks what depends on the server (its model name, vocabulary, limits): the
# OpenAPI document fills those bounds in per server
_INT = {"type": "integer"}
_STR = {"type": "string"}
_TEXT = {"type": "string", "minLength": 1}
_BOOL = {"type": "boolean"}
_MODEL = {"type": "string", "x-radixd": "model"}
_TOKEN = {"type": "integer", "minimum": 0, "x-radixd": "token"}
_IDS = {"type": "array", "items": _TOKEN}
_STOP_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 2**31 - 1}}
_STOP_STR = {"type": "string", "minLength": 1}
_STOP = {"anyOf": [_STOP_STR, {"type": "array", "items": _STOP_STR, "x-radixd": "stop"}]}
CONSTRAINTS = ("regex", "json_schema", "ebnf")  # SGLang-style extras, also on the OpenAI routes
CONSTRAINT_SCHEMAS = {"regex": _opt(_STR), "json_schema": _opt({"type": ["object", "string", "boolean"]}),
                      "ebnf": _opt(_STR)}
SAMPLING_SCHEMAS: dict[str, dict] = {   # shared by /v1/chat/completions and /v1/completions
    "model": _opt(_MODEL),
    "stream": _opt(_BOOL),
    "stream_options": _opt({"type": "object", "additionalProperties": False,
                            "properties": {"include_usage": _BOOL, "continuous_usage_stats": _BOOL}}),
    "n": _opt({"type": "integer", "minimum": 1, "x-radixd": "n"}),
    "stop": _opt(_STOP),
    "max_tokens": _opt({"type": "integer", "minimum": 0}),
    "temperature": _opt({"type": "number", "minimum": 0, "maximum": 2}),
    "top_p": _opt({"type": "number", "exclusiveMinimum": 0, "maximum": 1}),
    "seed": _opt({"type": "integer", "minimum": 0, "maximum": 2**63 - 1}),
    "frequency_penalty": _opt({"type": "number", "minimum": -2, "maximum": 2}),
    "presence_penalty": _opt({"type": "number", "minimum": -2, "maximum": 2}),
    "user": _opt(_STR),
    "priority": _opt(_INT),
    "top_k": _opt({"type": "integer", "minimum": -1, "maximum": 2**31 - 1}),
    "min_p": _opt({"type": "number", "minimum": 0, "maximum": 1}),
    "repetition_penalty": _opt({"type": "number", "exclusiveMinimum": 0, "maximum": 10}),
    "min_tokens": _opt({"type": "integer", "minimum": 0}),
    "ignore_eos": _opt(_BOOL),
    "stop_token_ids": _opt(_STOP_IDS),
    "skip_special_tokens": _opt(_BOOL),
    **CONSTRAINT_SCHEMAS,
    "response_format": _opt({
        "type": "object", "required": ["type"], "additionalProperties": False,
        "properties": {"type": {"enum": ["text", "json_object", "json_schema"]},
                       "json_schema": {"type": "object", "required": ["schema"], "additionalProperties": False,
                                       "properties": {"name": _STR, "schema": {"type": "object"}, "strict": _BOOL,
                                                      "description": _STR}}}}),
}
_TEXT_PART = {"type": "object", "required": ["type", "text"],
              "properties": {"type": {"const": "text"}, "text": _STR}}
MESSAGE_SCHEMA = {  # (an assistant message's content may also be null)
    "type": "object", "required": ["role", "content"],
    "properties": {"role": {"enum": ["system", "user", "assistant", "developer", "tool"]},
                   "content": {"anyOf": [_STR, {"type": "array", "items": _TEXT_PART}]}},
}
MESSAGES = {"type": "array", "minItems": 1, "items": MESSAGE_SCHEMA}
CHAT_SCHEMAS = {**SAMPLING_SCHEMAS, "messages": MESSAGES,
                "max_completion_tokens": _opt({"type": "integer", "minimum": 0}),
                "logprobs": _opt(_BOOL), "top_logprobs": _opt({"type": "integer", "minimum": 0, "maximum": 20})}
PROMPT = {"anyOf": [_TEXT, {"type": "array", "minItems": 1, "items": _TEXT},
                    {"type": "array", "minItems": 1, "items": _TOKEN},
                    {"type": "array", "minItems": 1, "items": {**_IDS, "minItems": 1}}]}
COMPLETION_SCHEMAS = {**SAMPLING_SCHEMAS, "prompt": PROMPT, "echo": _opt(_BOOL),
                      "logprobs": _opt({"type": "integer", "minimum": 0, "maximum": 5})}
NATIVE_PARAM_SCHEMAS = {
    "max_new_tokens": {"type": "integer", "minimum": 0},
    "min_new_tokens": {"type": "integer", "minimum": 0},
    "temperature": {"type": "number", "minimum": 0, "maximum": 100},
    "top_p": SAMPLING_SCHEMAS["top_p"]["anyOf"][0],
    "top_k": SAMPLING_SCHEMAS["top_k"]["anyOf"][0],
    "min_p": SAMPLING_SCHEMAS["min_p"]["anyOf"][0],
    "repetition_penalty": SAMPLING_SCHEMAS["repetition_penalty"]["anyOf"][0],
    "frequency_penalty": SAMPLING_SCHEMAS["frequency_penalty"]["anyOf"][0],
    "presence_penalty": SAMPLING_SCHEMAS["presence_penalty"]["anyOf"][0],
    "seed": _opt(SAMPLING_SCHEMAS["seed"]["anyOf"][0]),
    "stop": _opt(_STOP),
    "stop_token_ids": _opt(_STOP_IDS),
    "ignore_eos": _BOOL,
    "n": {"type": "integer", "minimum": 1, "x-radixd": "n"},
    "logprobs": _BOOL,
    "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 20},
    "skip_special_tokens": _BOOL,
    "prompt_logprobs_from": _opt({"type": "integer", "minimum": 0}),
    **CONSTRAINT_SCHEMAS,
}
NATIVE_SAMPLING = _opt({"type": "object", "additionalProperties": False, "properties": NATIVE_PARAM_SCHEMAS})
NATIVE_SCHEMAS = {
    "text": {"anyOf": [_TEXT, {"type": "array", "minItems": 1, "items": _TEXT}]},
    "input_ids": {"anyOf": [{**_IDS, "minItems": 1}, {"type": "array", "minItems": 1, "items": {**_IDS, "minItems": 1}}]},
    "sampling_params": {"anyOf": [NATIVE_SAMPLING, {"type": "array", "items": NATIVE_SAMPLING}]},
    "stream": _BOOL,
    "priority": _INT,
}
NATIVE_ONE_OF = [{"required": ["text"]}, {"required": ["input_ids"]}]  # exactly one of them
TOKENIZE_SCHEMAS = {"prompt": _STR, "messages": MESSAGES, "model": _opt(_MODEL), "add_special_tokens": _BOOL}
TOKENIZE_ONE_OF = [{"required": ["prompt"]}, {"required": ["messages"]}]
DETOKENIZE_SCHEMAS = {"tokens": _IDS, "model": _opt(_MODEL)}
TEMPLATE_SCHEMAS = {"messages": MESSAGES, "add_generation_prompt": _BOOL, "model": _opt(_MODEL)}

COMMON = set(SAMPLING_SCHEMAS)
CHAT_FIELDS = set(CHAT_SCHEMAS)
COMPLETION_FIELDS = set(COMPLETION_SCHEMAS)
NATIVE_FIELDS = set(NATIVE_SCHEMAS)
NOT_SUPPORTED = {"tools", "tool_choice", "functions", "function_call", "logit_bias",
                 "suffix", "best_of", "parallel_tool_calls", "audio", "modalities", "prediction",
                 "reasoning_effort", "store", "metadata", "service_tier"}


@dataclass
class Limits:
    default_max_tokens: int
    max_stop_sequences: int


@dataclass
class ParsedRequest:
    params: SamplingParams
    stream: bool
    include_usage: bool
    model: str | None
    priority: int = 0


def check_fields(body: dict, allowed: set[str]) -> None:
    for key in body:
        if key in NOT_SUPPORTED:
            raise ApiError(400, f"'{key}' is not supported by this server", param=key, code="unsupported_parameter")
        if key not in allowed:
            raise ApiError(400, f"unrecognized request argument: '{key}'", param=key, code="unknown_parameter")


def _type(body: dict, key: str, kinds: tuple, what: str) -> Any:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) and bool not in kinds:
        raise ApiError(400, f"'{key}' must be {what}", param=key)
    if not isinstance(value, kinds):
        raise ApiError(400, f"'{key}' must be {what}", param=key)
    return value


def sampling_from_openai(body: dict, limits: Limits, *, chat: bool) -> ParsedRequest:
    stream = _type(body, "stream", (bool,), "a boolean") or False
    opts = _type(body, "stream_options", (dict,), "an object") or {}
    if opts and not stream:
        raise ApiError(400, "'stream_options' is only allowed when 'stream' is true", param="stream_options")
    unknown = set(opts) - {"include_usage", "continuous_usage_stats"}
    if unknown:
        raise ApiError(400, f"unrecognized stream option: '{sorted(unknown)[0]}'", param="stream_options")
    include_usage = bool(opts.get("include_usage", False))

    max_tokens = _type(body, "max_tokens", (int,), "an integer")
    if chat:
        mct = _type(body, "max_completion_tokens", (int,), "an integer")
        if mct is not None:
            max_tokens = mct
    if max_tokens is None:
        max_tokens = limits.default_max_tokens
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    elif not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise ApiError(400, "'stop' must be a string or a list of strings", param="stop")
    if len(stop) > limits.max_stop_sequences:
        raise ApiError(400, f"'stop' may hold at most {limits.max_stop_sequences} sequences", param="stop")

    kw: dict[str, Any] = dict(max_new_tokens=max_tokens, stop=stop)
    for key in ("temperature", "top_p", "frequency_penalty", "presence_penalty"):
        v = _type(body, key, (int, float), "a number")
        if v is not None:
            kw[key] = float(v)
    for key in ("n", "seed"):
        v = _type(body, key, (int,), "an integer")
        if v is not None:
            kw[key] = v
    for key, target in EXTENSIONS.items():
        if body.get(key) is not None:
            kw[target] = body[key]
    if "temperature" in kw and not 0.0 <= kw["temperature"] <= 2.0:
        raise ApiError(400, f"'temperature' must be in [0, 2], got {kw['temperature']}", param="temperature")
    if chat:
        lp = _type(body, "logprobs", (bool,), "a boolean") or False
        top = _type(body, "top_logprobs", (int,), "an integer")
        if top is not None and not lp:
            raise ApiError(400, "'top_logprobs' requires 'logprobs': true", param="top_logprobs")
        kw["logprobs"] = lp
        kw["top_logprobs"] = top or 0
    else:
        lp = _type(body, "logprobs", (int,), "an integer")
        if lp is not None:
            if not 0 <= lp <= 5:
                raise ApiError(400, f"'logprobs' must be in [0, 5], got {lp}", param="logprobs")
            kw["logprobs"] = True
            kw["top_logprobs"] = lp
    kw.update(_constraint(body))
    _type(body, "user", (str,), "a string")
    model = _type(body, "model", (str,), "a string")
    priority = _type(body, "priority", (int,), "an integer") or 0
    return ParsedRequest(params=make_params(kw), stream=stream, include_usage=include_usage, model=model,
                         priority=priority)


def _constraint(body: dict) -> dict[str, Any]:
    """``response_format`` and the native ``regex``/``json_schema``/``ebnf`` fields (at most one)."""
    out: dict[str, Any] = {k: body[k] for k in CONSTRAINTS if body.get(k) is not None}
    rf = body.get("response_format")
    if rf is not None:
        if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema"):
            raise ApiError(400, "'response_format.type' must be 'text', 'json_object' or 'json_schema'",
                           param="response_format")
        extra = set(rf) - {"type", "json_schema"}
        if extra or ("json_schema" in rf and rf["type"] != "json_schema"):
            what = sorted(extra)[0] if extra else "json_schema"
            raise ApiError(400, f"unrecognized field 'response_format.{what}' (for type {rf['type']!r})",
                           param="response_format")
        if rf["type"] == "json_object":
            out["json_schema"] = {"type": "object"}
        elif rf["type"] == "json_schema":
            js = rf.get("json_schema")
            if not isinstance(js, dict) or "schema" not in js:
                raise ApiError(400, "'response_format.json_schema' must be an object with a 'schema'",
                               param="response_format")
            unknown = set(js) - {"name", "schema", "strict", "description"}
            if unknown:
                raise ApiError(400, f"unrecognized field 'response_format.json_schema.{sorted(unknown)[0]}'",
                               param="response_format")
            for key, kind, what in (("name", str, "a string"), ("description", str, "a string"),
                                    ("strict", bool, "a boolean"), ("schema", dict, "an object")):
                if key in js and not isinstance(js[key], kind):
                    raise ApiError(400, f"'response_format.json_schema.{key}' must be {what}", param="response_format")
            out["json_schema"] = js["schema"]
        if rf["type"] != "text" and len(out) > 1:
            raise ApiError(400, "give at most one of response_format, regex, json_schema, ebnf", param="response_format")
    if len(out) > 1:
        raise ApiError(400, f"give at most one of regex, json_schema, ebnf (got {', '.join(sorted(out))})",
                       param=sorted(out)[1])
    return out


def make_params(kw: dict[str, Any], aliases: dict[str, str] | None = None) -> SamplingParams:
    """Build ``SamplingParams``; its validation errors become 400s naming the API field."""
    back = {v: k for k, v in (aliases or {}).items()}
    back.update({v: k for k, v in EXTENSIONS.items()})
    back.setdefault("max_new_tokens", "max_tokens")
    try:
        return SamplingParams(**kw)
    except InvalidRequest as exc:
        param = back.get(exc.field, exc.field)
        raise ApiError(400, f"'{param}': {exc.message}", param=param) from exc
    except TypeError as exc:  # a wrongly typed value reached the dataclass
        raise ApiError(400, str(exc)) from exc


NATIVE_PARAMS = set(NATIVE_PARAM_SCHEMAS)


def sampling_from_native(sp: Any) -> SamplingParams:
    if sp is None:
        sp = {}
    if not isinstance(sp, dict):
        raise ApiError(400, "'sampling_params' must be an object", param="sampling_params")
    for key in sp:
        if key not in NATIVE_PARAMS:
            raise ApiError(400, f"unrecognized sampling parameter: '{key}'", param=f"sampling_params.{key}")
    try:
        return SamplingParams(**sp)
    except InvalidRequest as exc:
        raise ApiError(400, f"'sampling_params.{exc.field}': {exc.message}", param=f"sampling_params.{exc.field}") from exc


def chat_messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise ApiError(400, "'messages' must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise ApiError(400, f"'messages[{i}]' must be an object", param="messages")
        role = m.get("role")
        if role not in ("system", "user", "assistant", "developer", "tool"):
            raise ApiError(400, f"'messages[{i}].role' must be system, user, assistant, developer or tool",
                           param="messages")
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ApiError(400, f"'messages[{i}].content' parts must be text parts", param="messages")
                parts.append(part["text"])
            content = "".join(parts)
        elif content is None and role == "assistant":
            content = ""
        if not isinstance(content, str):
            raise ApiError(400, f"'messages[{i}].content' must be a string or a list of text parts",
                           param="messages")
        out.append({"role": "system" if role == "developer" else role, "content": content})
    return out


def completion_prompts(body: dict) -> list[str | list[int]]:
    """``prompt`` may be a string, a list of strings, a list of token ids or a list of lists."""
    p = body.get("prompt")
    if isinstance(p, str):
        return [p]
    if isinstance(p, list) and p:
        if all(isinstance(x, str) for x in p):
            return list(p)
        if all(isinstance(x, int) and not isinstance(x, bool) for x in p):
            return [list(p)]
        if all(isinstance(x, list) and x and all(isinstance(t, int) and not isinstance(t, bool) for t in x) for x in p):
            return [list(x) for x in p]
    raise ApiError(400, "'prompt' must be a string, a list of strings, a list of token ids or a list of "
                        "token-id lists (non-empty)", param="prompt")
