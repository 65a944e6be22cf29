"""The real daemon (subprocess, loopback, free port) on the default model, driven by the
official ``openai`` client and raw HTTP: routes, SSE framing, usage, and every error status
(after each, the KV pool is back at its idle baseline)."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
from conftest import Daemon, assert_kv_idle

pytestmark = pytest.mark.slow
KEY = "sk-test-0123456789"
MODEL = "SmolLM2-135M-Instruct"

TOML = f"""
[server]
port = 0
max_body_bytes = 65536
[model]
max_context_len = 1024
[memory]
kv_cache_tokens = 8192
[limits]
default_max_tokens = 32
[auth]
api_keys = ["{KEY}", "sk-second-key"]
"""


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = Daemon(tmp_path_factory.mktemp("daemon"), TOML)
    yield d
    assert d.stop() == 0


@pytest.fixture
def client(daemon):
    return openai.OpenAI(base_url=daemon.url + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture
def http(daemon):
    with httpx.Client(base_url=daemon.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as c:
        yield c


def chat_msgs(text="What is the capital of France?"):
    return [{"role": "user", "content": text}]


# ------------------------------------------------------------------------ the openai client


def test_chat(client, http):
    r = client.chat.completions.create(model=MODEL, messages=chat_msgs(), max_tokens=20, temperature=0)
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.prompt_tokens > 10 and 0 < r.usage.completion_tokens <= 20
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    # asked again: the prompt comes from the radix cache
    r2 = client.chat.completions.create(model=MODEL, messages=chat_msgs(), max_tokens=20, temperature=0)
    assert r2.usage.prompt_tokens_details.cached_tokens >= r.usage.prompt_tokens - 1
    assert r2.choices[0].message.content == r.choices[0].message.content
    assert_kv_idle(http)


def test_chat_stream_with_usage(client, http):
    stream = client.chat.completions.create(model=MODEL, messages=chat_msgs(), max_tokens=20, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    text, reasons, usage = "", [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
            assert chunk.choices == []
        for c in chunk.choices:
            text += c.delta.content or ""
            if c.finish_reason:
                reasons.append(c.finish_reason)
    assert "Paris" in text and reasons == ["stop"]
    assert usage is not None and usage.completion_tokens > 0 and usage.prompt_tokens > 10
    assert_kv_idle(http)


def test_chat_n_logprobs_and_seed(client):
    kw = dict(model=MODEL, messages=chat_msgs("Tell me a word."), max_tokens=8, temperature=1.0, seed=7, n=3,
              logprobs=True, top_logprobs=2)
    r = client.chat.completions.create(**kw)
    assert [c.index for c in r.choices] == [0, 1, 2]
    for c in r.choices:
        assert c.logprobs is not None and len(c.logprobs.content) > 0
        for t in c.logprobs.content:
            assert t.logprob <= 0 and len(t.top_logprobs) == 2
            assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob
    again = client.chat.completions.create(**kw)
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]


def test_completions(client, http):
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=5, temperature=0)
    assert r.choices[0].text and r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"
    many = client.completions.create(model=MODEL, prompt=["One, two,", "A, B,"], max_tokens=3, temperature=0,
                                     echo=True)
    assert [c.index for c in many.choices] == [0, 1]
    assert many.choices[0].text.startswith("One, two,") and many.choices[1].text.startswith("A, B,")
    ids = http.post("/v1/tokenize", json={"prompt": "Hello there"}).json()["tokens"]
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=3, temperature=0)
    by_text = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=3, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert_kv_idle(http)


def test_completions_stream(client):
    stream = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0,
                                       stream=True, stream_options={"include_usage": True}, logprobs=1)
    text, usage, reasons = "", None, []
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            text += c.text
            if c.finish_reason:
                reasons.append(c.finish_reason)
    assert len(text) > 0 and reasons == ["length"] and usage.completion_tokens == 12


def test_sse_frames_well_formed(http):
    body = {"model": MODEL, "messages": chat_msgs(), "max_tokens": 10, "temperature": 0, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = [e for e in raw.replace("\r\n", "\n").split("\n\n") if e.strip()]
    datas = []
    for e in events:
        lines = [x for x in e.split("\n") if not x.startswith(":")]  # comments are keep-alives
        assert lines and all(x.startswith("data: ") for x in lines), e
        datas.append("\n".join(x[6:] for x in lines))
    assert datas[-1] == "[DONE]"
    for d in datas[:-1]:
        chunk = json.loads(d)
        assert chunk["object"] == "chat.completion.chunk" and chunk["model"] == MODEL


def test_stream_bytes_are_compact_ascii_json(http):
    """Every event of a stream is ``data: `` + ``json.dumps(chunk, separators=(",", ":"))``
    (ASCII, as before templates rendered the common chunks), whatever the text."""
    bodies = [("/v1/completions", {"model": MODEL, "prompt": "Caf\u00e9 \u4e2d\u6587 \"quoted\"", "max_tokens": 12,
                                   "temperature": 1.0, "seed": 3, "stream": True,
                                   "stream_options": {"include_usage": True}}),
              ("/v1/chat/completions", {"model": MODEL, "messages": chat_msgs("\u00bfQu\u00e9 tal? \U0001F600"),
                                        "max_tokens": 12, "temperature": 1.0, "seed": 3, "stream": True})]
    for path, body in bodies:
        with http.stream("POST", path, json=body) as r:
            raw = r.read()
        assert raw.endswith(b"data: [DONE]\r\n\r\n") and raw.isascii()
        events = raw.split(b"\r\n\r\n")[:-1]
        assert events and all(e.startswith(b"data: ") and b"\r\n" not in e for e in events)
        chunks = [e[6:] for e in events[:-1]]
        for c in chunks:
            assert c == json.dumps(json.loads(c), separators=(",", ":")).encode(), c
        assert len(chunks) >= 12


def test_disconnect_mid_stream_frees_the_kv(daemon, http):
    assert_kv_idle(http)
    before = http.get("/server_info").json()["stats"]["decode_tokens"]
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=daemon.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            got = 0
            for line in r.iter_lines():
                got += line.startswith("data: ")
                if got == 3:
                    break  # leave with the request running
    kv = assert_kv_idle(http)
    assert kv["locked"] == 0
    served = http.get("/server_info").json()["stats"]
    assert served["running"] == 0 and served["waiting"] == 0
    assert served["decode_tokens"] - before < 300  # aborted, not run to its 400 tokens


# ------------------------------------------------------------------------ native and utility routes


def test_native_generate(http):
    r = http.post("/generate", json={"text": "The capital of France is", "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
    assert r.status_code == 200
    out = r.json()
    assert len(out["output_ids"]) == 4 and out["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
    with http.stream("POST", "/generate", json={"input_ids": [1, 2, 3, 4], "stream": True,
                                                "sampling_params": {"max_new_tokens": 3, "temperature": 0}}) as s:
        raw = s.read().decode()
    datas = [line[6:] for line in raw.splitlines() if line.startswith("data: ")]
    assert datas[-1] == "[DONE]" and len(json.loads(datas[-2])["output_ids"]) == 3


def test_models_tokenize_detokenize_info(http):
    models = http.get("/v1/models").json()
    assert models["data"][0]["id"] == MODEL
    assert http.get(f"/v1/models/{MODEL}").status_code == 200
    toks = http.post("/v1/tokenize", json={"prompt": "Hello world"}).json()
    assert toks["count"] == len(toks["tokens"]) > 0
    assert http.post("/v1/detokenize", json={"tokens": toks["tokens"]}).json()["prompt"] == "Hello world"
    chat_toks = http.post("/v1/tokenize", json={"messages": chat_msgs()}).json()
    assert chat_toks["count"] > toks["count"]
    info = http.get("/server_info").json()
    assert info["model"] == MODEL and "auth" not in info["settings"] and KEY not in json.dumps(info)


def test_health_metrics_flush(http, daemon):
    assert http.get("/health").json()["status"] == "ok"
    # /health and /metrics need no key
    assert httpx.get(daemon.url + "/health").status_code == 200
    text = httpx.get(daemon.url + "/metrics").text
    for name in ("radixd_time_to_first_token_seconds_bucket", "radixd_inter_token_latency_seconds_bucket",
                 "radixd_e2e_request_latency_seconds_bucket", "radixd_running_requests", "radixd_queued_requests",
                 "radixd_kv_usage_ratio", "radixd_prompt_tokens_total", "radixd_generation_tokens_total",
                 "radixd_cached_prompt_tokens_total", "radixd_cache_hit_rate"):
        assert name in text, name
    assert http.post("/flush_cache").json() == {"flushed": True}
    kv = http.get("/server_info").json()["stats"]["kv"]
    assert kv["evictable"] == 0 and kv["free"] == kv["total"]


def test_access_log_line(daemon, client):
    client.chat.completions.create(model=MODEL, messages=chat_msgs("Hi"), max_tokens=3, temperature=0,
                                   extra_headers={"x-request-id": "trace-me-42"})
    # the access line is written when the app returns, which can be just after the client has the body
    deadline = time.monotonic() + 10
    while True:
        lines = [x for x in daemon.log_lines() if x.get("event") == "access" and x.get("id") == "trace-me-42"]
        if lines or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert len(lines) == 1
    line = lines[0]
    assert line["status"] == 200 and line["completion_tokens"] == 3 and line["prompt_tokens"] > 0
    assert line["ttft_ms"] > 0 and line["duration_ms"] >= line["ttft_ms"] and "cached_tokens" in line
    assert KEY not in daemon.log_path.read_text()


# ------------------------------------------------------------------------ disconnects


def stats(http: httpx.Client) -> dict:
    return http.get("/server_info").json()["stats"]


def test_disconnect_frees_kv(http):
    before = stats(http)["decode_tokens"]
    body = {"prompt": list(range(500, 560)), "max_tokens": 450, "temperature": 0, "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=body, timeout=60) as r:
        n = 0
        for line in r.iter_lines():
            n += line.startswith("data: ")
            if n >= 5:
                break
        at_disconnect = stats(http)
        assert at_disconnect["kv"]["private"] > 0 and at_disconnect["running"] == 1
    # the client is gone: the request is aborted and its KV returned within a step or so
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and (stats(http)["running"] or stats(http)["kv"]["private"]):
        time.sleep(0.01)
    st = stats(http)
    assert st["running"] == 0 and st["kv"]["private"] == 0 and st["kv"]["locked"] == 0
    assert st["decode_tokens"] - before < 450
    assert st["steps"] - at_disconnect["steps"] <= 3  # noticed and freed within a few steps
    # a non-streaming request whose client times out is aborted too
    with pytest.raises(httpx.ReadTimeout):
        http.post("/v1/completions", json={**body, "stream": False}, timeout=0.5)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and stats(http)["running"]:
        time.sleep(0.01)
    assert stats(http)["decode_tokens"] - before < 2 * 450
    assert_kv_idle(http)


# ------------------------------------------------------------------------ errors


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


@pytest.mark.parametrize("case", ["malformed", "not-object", "bad-temperature", "bad-type", "unknown-field",
                                  "unsupported", "empty-messages", "bad-n", "bad-stop", "top-logprobs-alone"])
def test_400s(http, case):
    base = {"model": MODEL, "messages": chat_msgs(), "max_tokens": 5}
    bodies = {
        "bad-temperature": {**base, "temperature": 5}, "bad-type": {**base, "max_tokens": "many"},
        "unknown-field": {**base, "frobnicate": 1}, "unsupported": {**base, "tools": [{"type": "web_search"}]},
        "empty-messages": {**base, "messages": []}, "bad-n": {**base, "n": 0},
        "bad-stop": {**base, "stop": [1, 2]}, "top-logprobs-alone": {**base, "top_logprobs": 3},
    }
    if case == "malformed":
        r = http.post("/v1/chat/completions", content=b'{"model": ', headers={"content-type": "application/json"})
    elif case == "not-object":
        r = http.post("/v1/chat/completions", json=[1, 2])
    else:
        r = http.post("/v1/chat/completions", json=bodies[case])
    err = error_of(r, 400)
    assert err["type"] == "invalid_request_error"
    expected_param = {"bad-temperature": "temperature", "bad-type": "max_tokens", "unknown-field": "frobnicate",
                      "unsupported": "tools", "empty-messages": "messages", "bad-n": "n", "bad-stop": "stop",
                      "top-logprobs-alone": "top_logprobs"}.get(case)
    assert err["param"] == expected_param
    assert_kv_idle(http)


def test_401(daemon, http):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic " + KEY}):
        r = httpx.post(daemon.url + "/v1/chat/completions", json={"messages": chat_msgs()}, headers=headers)
        err = error_of(r, 401)
        assert err["type"] == "authentication_error" and r.headers["www-authenticate"] == "Bearer"
    ok = httpx.get(daemon.url + "/v1/models", headers={"Authorization": "Bearer sk-second-key"})
    assert ok.status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=daemon.url + "/v1", api_key="nope", max_retries=0).models.list()
    assert_kv_idle(http)


def test_404(http):
    err = error_of(http.post("/v1/chat/completions", json={"model": "gpt-9", "messages": chat_msgs()}), 404)
    assert err["code"] == "model_not_found" and err["param"] == "model"
    error_of(http.get("/v1/nothing-here"), 404)
    error_of(http.get("/v1/models/gpt-9"), 404)
    assert_kv_idle(http)


def test_413(http):
    big = {"model": MODEL, "messages": chat_msgs("x " * 40000)}
    err = error_of(http.post("/v1/chat/completions", json=big), 413)
    assert "65536" in err["message"]
    # and without a content-length (chunked upload)
    payload = json.dumps(big).encode()
    r = http.post("/v1/chat/completions", content=(payload[i:i + 4096] for i in range(0, len(payload), 4096)))
    error_of(r, 413)
    assert_kv_idle(http)


def test_prompt_over_context(http):
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": list(range(100, 1200)), "max_tokens": 5})
    err = error_of(r, 400)
    assert err["code"] == "context_length_exceeded"
    assert "1100" in err["message"] and "1024" in err["message"]
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": list(range(100, 1100)), "max_tokens": 100})
    assert error_of(r, 400)["param"] == "max_tokens"
    assert_kv_idle(http)
