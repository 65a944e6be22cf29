"""Structured generation over HTTP (the real daemon, default model): response_format on both
OpenAI routes, the native regex / json_schema / ebnf parameters, streaming and not, n > 1,
and 400s for constraints that cannot be compiled, after which the daemon keeps serving."""

from __future__ import annotations

import concurrent.futures
import json
import re

import httpx
import jsonschema
import pytest
from conftest import Daemon, grammar_suite

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
TOML = """
[server]
port = 0
[memory]
kv_cache_tokens = 16384
[limits]
default_max_tokens = 96
[grammar]
compile_timeout = 20.0
"""
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "city": {"enum": ["Paris", "Rome", "Oslo"]}},
          "required": ["name", "age", "city"]}


@pytest.fixture(scope="module")
def http(tmp_path_factory):
    d = Daemon(tmp_path_factory.mktemp("daemon"), TOML)
    with httpx.Client(base_url=d.url, timeout=120) as c:
        yield c
    assert d.stop() == 0


def _msgs(text="Describe a person as JSON."):
    return [{"role": "user", "content": text}]


def _sse(r: httpx.Response) -> list[dict]:
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]


def _chat_choices(r: httpx.Response, stream: bool) -> tuple[dict[int, str], dict[int, str]]:
    """A chat completion's texts and finish reasons by choice index, streamed or not."""
    if not stream:
        choices = r.json()["choices"]
        return ({ch["index"]: ch["message"]["content"] for ch in choices},
                {ch["index"]: ch["finish_reason"] for ch in choices})
    texts, reasons = {}, {}
    for c in _sse(r):
        for ch in c["choices"]:
            texts[ch["index"]] = texts.get(ch["index"], "") + (ch["delta"].get("content") or "")
            if ch.get("finish_reason"):
                reasons[ch["index"]] = ch["finish_reason"]
    return texts, reasons


def test_chat_response_format_json_schema(http):
    body = {"model": MODEL, "messages": _msgs(), "temperature": 0, "max_tokens": 80,
            "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    jsonschema.validate(json.loads(choice["message"]["content"]), PERSON)
    # streaming: the deltas add up to a valid document too
    r = http.post("/v1/chat/completions", json={**body, "stream": True, "temperature": 0.8, "seed": 3})
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in _sse(r) if c["choices"])
    jsonschema.validate(json.loads(text), PERSON)


def test_chat_json_object_n2(http):
    body = {"model": MODEL, "messages": _msgs("Give me a JSON object about a cat."), "n": 2, "temperature": 0.9,
            "seed": 1, "max_tokens": 96, "response_format": {"type": "json_object"}}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:  # closed within max_tokens
        assert choice["finish_reason"] == "stop"
        assert isinstance(json.loads(choice["message"]["content"]), dict)


@pytest.mark.parametrize("stream", [False, True])
def test_a_tight_max_tokens_still_closes_the_document(http, stream):
    """max_tokens just above PERSON's shortest document (33 bytes): sampled outputs, streamed
    or not, n = 2, are complete and valid."""
    body = {"model": MODEL, "messages": _msgs("Describe a person with a long biography."), "n": 2,
            "temperature": 1.0, "seed": 5, "max_tokens": 34, "stream": stream,
            "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    texts, reasons = _chat_choices(r, stream)
    assert sorted(texts) == [0, 1]
    for i, text in texts.items():
        assert reasons[i] == "stop", text
        jsonschema.validate(json.loads(text), PERSON)


def test_every_suite_schema_validates_over_http(http):
    """Every schema of benchmarks/grammar_suite.py through response_format on the default
    model, greedy, every other one streamed: each output finishes and validates."""
    suite = grammar_suite().SCHEMAS

    def one(numbered):
        i, (name, schema) = numbered
        stream = i % 2 == 1
        body = {"model": MODEL, "messages": _msgs(f"Reply with one JSON document for: {json.dumps(schema)}"),
                "temperature": 0, "max_tokens": 200, "stream": stream,
                "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, (name, r.text)
        return name, *_chat_choices(r, stream)

    with concurrent.futures.ThreadPoolExecutor(len(suite)) as pool:  # all at once: one batch
        results = list(pool.map(one, enumerate(suite.items())))
    for name, texts, reasons in results:
        assert reasons[0] == "stop", (name, texts[0])
        jsonschema.validate(json.loads(texts[0]), suite[name])


def test_completions_regex_and_stop(http):
    body = {"model": MODEL, "prompt": "My phone number is", "max_tokens": 30, "temperature": 0.7, "seed": 2,
            "regex": r" \(\d{3}\) \d{3}-\d{4}", "n": 2}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        assert re.fullmatch(r" \(\d{3}\) \d{3}-\d{4}", choice["text"]), choice
        assert choice["finish_reason"] == "stop"


def test_generate_native_ebnf_and_schema_stream(http):
    arith = 'start: expr\n?expr: term (("+" | "-") term)*\n?term: NUMBER | "(" expr ")"\nNUMBER: /[0-9]+/\n'
    r = http.post("/generate", json={"text": "2+2*(3-1)=", "sampling_params": {
        "ebnf": arith, "max_new_tokens": 20, "temperature": 0}})
    assert r.status_code == 200, r.text
    assert re.fullmatch(r"[0-9+\-()]+", r.json()["text"]), r.json()
    r = http.post("/generate", json={"text": "A person in JSON: ", "stream": True, "sampling_params": {
        "json_schema": json.dumps(PERSON), "max_new_tokens": 80, "temperature": 0}})
    events = _sse(r)
    assert events and events[-1]["meta_info"]["finish_reason"] == {"type": "stop", "matched": events[-1]["output_ids"][-1]}, events[-1:]
    jsonschema.validate(json.loads(events[-1]["text"]), PERSON)


@pytest.mark.parametrize("route,body,needle", [
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "array", "uniqueItems": True}}}}, "uniqueItems"),
    ("/v1/chat/completions", {"regex": "(unclosed"}, "regex"),
    ("/v1/completions", {"ebnf": "start: ("}, "grammar"),
    ("/v1/completions", {"regex": "a", "json_schema": {"type": "string"}}, "at most one"),
    ("/generate", {"sampling_params": {"json_schema": {"type": "string", "format": "hostname"}}}, "format"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"oneOf": [{"type": "number"}, {"type": "integer"}]}}}}, "'oneOf'"),
    ("/v1/completions", {"json_schema": {"allOf": [{"type": "string", "pattern": "^a"}, {"pattern": "b$"}]}}, "'allOf'"),
    ("/generate", {"sampling_params": {"json_schema": {"type": "number", "minimum": 1e300}}}, "'minimum'"),
])
def test_bad_constraints_are_400_and_the_daemon_keeps_serving(http, route, body, needle):
    if route == "/generate":
        payload = {"text": "hi", **body}
    elif route == "/v1/completions":
        payload = {"model": MODEL, "prompt": "hi", **body}
    else:
        payload = {"model": MODEL, "messages": _msgs(), **body}
    r = http.post(route, json=payload)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"], r.json()
    ok = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 2})
    assert ok.status_code == 200
