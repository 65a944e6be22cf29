"""The OpenAI Responses API's request body (``POST /v1/responses``): its field table, and the
body read into a chat completions body.

radixd serves Responses statelessly, as an adapter over the chat pipeline: ``parse_responses``
checks the body against ``RESPONSES_SCHEMAS`` (the table ``/openapi.json`` publishes is the
one ``check`` walks, so the document and the parser cannot disagree), then maps it onto chat:
``instructions`` -> a system message first; ``input`` (a string, or message /
``function_call`` / ``function_call_output`` / ``reasoning`` items) -> messages, with
assistant ``tool_calls``, ``tool`` messages and ``reasoning_content``; the flat function
``tools`` -> chat's nested ones; ``text.format`` -> ``response_format``;
``max_output_tokens`` -> ``max_tokens``; SGLang's extras ``top_k``, ``min_p``, ``repetition_penalty``,
``priority`` as they are. Fields that ask for what a stateless text server
lacks (``store: true``, ``previous_response_id``, hosted tools, reasoning effort) are 400s
naming them; an absent ``store`` means false here (nothing is stored, and the response says
``"store": false``). Errors the chat pipeline raises name the chat field; ``renamed`` gives
them the Responses name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from radixd.core.sampling_params import json_schema
from radixd.server.errors import ApiError
from radixd.server.openai_extras import NoOp, check_no_op, nullable

_STR = {"type": "string"}
_BOOL = {"type": "boolean"}
_NAME = {"type": "string", "minLength": 1}
_STATUS = {"enum": ["in_progress", "completed", "incomplete"]}


def _obj(props: dict[str, dict], required: tuple[str, ...] = ()) -> dict:
    return {"type": "object", "properties": props, "additionalProperties": False,
            **({"required": list(required)} if required else {})}


def _typed(kind: str, props: dict[str, dict], required: tuple[str, ...] = ()) -> dict:
    """An object whose ``type`` is ``kind`` (required)."""
    return _obj({"type": {"const": kind}, **props}, ("type", *required))


_INPUT_TEXT = _typed("input_text", {"text": _STR}, ("text",))
_OUTPUT_TEXT = _typed("output_text", {"text": _STR, "annotations": {"type": "array", "maxItems": 0},
                                      "logprobs": {"type": "array"}}, ("text",))
_REFUSAL = _typed("refusal", {"refusal": _STR}, ("refusal",))
MESSAGE_ITEM = _obj({  # input_text for every role, output_text / refusal for the assistant's
    "type": {"const": "message"}, "role": {"enum": ["user", "system", "developer", "assistant"]},
    "content": {"anyOf": [_STR, {"type": "array", "items": {"anyOf": [_INPUT_TEXT, _OUTPUT_TEXT, _REFUSAL]}}]},
    "id": _STR, "status": _STATUS, "phase": nullable({"enum": ["commentary", "final_answer"]}),
}, ("role", "content"))
FUNCTION_CALL_ITEM = _typed("function_call", {"call_id": _NAME, "name": _NAME, "arguments": _STR, "id": _STR,
                                              "status": _STATUS}, ("call_id", "name", "arguments"))
FUNCTION_OUTPUT_ITEM = _typed("function_call_output", {
    "call_id": _NAME, "output": {"anyOf": [_STR, {"type": "array", "items": _INPUT_TEXT}]},
    "id": nullable(_STR), "status": nullable(_STATUS)}, ("call_id", "output"))
_TEXTS = {"type": "array", "items": _typed("reasoning_text", {"text": _STR}, ("text",))}
REASONING_ITEM = _typed("reasoning", {
    "id": _STR, "summary": {"type": "array", "items": _typed("summary_text", {"text": _STR}, ("text",))},
    "content": _TEXTS, "status": _STATUS,
    "encrypted_content": {"type": "null", "description": "this server neither makes nor reads encrypted reasoning"},
}, ("summary",))
ITEMS = {"message": MESSAGE_ITEM, "function_call": FUNCTION_CALL_ITEM, "function_call_output": FUNCTION_OUTPUT_ITEM,
         "reasoning": REASONING_ITEM}
INPUT = {"anyOf": [_STR, {"type": "array", "minItems": 1, "items": {"anyOf": list(ITEMS.values())}}]}
FUNCTION_TOOL = _typed("function", {"name": _NAME, "description": nullable(_STR),
                                    "parameters": nullable({"type": "object"}), "strict": nullable(_BOOL)}, ("name",))
TOOL_CHOICE = {"anyOf": [{"enum": ["none", "auto", "required"]}, _typed("function", {"name": _NAME}, ("name",))]}
TEXT_FORMAT = {"anyOf": [
    _typed("text", {}), _typed("json_object", {}),
    _typed("json_schema", {"name": _NAME, "schema": {"type": "object"}, "strict": nullable(_BOOL),
                           "description": _STR}, ("name", "schema"))]}
TEXT = _obj({"format": TEXT_FORMAT, "verbosity": nullable({"const": "medium", "description": "the default"})})
_NO_EFFORT = {"type": "null", "description": "this server has no reasoning effort or summary controls"}
REASONING = _obj({"effort": _NO_EFFORT, "summary": _NO_EFFORT, "generate_summary": _NO_EFFORT})
METADATA = {"type": "object", "maxProperties": 16, "propertyNames": {"maxLength": 64},
            "additionalProperties": {"type": "string", "maxLength": 512}}


def _null(value: Any, body: dict) -> bool:
    return False  # (null itself is always accepted)


# Fields accepted only where they ask for nothing; any other value is a 400 naming the field.
RESPONSES_NO_OPS: dict[str, tuple[tuple[str, ...], NoOp]] = {name: (("responses",), op) for name, op in {
    "store": NoOp({"const": False}, lambda v, b: v is False, "accepted `false`, as when absent: this stateless "
                                                              "server stores nothing"),
    "previous_response_id": NoOp({"type": "null"}, _null, "accepted null: this stateless server keeps no "
                                                           "responses; send the whole conversation as `input`"),
    "conversation": NoOp({"type": "null"}, _null, "accepted null: no stored conversations"),
    "background": NoOp({"const": False}, lambda v, b: v is False, "accepted `false`: no background responses"),
    "include": NoOp({"type": "array", "maxItems": 0}, lambda v, b: v == [], "accepted `[]`: nothing extra"),
    "max_tool_calls": NoOp({"type": "null"}, _null, "accepted null: no built-in tools"),
    "prompt": NoOp({"type": "null"}, _null, "accepted null: no stored prompt templates"),
    "prompt_cache_key": NoOp(_STR, lambda v, b: isinstance(v, str), "accepted: prefixes are cached anyway"),
    "prompt_cache_retention": NoOp({"type": "null"}, _null, "accepted null: the cache's own eviction"),
    "truncation": NoOp({"const": "disabled"}, lambda v, b: v == "disabled", "accepted `\"disabled\"`: an input "
                                                                              "too long for the context is a 400"),
    "top_logprobs": NoOp({"const": 0}, lambda v, b: v == 0 and v is not False, "accepted 0: no logprobs"),
    "service_tier": NoOp({"enum": ["auto", "default"]}, lambda v, b: v in ("auto", "default"), "accepted "
                                                                                               "`auto`/`default`"),
    "stream_options": NoOp(_obj({"include_obfuscation": {"const": False}}),
                           lambda v, b: v in ({}, {"include_obfuscation": False}), "accepted `{}` or "
                           "`{\"include_obfuscation\": false}`: events carry no obfuscation padding"),
    "context_management": NoOp({"type": "array", "maxItems": 0}, lambda v, b: v == [], "accepted `[]`"),
}.items()}
RESPONSES_SCHEMAS: dict[str, dict] = {
    "input": INPUT,
    "model": nullable({"type": "string", "x-radixd": "model"}),
    "instructions": nullable(_STR),
    "stream": nullable(_BOOL),
    "temperature": nullable(json_schema("temperature")),
    "top_p": nullable(json_schema("top_p")),
    "max_output_tokens": nullable(json_schema("max_new_tokens")),
    "tools": nullable({"type": "array", "items": FUNCTION_TOOL}),
    "tool_choice": nullable(TOOL_CHOICE),
    "parallel_tool_calls": nullable(_BOOL),
    "text": nullable(TEXT),
    "reasoning": nullable(REASONING),
    "metadata": nullable(METADATA),
    "user": nullable(_STR),
    "safety_identifier": nullable(_STR),
    # SGLang's extras of the Responses body (its gateway, smg, writes them into every request)
    "top_k": nullable(json_schema("top_k")),
    "min_p": nullable(json_schema("min_p")),
    "repetition_penalty": nullable(json_schema("repetition_penalty")),
    "priority": nullable({"type": "integer"}),
    **{k: nullable(op.schema) for k, (_, op) in RESPONSES_NO_OPS.items()},
}
RESPONSES_FIELDS = set(RESPONSES_SCHEMAS)


# ------------------------------------------------------------------------ checking by the table

def check(value: Any, schema: dict, path: str) -> None:
    """``value`` is valid for ``schema`` (the subset of JSON Schema these tables use), else a
    400 naming ``path``. Of an ``anyOf``, the error reported is that of the one branch the
    value's JSON type (and, for objects, its ``type`` field) picks."""
    def fail(message: str):
        why = f" ({schema['description']})" if "description" in schema else ""
        raise ApiError(400, f"'{path}' {message}{why}", param=path.split(".")[0].split("[")[0],
                       code="unsupported_parameter" if schema.get("type") == "null" else None)  # a no-op field

    if "anyOf" in schema:
        branches = _leaves(schema)
        picked = [b for b in branches if _picks(value, b)]
        for b in picked if len(picked) == 1 else branches:
            try:
                return check(value, b, path)
            except ApiError:
                if len(picked) == 1:
                    raise
        kinds = [repr(_type_of(b)) for b in branches if _type_of(b)]
        if isinstance(value, dict) and kinds:
            fail(f"has type {value.get('type')!r}; this server takes {', '.join(kinds)}")
        fail("must be " + " or ".join(dict.fromkeys(_what(b) for b in branches)))
    if "const" in schema and not _same(value, schema["const"]):
        fail(f"must be {schema['const']!r}")
    if "enum" in schema and not any(_same(value, e) for e in schema["enum"]):
        fail(f"must be {_what(schema)}, got {value!r}")
    if "type" in schema and not _is(value, schema["type"]):
        fail(f"must be {_what(schema)}")
    if isinstance(value, str):
        if len(value) < schema.get("minLength", 0):
            fail("must not be empty")
        if len(value) > schema.get("maxLength", len(value)):
            fail(f"may have at most {schema['maxLength']} characters")
    if _is(value, "number"):
        for key, op, ok in (("minimum", ">=", lambda lo: value >= lo), ("exclusiveMinimum", ">", lambda lo: value > lo),
                            ("maximum", "<=", lambda hi: value <= hi)):
            if key in schema and not ok(schema[key]):
                fail(f"must be {op} {schema[key]}, got {value}")
    if isinstance(value, list):
        if len(value) < schema.get("minItems", 0):
            fail("must not be empty")
        if len(value) > schema.get("maxItems", len(value)):
            fail(f"may have at most {schema['maxItems']} items")
        for i, item in enumerate(value):
            if "items" in schema:
                check(item, schema["items"], f"{path}[{i}]")
    if isinstance(value, dict):
        if len(value) > schema.get("maxProperties", len(value)):
            fail(f"may have at most {schema['maxProperties']} keys")
        for key in schema.get("required", []):
            if key not in value:
                fail(f"lacks the required field '{key}'")
        props, more = schema.get("properties", {}), schema.get("additionalProperties", True)
        for key, v in value.items():
            if len(key) > schema.get("propertyNames", {}).get("maxLength", len(key)):
                fail(f"has a key longer than {schema['propertyNames']['maxLength']} characters")
            if key in props:
                check(v, props[key], f"{path}.{key}")
            elif more is False:
                fail(f"has the unrecognized field '{key}'")
            elif isinstance(more, dict):
                check(v, more, f"{path}.{key}")


_JSON_TYPES = {"string": str, "boolean": bool, "object": dict, "array": list, "null": type(None)}


def _is(value: Any, kind: str) -> bool:
    if kind in ("integer", "number"):
        return not isinstance(value, bool) and isinstance(value, int if kind == "integer" else int | float)
    return isinstance(value, _JSON_TYPES[kind])


def _same(value: Any, expected: Any) -> bool:
    return value == expected and (type(value) is type(expected) or _is(value, "number") and _is(expected, "number"))


def _leaves(schema: dict) -> list[dict]:
    return [leaf for b in schema["anyOf"] for leaf in (_leaves(b) if "anyOf" in b else [b])]


def _type_of(schema: dict) -> str | None:
    """The ``type`` field an object schema's instances carry (the discriminator), if it fixes one."""
    return schema.get("properties", {}).get("type", {}).get("const")


def _picks(value: Any, branch: dict) -> bool:
    """``value`` is of the kind ``branch`` describes (its JSON type, an object's ``type``
    field), whatever its details."""
    if "const" in branch or "enum" in branch:
        return any(_same(value, e) for e in branch.get("enum", [branch.get("const")]))
    if not _is(value, branch["type"]):
        return False
    kind = _type_of(branch)
    if kind is None or not isinstance(value, dict):
        return True
    return value.get("type") == kind or ("type" not in value and "type" not in branch.get("required", []))


def _what(schema: dict) -> str:
    if "const" in schema:
        return repr(schema["const"])
    if "enum" in schema:
        return "one of " + ", ".join(repr(e) for e in schema["enum"])
    return {"object": "an object", "array": "a list", "null": "null", "integer": "an integer",
            "string": "a string", "boolean": "a boolean", "number": "a number"}[schema["type"]]


# ------------------------------------------------------------------------ the body as a chat body


@dataclass
class ResponsesRequest:
    chat: dict             # the chat completions body
    echo: dict[str, Any]   # the request's settings, as the Response object repeats them
    stream: bool


def parse_responses(body: dict) -> ResponsesRequest:
    """A ``/v1/responses`` body checked and made into a chat completions body."""
    for key in body:
        if key in RESPONSES_NO_OPS:
            check_no_op(key, body, True, RESPONSES_NO_OPS)
        elif key not in RESPONSES_FIELDS:
            raise ApiError(400, f"unrecognized request argument: '{key}'", param=key, code="unknown_parameter")
    tools = body.get("tools")
    for i, tool in enumerate(tools if isinstance(tools, list) else []):
        if isinstance(tool, dict) and tool.get("type") != "function":
            raise ApiError(400, f"'tools[{i}].type' {tool.get('type')!r} is not supported by this server (function "
                                "tools only)", param="tools", code="unsupported_parameter")
    if body.get("input") is None:
        raise ApiError(400, "'input' is required", param="input")
    for key, value in body.items():
        if value is not None:
            check(value, RESPONSES_SCHEMAS[key], key)

    chat: dict[str, Any] = {"messages": ([{"role": "system", "content": body["instructions"]}]
                                         if body.get("instructions") is not None else []) + messages(body["input"])}
    for key, target in (("model", "model"), ("stream", "stream"), ("temperature", "temperature"), ("top_p", "top_p"),
                        ("max_output_tokens", "max_tokens"), ("user", "user"),
                        ("parallel_tool_calls", "parallel_tool_calls"), ("top_k", "top_k"), ("min_p", "min_p"),
                        ("repetition_penalty", "repetition_penalty"), ("priority", "priority")):
        if body.get(key) is not None:
            chat[target] = body[key]
    tools = body.get("tools") or []
    if "tools" in body:  # [] too: the chat route takes an empty list as no tools
        chat["tools"] = [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters",
                                                                               "strict") if t.get(k) is not None}}
                         for t in tools]
    choice = body.get("tool_choice")
    if choice is not None:  # absent: chat's own default ("auto" with tools, as Responses')
        chat["tool_choice"] = choice if isinstance(choice, str) else {"type": "function",
                                                                      "function": {"name": choice["name"]}}
    fmt = (body.get("text") or {}).get("format") or {"type": "text"}
    if fmt["type"] == "json_object":
        chat["response_format"] = {"type": "json_object"}
    elif fmt["type"] == "json_schema":
        chat["response_format"] = {"type": "json_schema", "json_schema": {k: fmt[k] for k in (
            "name", "schema", "strict", "description") if fmt.get(k) is not None}}
    echo = {
        "instructions": body.get("instructions"), "metadata": body.get("metadata") or {},
        "max_output_tokens": body.get("max_output_tokens"),
        "parallel_tool_calls": body.get("parallel_tool_calls", True) is not False,
        "tool_choice": choice if choice is not None else "auto",
        "tools": [{"type": "function", "name": t["name"], "description": t.get("description"),
                   "parameters": t.get("parameters"), "strict": t.get("strict")} for t in tools],
        "text": {"format": fmt, **({"verbosity": "medium"} if (body.get("text") or {}).get("verbosity") else {})},
        "user": body.get("user"), "safety_identifier": body.get("safety_identifier"),
        "prompt_cache_key": body.get("prompt_cache_key"),
    }
    return ResponsesRequest(chat=chat, echo=echo, stream=bool(body.get("stream")))


def messages(items: str | list[dict]) -> list[dict]:
    """``input`` as chat messages: consecutive ``function_call`` items join the assistant
    message before them (one assistant turn: text, then calls), a ``reasoning`` item's text
    goes on the assistant message it led to as ``reasoning_content``."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict] = []
    reasoning: tuple[int, str] | None = None  # (item index, text) awaiting its assistant message

    def assistant(content: str | None, open_turn: bool) -> dict:
        nonlocal reasoning
        last = out[-1] if out else None
        if open_turn and last is not None and last["role"] == "assistant" and reasoning is None:
            return last
        msg: dict[str, Any] = {"role": "assistant", "content": content}
        if reasoning is not None:
            msg["reasoning_content"] = reasoning[1]
            reasoning = None
        out.append(msg)
        return msg

    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            content = item["content"]
            if isinstance(content, list):
                allowed = {"input_text", "output_text", "refusal"} if item["role"] == "assistant" else {"input_text"}
                for j, part in enumerate(content):
                    if part["type"] not in allowed:
                        raise ApiError(400, f"'input[{i}].content[{j}].type' {part['type']!r} is not allowed in a "
                                            f"{item['role']} message ({', '.join(sorted(allowed))})", param="input")
                content = "".join(p.get("text", p.get("refusal", "")) for p in content)
            if item["role"] == "assistant":
                assistant(content, open_turn=False)
            else:
                if reasoning is not None:
                    break
                out.append({"role": item["role"], "content": content})
        elif kind == "function_call":
            msg = assistant(None, open_turn=True)
            msg.setdefault("tool_calls", []).append({"id": item["call_id"], "type": "function", "function": {
                "name": item["name"], "arguments": item["arguments"]}})
        elif kind == "function_call_output":
            if reasoning is not None:
                break
            output = item["output"]
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": output if isinstance(output, str) else "".join(p["text"] for p in output)})
        else:  # reasoning
            if reasoning is not None:
                break
            texts = item.get("content") or item["summary"]
            reasoning = (i, "".join(t["text"] for t in texts))
    if reasoning is not None:
        raise ApiError(400, f"'input[{reasoning[0]}]' is a reasoning item not followed by the assistant message or "
                            "function call it led to", param="input")
    return out


# ------------------------------------------------------------------------ chat errors, renamed

_RENAMES = [(re.compile(r"^messages\b.*|^prompt$"), "input"), (re.compile(r"^max_tokens$"), "max_output_tokens"),
            (re.compile(r"^(response_format|json_schema)\b.*"), "text.format"),
            (re.compile(r"^tool_choice\.function\."), "tool_choice."),
            (re.compile(r"^(tools\[\d+\])\.function\."), r"\1.")]


def renamed(exc: ApiError) -> ApiError:
    """An error of the chat pipeline with the Responses name of the field it names."""
    if exc.param is None:
        return exc
    param = exc.param
    for pattern, name in _RENAMES:
        param = pattern.sub(name, param)
    message = exc.message.replace("'max_tokens'", "'max_output_tokens'")
    if param.startswith("input") and "messages[" in message:
        message += " (the chat messages made from 'instructions' and 'input')"
    return ApiError(exc.status, message, param=param, code=exc.code)
