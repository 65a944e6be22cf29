"""Request bodies: the field tables of every route, and the parsers that read bodies by them.

Each route's fields are a table of JSON Schemas (published at ``/openapi.json`` by
``radixd.server.openapi``); a sampling field's range comes from ``SamplingParams``'s
declaration (``json_schema``), so the HTTP layer and the engine refuse the same values. The
parsers turn a body into a prompt and ``SamplingParams`` (or the route's own record), with
a 400 ``ApiError`` naming the field. Unknown fields are refused rather than ignored;
radixd's extensions in the style of vLLM/SGLang (``top_k``, ``min_p``,
``repetition_penalty``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``,
``skip_special_tokens``) are accepted on both OpenAI routes, and so are the grammar
constraints ``regex``, ``json_schema`` and ``ebnf`` (Lark) besides OpenAI's
``response_format``; fields that ask for nothing and vLLM's extras: ``openai_extras``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from radixd.core.errors import InvalidRequest
from radixd.core.sampling_params import INT32_MAX, SamplingParams, json_schema
from radixd.server import openai_extras, reasoning, tool_calls
from radixd.server.bootstrap import take_bootstrap
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


_opt = openai_extras.nullable


# "x-radixd" marks what depends on the server (its model name, vocabulary, limits): the
# OpenAPI document fills those bounds in per server
_INT = {"type": "integer"}
_STR = {"type": "string"}
_TEXT = {"type": "string", "minLength": 1}
_BOOL = {"type": "boolean"}
_MODEL = {"type": "string", "x-radixd": "model"}
_TOKEN = {"type": "integer", "minimum": 0, "x-radixd": "token"}
_IDS = {"type": "array", "items": _TOKEN}
_STOP_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": INT32_MAX}}
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
    "n": _opt({**json_schema("n"), "x-radixd": "n"}),
    "stop": _opt(_STOP),
    "max_tokens": _opt(json_schema("max_new_tokens")),
    "temperature": _opt(json_schema("temperature")),
    "top_p": _opt(json_schema("top_p")),
    "seed": _opt(json_schema("seed")),
    "frequency_penalty": _opt(json_schema("frequency_penalty")),
    "presence_penalty": _opt(json_schema("presence_penalty")),
    "user": _opt(_STR),
    "priority": _opt(_INT),
    "top_k": _opt(json_schema("top_k")),
    "min_p": _opt(json_schema("min_p")),
    "repetition_penalty": _opt(json_schema("repetition_penalty")),
    "min_tokens": _opt(json_schema("min_new_tokens")),
    "ignore_eos": _opt(_BOOL),
    "stop_token_ids": _opt(_STOP_IDS),
    "skip_special_tokens": _opt(_BOOL),
    **CONSTRAINT_SCHEMAS,
    **openai_extras.EXTRA_SCHEMAS,
    "response_format": _opt({
        "type": "object", "required": ["type"], "additionalProperties": False,
        "properties": {"type": {"enum": ["text", "json_object", "json_schema", "structural_tag"]},
                       "json_schema": {"type": "object", "required": ["schema"], "additionalProperties": False,
                                       "properties": {"name": _STR, "schema": {"type": "object"}, "strict": _BOOL,
                                                      "description": _STR}},
                       # SGLang's structural tag (radixd.grammars.structural_tag checks the rest)
                       "structures": {"type": "array", "items": {"type": "object"}},
                       "triggers": {"type": "array", "items": _STR}, "format": {"type": "object"}}}),
}
_TOP_LOGPROBS = {**json_schema("top_logprobs"), "x-radixd": "top_logprobs"}
_TEXT_PART = {"type": "object", "required": ["type", "text"],
              "properties": {"type": {"const": "text"}, "text": _STR}}
MESSAGE_SCHEMA = {  # (an assistant message's content may also be null)
    "type": "object", "required": ["role", "content"],
    "properties": {"role": {"enum": ["system", "user", "assistant", "developer", "tool"]},
                   "content": {"anyOf": [_STR, {"type": "array", "items": _TEXT_PART}]},
                   "tool_calls": _opt({"type": "array", "items": tool_calls.HISTORY_CALL}),
                   "tool_call_id": _opt(_STR), "name": _opt(_STR)},
}
MESSAGES = {"type": "array", "minItems": 1, "items": MESSAGE_SCHEMA}
CHAT_SCHEMAS = {**openai_extras.no_op_schemas("chat"), **SAMPLING_SCHEMAS, **openai_extras.CHAT_EXTRA_SCHEMAS,
                **reasoning.SCHEMAS, **tool_calls.SCHEMAS, "messages": MESSAGES,
                "max_completion_tokens": _opt(json_schema("max_new_tokens")),
                "logprobs": _opt(_BOOL), "top_logprobs": _opt(_TOP_LOGPROBS)}
PROMPT = {"anyOf": [_TEXT, {"type": "array", "minItems": 1, "items": _TEXT},
                    {"type": "array", "minItems": 1, "items": _TOKEN},
                    {"type": "array", "minItems": 1, "items": {**_IDS, "minItems": 1}}]}
EMBEDDING_SCHEMAS = {"input": PROMPT, "model": _opt(_MODEL), "encoding_format": _opt({"enum": ["float", "base64"]}),
                     "dimensions": _opt({"type": "integer", "minimum": 1, "x-radixd": "dimensions"}),
                     "user": _opt(_STR)}  # /v1/embeddings (parsed by embedding_routes)
COMPLETION_SCHEMAS = {**openai_extras.no_op_schemas("completion"), **SAMPLING_SCHEMAS, "prompt": PROMPT, "echo": _opt(_BOOL),
                      "logprobs": _opt({"type": "integer", "minimum": 0, "maximum": 5})}
NATIVE_PARAM_SCHEMAS = {  # SamplingParams's own field names (SGLang's too); null: the default
    **{name: _opt(json_schema(name)) for name in ("max_new_tokens", "min_new_tokens", "temperature", "top_p",
                                                  "top_k", "min_p", "repetition_penalty", "frequency_penalty",
                                                  "presence_penalty")},
    "seed": _opt(json_schema("seed")),
    "stop": _opt(_STOP),
    "stop_token_ids": _opt(_STOP_IDS),
    "ignore_eos": _opt(_BOOL),
    "n": _opt({**json_schema("n"), "x-radixd": "n"}),
    "logprobs": _opt(_BOOL),
    "top_logprobs": _opt(_TOP_LOGPROBS),
    "skip_special_tokens": _opt(_BOOL),
    "prompt_logprobs_from": _opt(json_schema("prompt_logprobs_from")),
    **CONSTRAINT_SCHEMAS,
    "structural_tag": _opt({"type": ["object", "string"]}),  # SGLang's: the JSON text of one
}
# SGLang's sampling parameters and /generate fields that radixd accepts only at the value that
# asks for nothing (null, this default, or an empty list/object); any other value is a 400
# naming it. SGLang hands spaces_between_special_tokens to transformers' decode, which a fast
# tokenizer ignores: at its default it changes nothing there, nor here.
NATIVE_PARAM_NOOPS: dict[str, Any] = {"spaces_between_special_tokens": True, "no_stop_trim": False,
                                      "custom_params": None, "stream_interval": None, "logit_bias": None}
NATIVE_NOOPS: dict[str, Any] = {
    "lora_path": None, "image_data": None, "video_data": None, "audio_data": None, "input_embeds": None,
    "token_ids_logprob": None, "modalities": None, "session_params": None, "custom_logit_processor": None,
    "return_hidden_states": False, "log_metrics": True, "bootstrap_host": None, "bootstrap_port": None,
    "bootstrap_room": None, "data_parallel_rank": None,
    # what SGLang's gateway (smg) writes into every /generate it forwards, at their defaults
    "background": False, "no_logs": False, "return_bytes": False, "return_entropy": False, "lora_id": None,
    "bootstrap_pair_key": None, "extra_key": None, "custom_labels": None, "conversation_id": None,
    "return_prompt_token_ids": False, "routed_dp_rank": None}


def _noop(default: Any) -> dict:
    """The schema of a field accepted only when it asks for nothing."""
    empty = [{"type": "array", "maxItems": 0}, {"type": "object", "maxProperties": 0}] if default is None else []
    return {"anyOf": [{"type": "null"}, *([] if default is None else [{"const": default}]), *empty]}


NATIVE_SAMPLING = _opt({"type": "object", "additionalProperties": False, "properties": {
    **NATIVE_PARAM_SCHEMAS, **{k: _noop(v) for k, v in NATIVE_PARAM_NOOPS.items()}}})


def _one_or_list(schema: dict) -> dict:
    """A field given once for a batch or as a list of one per prompt."""
    return _opt({"anyOf": [schema, {"type": "array", "items": schema}]})


NATIVE_SCHEMAS = {
    "text": {"anyOf": [_TEXT, {"type": "array", "minItems": 1, "items": _TEXT}]},
    "input_ids": {"anyOf": [{**_IDS, "minItems": 1}, {"type": "array", "minItems": 1, "items": {**_IDS, "minItems": 1}}]},
    "sampling_params": {"anyOf": [NATIVE_SAMPLING, {"type": "array", "items": NATIVE_SAMPLING}]},
    "stream": _opt(_BOOL),
    "priority": _opt(_INT),
    "rid": _one_or_list({"type": "string", "minLength": 1}),
    # any string: gateways name one (smg sends "unknown" when the client names none) and, as in
    # SGLang's GenerateReqInput, nothing reads it (native_protocol.parse_native)
    "model": _opt(_STR),
    "return_logprob": _one_or_list(_BOOL),
    "logprob_start_len": _one_or_list({"type": "integer", "minimum": -1}),  # -1: the last prompt token
    "top_logprobs_num": _one_or_list(_TOP_LOGPROBS),
    "return_text_in_logprobs": _opt(_BOOL),
    **{k: _noop(v) for k, v in NATIVE_NOOPS.items()},
}
NATIVE_ONE_OF = [{"required": ["text"]}, {"required": ["input_ids"]}]  # exactly one of them
TOKENIZE_SCHEMAS = {"prompt": _STR, "messages": MESSAGES, "model": _opt(_MODEL), "add_special_tokens": _BOOL}
TOKENIZE_ONE_OF = [{"required": ["prompt"]}, {"required": ["messages"]}]
DETOKENIZE_SCHEMAS = {"tokens": _IDS, "model": _opt(_MODEL)}
ABORT_SCHEMAS = {"rid": _opt(_STR), "abort_all": _opt(_BOOL)}  # SGLang's /abort_request
TEMPLATE_SCHEMAS = {"messages": MESSAGES, "add_generation_prompt": _BOOL, "model": _opt(_MODEL)}

COMMON = set(SAMPLING_SCHEMAS)
CHAT_FIELDS = set(CHAT_SCHEMAS)
COMPLETION_FIELDS = set(COMPLETION_SCHEMAS)
NATIVE_FIELDS = set(NATIVE_SCHEMAS)
CHAT_NO_OPS = set(openai_extras.no_op_schemas("chat"))
COMPLETION_NO_OPS = set(openai_extras.no_op_schemas("completion"))


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
    continuous_usage: bool = False  # usage in every stream chunk (vLLM's continuous_usage_stats)
    extras: openai_extras.Extras = field(default_factory=openai_extras.Extras)  # vLLM's extras


def check_fields(body: dict, allowed: set[str], no_ops: set[str] = frozenset()) -> None:
    """Every key of ``body`` is in ``allowed``; the ``no_ops`` among them ask for nothing."""
    for key in body:
        if key in no_ops or (key in openai_extras.NO_OPS and key not in allowed):
            openai_extras.check_no_op(key, body, key in no_ops)
        elif key not in allowed:
            raise ApiError(400, f"unrecognized request argument: '{key}'", param=key, code="unknown_parameter")


_KINDS = {"boolean": ((bool,), "a boolean"), "integer": ((int,), "an integer"), "number": ((int, float), "a number"),
          "string": ((str,), "a string"), "object": ((dict,), "an object")}


def _typed(body: dict, key: str, table: dict[str, dict]) -> Any:
    """``body[key]`` (None when absent or null) if it has the JSON type ``table`` gives it."""
    value = body.get(key)
    if value is None:
        return None
    schema = table[key]["anyOf"][0] if "anyOf" in table[key] else table[key]
    kinds, what = _KINDS[schema["type"]]
    if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
        raise ApiError(400, f"'{key}' must be {what}", param=key)
    return value


def sampling_from_openai(body: dict, limits: Limits, *, chat: bool) -> ParsedRequest:
    table = CHAT_SCHEMAS if chat else COMPLETION_SCHEMAS
    stream = _typed(body, "stream", table) or False
    opts = _typed(body, "stream_options", table) or {}
    if any(opts.values()) and not stream:  # options at their defaults ask for nothing
        raise ApiError(400, "'stream_options' is only allowed when 'stream' is true", param="stream_options")
    unknown = set(opts) - {"include_usage", "continuous_usage_stats"}
    if unknown:
        raise ApiError(400, f"unrecognized stream option: '{sorted(unknown)[0]}'", param="stream_options")
    continuous = opts.get("continuous_usage_stats")
    include_usage = bool(opts.get("include_usage", bool(continuous)))  # vLLM: implied by continuous usage

    max_tokens = _typed(body, "max_tokens", table)
    if chat:
        mct = _typed(body, "max_completion_tokens", table)
        if mct is not None:
            max_tokens = mct
    if max_tokens is None:  # None: what fits (the engine resolves it)
        max_tokens = limits.default_max_tokens or None
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
        v = _typed(body, key, table)
        if v is not None:
            kw[key] = float(v)
    for key in ("n", "seed"):
        v = _typed(body, key, table)
        if v is not None:
            kw[key] = v
    for key, target in EXTENSIONS.items():
        if body.get(key) is not None:
            kw[target] = body[key]
    if chat:
        lp = _typed(body, "logprobs", table) or False
        top = _typed(body, "top_logprobs", table)
        if top is not None and not lp:
            raise ApiError(400, "'top_logprobs' requires 'logprobs': true", param="top_logprobs")
        kw["logprobs"] = lp
        kw["top_logprobs"] = top or 0
    else:
        lp = _typed(body, "logprobs", table)
        if lp is not None:
            _in_range(body, "logprobs", COMPLETION_SCHEMAS)
            kw["logprobs"] = True
            kw["top_logprobs"] = lp
    kw.update(_constraint(body))
    kw.update(openai_extras.sampling_extras(body))
    ex = openai_extras.read_extras(body, chat=chat)
    if ex.prompt_logprobs is not None and stream:
        raise ApiError(400, "'prompt_logprobs' cannot be streamed", param="prompt_logprobs")
    echo_top = kw.get("top_logprobs", 0) if not chat and body.get("echo") is True and kw.get("logprobs") else None
    if ex.prompt_logprobs is not None or echo_top is not None:
        kw["prompt_logprobs_from"] = 0
        kw["prompt_top_logprobs"] = max(ex.prompt_logprobs or 0, echo_top or 0)
    _typed(body, "user", table)
    model = _typed(body, "model", table)
    priority = _typed(body, "priority", table) or 0
    return ParsedRequest(params=make_params(kw), stream=stream, include_usage=include_usage, model=model,
                         priority=priority, continuous_usage=bool(continuous) and include_usage, extras=ex)


# response_format's fields by its type ("format", the newer structural tag form, is refused
# by the grammar compiler with a message naming it)
_RESPONSE_FORMAT_FIELDS = {"text": {"type"}, "json_object": {"type"}, "json_schema": {"type", "json_schema"},
                           "structural_tag": {"type", "structures", "triggers", "format"}}


def _constraint(body: dict) -> dict[str, Any]:
    """``response_format`` and the native ``regex``/``json_schema``/``ebnf`` fields (at most one)."""
    out: dict[str, Any] = {k: body[k] for k in CONSTRAINTS if body.get(k) is not None}
    vllm = openai_extras.structured_constraint(body)
    if vllm and (out or body.get("response_format", {"type": "text"}) not in (None, {"type": "text"})):
        raise ApiError(400, "give at most one of structured_outputs / guided_*, response_format, regex, json_schema, "
                            "ebnf", param=next(iter(body.keys() & {"structured_outputs", *openai_extras.GUIDED})))
    out.update(vllm)
    rf = body.get("response_format")
    if rf is not None:
        if not isinstance(rf, dict) or rf.get("type") not in _RESPONSE_FORMAT_FIELDS:
            raise ApiError(400, "'response_format.type' must be 'text', 'json_object', 'json_schema' or "
                                "'structural_tag'", param="response_format")
        extra = set(rf) - _RESPONSE_FORMAT_FIELDS[rf["type"]]
        if extra:
            raise ApiError(400, f"unrecognized field 'response_format.{sorted(extra)[0]}' (for type {rf['type']!r})",
                           param="response_format")
        if rf["type"] == "structural_tag":
            out["structural_tag"] = rf
        elif rf["type"] == "json_object":
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


# SamplingParams's (and the engine's) field names -> the OpenAI routes' names for them
API_NAMES = {**{v: k for k, v in EXTENSIONS.items()}, "max_new_tokens": "max_tokens", "input_ids": "prompt",
             "prompt_top_logprobs": "prompt_logprobs"}


def api_param(field_name: str) -> str:
    """The OpenAI routes' name of an engine field (the ``param`` of a 400)."""
    return API_NAMES.get(field_name, field_name)


def make_params(kw: dict[str, Any]) -> SamplingParams:
    """Build ``SamplingParams``; its validation errors become 400s naming the API field."""
    try:
        return SamplingParams(**kw)
    except InvalidRequest as exc:
        param = api_param(exc.field)
        raise ApiError(400, f"'{param}': {exc.message}", param=param) from exc
    except TypeError as exc:  # a wrongly typed value reached the dataclass
        raise ApiError(400, str(exc)) from exc


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
        msg = {"role": "system" if role == "developer" else role, "content": content}
        if m.get("tool_calls") is not None and not isinstance(m["tool_calls"], list):
            raise ApiError(400, f"'messages[{i}].tool_calls' must be a list", param="messages")
        thought = m.get("reasoning_content", m.get("reasoning"))  # SGLang's name / vLLM's
        if thought is not None and (role != "assistant" or not isinstance(thought, str)):
            raise ApiError(400, f"'messages[{i}].reasoning_content' must be a string, on an assistant message",
                           param="messages")
        if thought:  # templates of reasoning models (Qwen3's) render it in tool loops
            msg["reasoning_content"] = thought
        if m.get("tool_calls"):
            if role != "assistant":
                raise ApiError(400, f"'messages[{i}].tool_calls' belongs on assistant messages", param="messages")
            msg["tool_calls"] = tool_calls.history_calls(i, m["tool_calls"])
        for key in ("tool_call_id", "name"):  # a tool result's call and function
            if m.get(key) is not None and not isinstance(m[key], str):
                raise ApiError(400, f"'messages[{i}].{key}' must be a string", param="messages")
            if role == "tool" and m.get(key) is not None:
                msg[key] = m[key]
        out.append(msg)
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


def _in_range(body: dict, key: str, table: dict[str, dict]) -> None:
    """A protocol-only integer field within its table's bounds."""
    schema = table[key]["anyOf"][0] if "anyOf" in table[key] else table[key]
    lo, hi, value = schema["minimum"], schema["maximum"], body[key]
    if not lo <= value <= hi:
        raise ApiError(400, f"'{key}' must be in [{lo}, {hi}], got {value}", param=key)


# ------------------------------------------------------------------------ bodies


async def read_json(request) -> dict:
    """The body of a starlette ``request``, by ``parse_json`` (a prefill/decode role takes
    the bootstrap fields off it: ``bootstrap.take_bootstrap``)."""
    body = parse_json(await request.body())
    take_bootstrap(request, body)
    return body


def parse_json(body: bytes) -> dict:
    """A request body as a JSON object of Unicode strings (400 ``invalid_json`` otherwise)."""
    try:
        data = json.loads(body, parse_float=_number)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the body is not valid JSON: {exc}", code="invalid_json") from exc
    except RecursionError as exc:
        raise ApiError(400, "the body is nested too deeply", code="invalid_json") from exc
    if not isinstance(data, dict):
        raise ApiError(400, "the body must be a JSON object", code="invalid_json")
    _check_strings(data)
    return data


def _number(text: str) -> float | int:
    """A JSON number with a fraction or exponent: an integer when it is whole (``2.0``,
    ``1e3``), as JSON Schema counts it, so integer fields accept it."""
    value = float(text)
    return int(value) if value.is_integer() else value


def _check_strings(value: Any, depth: int = 0) -> None:
    """Refuse strings that are not Unicode text (a lone surrogate, ``"\\ud800"``, is valid
    JSON but cannot be encoded, so the tokenizer would fail on it) and deep nesting."""
    if depth > 64:
        raise ApiError(400, "the body is nested too deeply (more than 64 levels)", code="invalid_json")
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ApiError(400, f"the body holds a string that is not valid Unicode ({exc.reason} at "
                                f"position {exc.start})", code="invalid_json") from None
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_strings(k, depth + 1)
            _check_strings(v, depth + 1)
    elif isinstance(value, list):
        for v in value:
            _check_strings(v, depth + 1)


def check_model(model: str | None, served: str) -> None:
    """A request's ``model`` must be the served one when given (404 otherwise)."""
    if model is not None and model != served:
        raise ApiError(404, f"the model '{model}' does not exist; this server serves '{served}'",
                       param="model", code="model_not_found")


@dataclass
class ChatRequest:
    parsed: ParsedRequest
    messages: list[dict]


def parse_chat(body: dict, limits: Limits, served: str) -> ChatRequest:
    """``/v1/chat/completions``."""
    check_fields(body, CHAT_FIELDS, CHAT_NO_OPS)
    parsed = sampling_from_openai(body, limits, chat=True)
    check_model(parsed.model, served)
    return ChatRequest(parsed, chat_messages(body))


@dataclass
class CompletionRequest:
    parsed: ParsedRequest
    prompts: list[str | list[int]]
    echo: bool


def parse_completion(body: dict, limits: Limits, served: str) -> CompletionRequest:
    """``/v1/completions``."""
    check_fields(body, COMPLETION_FIELDS, COMPLETION_NO_OPS)
    parsed = sampling_from_openai(body, limits, chat=False)
    check_model(parsed.model, served)
    prompts = completion_prompts(body)
    echo = body.get("echo") or False
    if not isinstance(echo, bool):
        raise ApiError(400, "'echo' must be a boolean", param="echo")
    return CompletionRequest(parsed, prompts, echo)


@dataclass
class TokenizeRequest:
    messages: list[dict] | None  # chat messages, or None: ``prompt``
    prompt: str
    add_special_tokens: bool


def parse_tokenize(body: dict, served: str) -> TokenizeRequest:
    """``/v1/tokenize``: a ``prompt`` string or chat ``messages``."""
    check_fields(body, set(TOKENIZE_SCHEMAS))
    check_model(body.get("model"), served)
    if "messages" in body and "prompt" in body:
        raise ApiError(400, "give one of 'prompt' or 'messages', not both", param="prompt")
    if "messages" in body:
        return TokenizeRequest(chat_messages(body), "", True)
    if isinstance(body.get("prompt"), str):
        add = body.get("add_special_tokens", True)
        if not isinstance(add, bool):
            raise ApiError(400, "'add_special_tokens' must be a boolean", param="add_special_tokens")
        return TokenizeRequest(None, body["prompt"], add)
    raise ApiError(400, "give 'prompt' (a string) or 'messages'", param="prompt")


def parse_detokenize(body: dict, served: str, vocab: int) -> list[int]:
    """``/v1/detokenize``: the token ids, each in the vocabulary."""
    check_fields(body, set(DETOKENIZE_SCHEMAS))
    check_model(body.get("model"), served)
    toks = body.get("tokens")
    if not (isinstance(toks, list) and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in toks)):
        raise ApiError(400, f"'tokens' must be a list of token ids in [0, {vocab})", param="tokens")
    return toks


def parse_template(body: dict, served: str) -> tuple[list[dict], bool]:
    """``/apply_chat_template``: (messages, add_generation_prompt)."""
    check_fields(body, set(TEMPLATE_SCHEMAS))
    check_model(body.get("model"), served)
    gen = body.get("add_generation_prompt", True)
    if not isinstance(gen, bool):
        raise ApiError(400, "'add_generation_prompt' must be a boolean", param="add_generation_prompt")
    return chat_messages(body), gen


def parse_abort(body: dict) -> tuple[str | None, bool]:
    """``/abort_request``: (rid, abort_all)."""
    check_fields(body, set(ABORT_SCHEMAS))
    rid, abort_all = _typed(body, "rid", ABORT_SCHEMAS), _typed(body, "abort_all", ABORT_SCHEMAS) or False
    return rid, abort_all
