"""``/openapi.json``: the OpenAPI 3.1 description of radixd's HTTP API.

Request bodies come from ``protocol``'s field tables (the same tables the parsers take their
allowed fields from); response bodies are described here, next to the status codes each
route may answer. Every error is OpenAI's error JSON.
"""

from __future__ import annotations

import copy
from typing import Any

from radixd import __version__
from radixd.server import protocol, responses_protocol

_NUM = {"type": "number"}
_INT = {"type": "integer"}
_STR = {"type": "string"}
_NULLABLE_STR = {"type": ["string", "null"]}

ERROR = {
    "type": "object", "required": ["error"], "additionalProperties": False,
    "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"], "additionalProperties": False,
        "properties": {"message": _STR, "type": _STR, "param": _NULLABLE_STR, "code": _NULLABLE_STR}}},
}
USAGE = {
    "type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
    "properties": {"prompt_tokens": _INT, "completion_tokens": _INT, "total_tokens": _INT,
                   "prompt_tokens_details": {"type": "object", "properties": {"cached_tokens": _INT}}},
}
_TOP = {"type": "object", "required": ["token", "logprob", "bytes"],
        "properties": {"token": _STR, "logprob": _NUM, "bytes": {"type": "array", "items": _INT}}}
CHAT_LOGPROBS = {"type": ["object", "null"], "properties": {"content": {"type": "array", "items": {
    **_TOP, "properties": {**_TOP["properties"], "top_logprobs": {"type": "array", "items": _TOP}}}}}}
FINISH = {"type": ["string", "null"]}
CHAT_COMPLETION = {
    "type": "object", "required": ["id", "object", "created", "model", "choices", "usage"],
    "properties": {
        "id": _STR, "object": {"const": "chat.completion"}, "created": _INT, "model": _STR,
        "system_fingerprint": _STR, "usage": USAGE,
        "choices": {"type": "array", "items": {
            "type": "object", "required": ["index", "message", "finish_reason"],
            "properties": {"index": _INT, "finish_reason": FINISH, "logprobs": CHAT_LOGPROBS,
                           "message": {"type": "object", "required": ["role", "content"],
                                       "properties": {"role": {"const": "assistant"}, "content": _NULLABLE_STR,
                                                      "reasoning_content": _NULLABLE_STR,
                                                      "reasoning": _NULLABLE_STR}}}}},
    },
}
COMPLETION_LOGPROBS = {"type": ["object", "null"], "properties": {
    "tokens": {"type": "array", "items": _STR}, "token_logprobs": {"type": "array", "items": _NUM},
    "top_logprobs": {"type": "array", "items": {"type": "object", "additionalProperties": _NUM}},
    "text_offset": {"type": "array", "items": _INT}}}
COMPLETION = {
    "type": "object", "required": ["id", "object", "created", "model", "choices", "usage"],
    "properties": {
        "id": _STR, "object": {"const": "text_completion"}, "created": _INT, "model": _STR, "usage": USAGE,
        "choices": {"type": "array", "items": {
            "type": "object", "required": ["index", "text", "finish_reason"],
            "properties": {"index": _INT, "text": _STR, "finish_reason": FINISH, "logprobs": COMPLETION_LOGPROBS}}},
    },
}
EMBEDDINGS = {
    "type": "object", "required": ["object", "data", "model", "usage"],
    "properties": {
        "object": {"const": "list"}, "model": _STR,
        "data": {"type": "array", "items": {
            "type": "object", "required": ["object", "index", "embedding"],
            "properties": {"object": {"const": "embedding"}, "index": _INT,
                           "embedding": {"anyOf": [{"type": "array", "items": _NUM}, _STR]}}}},
        "usage": {"type": "object", "required": ["prompt_tokens", "total_tokens"],
                  "properties": {"prompt_tokens": _INT, "total_tokens": _INT}},
    },
}
# SGLang's logprob entry: [logprob (null for the first prompt token), token id, text or null]
_LP_LIST = {"type": "array", "items": {"type": "array", "minItems": 3, "maxItems": 3}}
# SGLang's finish reason: {"type": "stop", "matched": id or text}, {"type": "length", "length": n}, ...
_NATIVE_FINISH = {"type": ["object", "null"], "required": ["type"],
                  "properties": {"type": {"enum": ["stop", "length", "abort"]},
                                 "matched": {"type": ["integer", "string", "null"]}, "length": _INT,
                                 "message": _STR}}
_NATIVE_ITEM = {
    "type": "object", "required": ["index", "text", "output_ids", "meta_info"],
    "properties": {"index": _INT, "text": _STR, "output_ids": {"type": "array", "items": _INT},
                   "meta_info": {"type": "object", "required": ["id", "finish_reason", "prompt_tokens",
                                                                "completion_tokens", "cached_tokens"],
                                 "properties": {"id": _STR, "finish_reason": _NATIVE_FINISH, "prompt_tokens": _INT,
                                                "completion_tokens": _INT, "cached_tokens": _INT,
                                                "prompt_logprobs": {"type": "array", "items": _NUM},
                                                "e2e_latency": _NUM, "input_token_logprobs": _LP_LIST,
                                                "output_token_logprobs": _LP_LIST,
                                                "input_top_logprobs": {"type": "array", "items": {
                                                    "anyOf": [_LP_LIST, {"type": "null"}]}},
                                                "output_top_logprobs": {"type": "array", "items": _LP_LIST}}}},
}
_NATIVE_ONE = {"anyOf": [_NATIVE_ITEM, {"type": "array", "items": _NATIVE_ITEM}]}
NATIVE = {"anyOf": [_NATIVE_ONE, {"type": "array", "items": _NATIVE_ONE}]}
MODEL = {"type": "object", "required": ["id", "object", "created", "owned_by"],
         "properties": {"id": _STR, "object": {"const": "model"}, "created": _INT, "owned_by": _STR,
                        "max_model_len": _INT}}
MODELS = {"type": "object", "required": ["object", "data"],
          "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": MODEL}}}
HEALTH = {"type": "object", "required": ["status"],
          "properties": {"status": _STR, "reason": _STR, "generate_ms": _NUM}}
TOKENS = {"type": "object", "required": ["tokens", "count", "max_model_len"],
          "properties": {"tokens": {"type": "array", "items": _INT}, "count": _INT, "max_model_len": _INT}}
SERVER_INFO = {"type": "object", "required": ["version", "model", "context_len", "settings", "stats", "draining"],
               "properties": {"version": _STR, "model": _STR, "context_len": _INT, "device": _STR, "dtype": _STR,
                              "settings": {"type": "object"}, "stats": {"type": "object"},
                              "draining": {"type": "boolean"}, "plugins": {"type": "array", "items": _STR}}}
OPENAPI = {"type": "object", "required": ["openapi", "info", "paths"]}
MODEL_INFO = {"type": "object", "required": ["model_path", "tokenizer_path", "is_generation"],
              "properties": {"model_path": _STR, "tokenizer_path": _STR, "is_generation": {"type": "boolean"},
                             "served_model_name": _STR}}
_LOAD = {"type": "object", "required": ["dp_rank", "num_running_reqs", "num_waiting_reqs", "token_usage"],
         "properties": {k: _INT for k in ("dp_rank", "num_running_reqs", "num_waiting_reqs", "num_total_reqs",
                                           "num_used_tokens", "max_total_num_tokens", "max_running_requests")}
         | {k: {"type": "number"} for k in ("token_usage", "gen_throughput", "cache_hit_rate")}}
LOADS = {"type": "object", "required": ["timestamp", "dp_rank_count", "loads"],
         "properties": {"timestamp": _STR, "version": _STR, "dp_rank_count": _INT,
                        "loads": {"type": "array", "items": _LOAD}, "aggregate": {"type": "object"}}}
SGL_SERVER_INFO = {"type": "object", "required": ["model_path", "version", "internal_states", "radixd"],
                   "properties": {"model_path": _STR, "version": _STR, "radixd": SERVER_INFO,
                                  "internal_states": {"type": "array", "items": {"type": "object"}}}}
_OUTPUT_ITEM = {"type": "object", "required": ["type", "id", "status"], "properties": {
    "type": {"enum": ["message", "function_call", "reasoning"]}, "id": _STR,
    "status": {"enum": ["completed", "incomplete"]}, "role": {"const": "assistant"},
    "content": {"type": "array", "items": {"type": "object", "required": ["type", "text"],
                                           "properties": {"type": {"enum": ["output_text", "reasoning_text"]},
                                                          "text": _STR}}},
    "call_id": _STR, "name": _STR, "arguments": _STR, "summary": {"type": "array", "maxItems": 0}}}
RESPONSE = {
    "type": "object", "required": ["id", "object", "created_at", "model", "status", "output", "usage",
                                   "parallel_tool_calls", "tool_choice", "tools"],
    "properties": {
        "id": _STR, "object": {"const": "response"}, "created_at": _INT, "model": _STR,
        "status": {"enum": ["completed", "incomplete", "failed"]}, "output": {"type": "array", "items": _OUTPUT_ITEM},
        "incomplete_details": {"type": ["object", "null"], "properties": {"reason": {"const": "max_output_tokens"}}},
        "error": {"type": ["object", "null"], "properties": {"code": _STR, "message": _STR}},
        "usage": {"type": "object", "required": ["input_tokens", "output_tokens", "total_tokens"], "properties": {
            "input_tokens": _INT, "output_tokens": _INT, "total_tokens": _INT,
            "input_tokens_details": {"type": "object", "properties": {"cached_tokens": _INT}},
            "output_tokens_details": {"type": "object", "properties": {"reasoning_tokens": _INT}}}},
        "parallel_tool_calls": {"type": "boolean"}, "tool_choice": {"type": ["string", "object"]},
        "tools": {"type": "array"}, "store": {"const": False}, "metadata": {"type": "object"},
        "instructions": _NULLABLE_STR, "temperature": _NUM, "top_p": _NUM, "text": {"type": "object"},
    },
}
# one server-sent event: its data is a JSON chunk of the route's stream, or [DONE] last
SSE_EVENT = {"type": "object", "required": ["data"], "properties": {"data": _STR, "event": _STR}}


def _json(schema: dict) -> dict:
    return {"application/json": {"schema": schema}}


def _errors(*codes: int) -> dict:
    what = {400: "Invalid request", 401: "Missing or invalid API key", 404: "Unknown model or route",
            413: "Body too large", 500: "A plugin failed (code plugin_error) or an internal error",
            503: "Queue full, shutting down, or the batching loop stalled"}
    return {str(c): {"description": what[c], "content": _json(ERROR)} for c in codes}


def _body(fields: dict[str, dict], required: list[str] | None = None, one_of: list | None = None) -> dict:
    schema: dict[str, Any] = {"type": "object", "properties": fields, "additionalProperties": False}
    if required:
        schema["required"] = required
    if one_of:
        schema["oneOf"] = one_of
    return {"required": True, "content": _json(schema)}


GENERATION_ERRORS = (400, 401, 404, 413, 500, 503)


def _generation(summary: str, body: dict, result: dict, events: str = "JSON chunks, then data: [DONE]") -> dict:
    return {"post": {
        "summary": summary, "requestBody": body,
        "responses": {"200": {"description": f"The result, or with \"stream\": true server-sent events ({events})",
                              "content": {**_json(result), "text/event-stream": {"schema": SSE_EVENT}}},
                      **_errors(*GENERATION_ERRORS)}}}


class _Copied:
    """``protocol``'s tables, deep-copied (``_fill`` edits the copies)."""

    def __getattr__(self, name: str) -> Any:
        return copy.deepcopy(getattr(protocol, name))


def openapi_document(state) -> dict:
    """The document for one server (its model name and API keys decide two details)."""
    secured = bool(state.api_keys)
    p = _Copied()
    paths: dict[str, dict] = {
        "/v1/chat/completions": _generation("OpenAI chat completions", _body(p.CHAT_SCHEMAS, ["messages"]),
                                            CHAT_COMPLETION),
        "/v1/completions": _generation("OpenAI completions", _body(p.COMPLETION_SCHEMAS, ["prompt"]), COMPLETION),
        "/v1/embeddings": {"post": {"summary": "OpenAI embeddings (an embedding model)",
                                    "requestBody": _body(p.EMBEDDING_SCHEMAS, ["input"]), "responses": {
                                        "200": {"description": "One embedding per input", "content": _json(EMBEDDINGS)},
                                        **_errors(*GENERATION_ERRORS)}}},
        "/v1/responses": _generation("OpenAI Responses API, stateless (no stored responses)",
                                     _body(copy.deepcopy(responses_protocol.RESPONSES_SCHEMAS), ["input"]), RESPONSE,
                                     "event: and data: lines, the Responses event types, numbered"),
        "/generate": _generation("Native generation (text or input_ids; a list is a batch)",
                                 _body(p.NATIVE_SCHEMAS, one_of=p.NATIVE_ONE_OF), NATIVE),
        "/v1/models": {"get": {"summary": "The served model", "responses": {
            "200": {"description": "A list of one model", "content": _json(MODELS)}, **_errors(401)}}},
        "/v1/models/{model}": {"get": {
            "summary": "One model", "parameters": [{"name": "model", "in": "path", "required": True,
                                                    "schema": {"type": "string", "x-radixd": "model"}}],
            "responses": {"200": {"description": "The model", "content": _json(MODEL)}, **_errors(401, 404)}}},
        "/health": {"get": {"summary": "Liveness: the batching loop generates a token in time", "security": [],
                            "responses": {"200": {"description": "Healthy", "content": _json(HEALTH)},
                                          "503": {"description": "Draining, stalled or stopped",
                                                  "content": _json(HEALTH)}}}},
        "/metrics": {"get": {"summary": "Prometheus metrics", "security": [], "responses": {
            "200": {"description": "Text exposition format", "content": {"text/plain": {"schema": _STR}}}}}},
        "/health_generate": {"get": {"summary": "SGLang's name for /health", "security": [],
                                     "responses": {"200": {"description": "Healthy", "content": _json(HEALTH)},
                                                   "503": {"description": "Draining, stalled or stopped",
                                                           "content": _json(HEALTH)}}}},
        "/flush_cache": {method: {"summary": "Empty the radix cache", "responses": {
            "200": {"description": "Flushed", "content": _json({"type": "object", "required": ["flushed"],
                                                                "properties": {"flushed": {"const": True}}})},
            **_errors(400, 401)}} for method in ("get", "post")},
        "/get_model_info": {"get": {"summary": "SGLang's model information", "responses": {
            "200": {"description": "The model", "content": _json(MODEL_INFO)}, **_errors(401)}}},
        "/model_info": {"get": {"summary": "SGLang's model information (its newer name of /get_model_info)",
                                "responses": {"200": {"description": "The model", "content": _json(MODEL_INFO)},
                                              **_errors(401)}}},
        "/v1/loads": {"get": {
            "summary": "SGLang's load report per DP rank (what its gateway's load-aware policies poll)",
            "parameters": [{"name": "include", "in": "query", "required": False,
                            "schema": {"type": "string", "description": "comma-separated sections"}}],
            "responses": {"200": {"description": "Loads", "content": _json(LOADS)}, **_errors(400, 401)}}},
        "/get_server_info": {"get": {"summary": "SGLang's server information (radixd's settings under its names)",
                                     "responses": {"200": {"description": "Server information",
                                                           "content": _json(SGL_SERVER_INFO)}, **_errors(401)}}},
        "/abort_request": {"post": {"summary": "Abort a request by its rid (or all)",
                                    "requestBody": _body(p.ABORT_SCHEMAS), "responses": {
                                        "200": {"description": "Aborted, or no such request running"},
                                        **_errors(400, 401, 413)}}},
        "/server_info": {"get": {"summary": "Version, settings (no keys) and engine statistics", "responses": {
            "200": {"description": "Server information", "content": _json(SERVER_INFO)}, **_errors(401)}}},
        "/dashboard": {"get": {"summary": "The live dashboard page ([server] dashboard = true; a key may come as ?key=)",
                               "responses": {"200": {"description": "The page", "content": {"text/html": {"schema": _STR}}},
                                             **_errors(401, 404)}}},
        "/dashboard/events": {"get": {"summary": "The dashboard's feed: a JSON snapshot of the engine a few times a second",
                                      "responses": {"200": {"description": "data: lines, one JSON snapshot each",
                                                            "content": {"text/event-stream": {"schema": _STR}}},
                                                    **_errors(401, 404)}}},
        "/v1/tokenize": {"post": {"summary": "Tokenize a prompt or chat messages",
                                  "requestBody": _body(p.TOKENIZE_SCHEMAS, one_of=p.TOKENIZE_ONE_OF), "responses": {
                                      "200": {"description": "Token ids", "content": _json(TOKENS)},
                                      **_errors(400, 401, 404, 413)}}},
        "/v1/detokenize": {"post": {"summary": "Token ids to text", "requestBody": _body(p.DETOKENIZE_SCHEMAS, ["tokens"]),
                                    "responses": {"200": {"description": "Text", "content": _json(
                                        {"type": "object", "required": ["prompt"], "properties": {"prompt": _STR}})},
                                        **_errors(400, 401, 404, 413)}}},
        "/apply_chat_template": {"post": {"summary": "Render chat messages with the model's template",
                                          "requestBody": _body(p.TEMPLATE_SCHEMAS, ["messages"]), "responses": {
                                              "200": {"description": "The rendered text", "content": _json(
                                                  {"type": "object", "required": ["text"],
                                                   "properties": {"text": _STR}})},
                                              **_errors(400, 401, 404, 413)}}},
        "/openapi.json": {"get": {"summary": "This document", "security": [], "responses": {
            "200": {"description": "OpenAPI 3.1", "content": _json(OPENAPI)}}}},
    }
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": "radixd", "version": __version__,
                 "description": f"An LLM serving daemon; this server serves the model '{state.model_name}'."},
        "paths": paths,
        "components": {"schemas": {"Error": ERROR}},
    }
    _fill(doc, state)
    if secured:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        doc["security"] = [{"bearer": []}]
    return doc


def _fill(node: Any, state) -> None:
    """Put this server's bounds where the tables say ``x-radixd`` (in place; the tables are
    deep-copied first by ``openapi_document``)."""
    if isinstance(node, list):
        for item in node:
            _fill(item, state)
        return
    if not isinstance(node, dict):
        return
    what = node.pop("x-radixd", None)
    lim = state.settings.limits
    if what == "model":
        node["enum"] = [state.model_name]
    elif what == "token":
        node["maximum"] = state.engine.model_cfg.vocab_size - 1
    elif what == "n":
        node["maximum"] = lim.max_n
    elif what == "top_logprobs":
        node["maximum"] = lim.max_top_logprobs
    elif what == "dimensions":
        node["maximum"] = state.engine.model_cfg.hidden_size
    elif what == "stop":
        node["maxItems"] = lim.max_stop_sequences
    for value in node.values():
        _fill(value, state)
