"""``/openapi.json`` against a real daemon on a tiny model: the document is valid OpenAPI 3.1,
its request schemas are the parsers' field tables, and schemathesis, fed by it, finds no 5xx
and no response that breaks the described schemas, status codes or content types. The run is
deterministic (hypothesis ``derandomize``) and bounded (examples per operation and mode)."""

from __future__ import annotations

import time

import httpx
import pytest
from conftest import Daemon, assert_kv_idle

from radixd.server import protocol, responses_protocol

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import (  # noqa: E402
    content_type_conformance,
    negative_data_rejection,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

KEY = "sk-openapi-test"
TOML = """
[model]
path = "{model}"
[server]
port = 0
[memory]
kv_cache_tokens = 4096
[scheduler]
max_running_requests = 16
[limits]
default_max_tokens = 8
max_n = 4
[auth]
api_keys = ["{key}"]
"""
EXAMPLES = {GenerationMode.POSITIVE: 30, GenerationMode.NEGATIVE: 15}
CHECKS = [not_a_server_error, response_schema_conformance, status_code_conformance, content_type_conformance]


@pytest.fixture(scope="module")
def daemon(tiny_models, tmp_path_factory):
    d = Daemon(tmp_path_factory.mktemp("openapi"), TOML.format(model=tiny_models["llama"], key=KEY))
    yield d
    assert d.stop() == 0


@pytest.fixture(scope="module")
def document(daemon) -> dict:
    r = httpx.get(daemon.url + "/openapi.json")  # open: no key needed
    assert r.status_code == 200
    return r.json()


def test_document_is_valid_openapi(document):
    from openapi_spec_validator import validate

    validate(document)
    assert document["openapi"].startswith("3.1")
    assert document["security"] == [{"bearer": []}]


def test_request_schemas_are_the_parsers_tables(document, daemon):
    def fields(path: str) -> set[str]:
        schema = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert schema["additionalProperties"] is False
        return set(schema["properties"])

    assert fields("/v1/chat/completions") == protocol.CHAT_FIELDS
    assert fields("/v1/completions") == protocol.COMPLETION_FIELDS
    assert fields("/generate") == protocol.NATIVE_FIELDS
    assert fields("/v1/responses") == responses_protocol.RESPONSES_FIELDS
    # every documented route exists on the server and every route is documented
    from unittest.mock import MagicMock

    from radixd.server.app import build_app

    state = MagicMock()  # build_app only asks the plugins for extra routes
    state.plugins.hook.radixd_routes.return_value = []
    served = {r.path.replace("{model:path}", "{model}") for r in build_app(state).routes}
    assert set(document["paths"]) == served


@pytest.mark.parametrize("mode", list(EXAMPLES), ids=lambda m: m.value)
def test_schemathesis(daemon, document, mode):
    schema = schemathesis.openapi.from_dict(document)
    checks = CHECKS + ([negative_data_rejection] if mode is GenerationMode.NEGATIVE else [])
    headers = {"Authorization": f"Bearer {KEY}"}
    seen: dict[str, int] = {}
    t0 = time.monotonic()
    for result in schema.get_all_operations():
        op = result.ok()
        if op.path == "/flush_cache":
            continue  # it empties the cache under the other calls; its own test is in test_server
        if mode is GenerationMode.NEGATIVE and op.method == "get" and "{" not in op.path:
            continue  # nothing to make invalid

        @given(case=op.as_strategy(generation_mode=mode))
        @settings(max_examples=EXAMPLES[mode], derandomize=True, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        def run(case):
            response = case.call_and_validate(base_url=daemon.url, headers=headers, checks=checks, timeout=60)
            key = f"{case.operation.method.upper()} {case.operation.path} {response.status_code}"
            seen[key] = seen.get(key, 0) + 1

        run()
    print(f"schemathesis {mode.value}: {time.monotonic() - t0:.1f} s", dict(sorted(seen.items())))
    assert any(k.startswith("POST /v1/chat/completions 200") for k in seen) or mode is GenerationMode.NEGATIVE
    assert not any(k.endswith(("500", "502", "503", "504")) for k in seen)
    # the daemon is still healthy and idle afterwards
    assert httpx.get(daemon.url + "/health", timeout=30).status_code == 200
    with httpx.Client(base_url=daemon.url, headers=headers) as http:
        assert_kv_idle(http)


def test_tokenize_takes_one_of_prompt_or_messages():
    from radixd.server.errors import ApiError
    from radixd.server.protocol import parse_tokenize

    with pytest.raises(ApiError, match="one of 'prompt' or 'messages', not both"):
        parse_tokenize({"prompt": {"x": 1}, "messages": [{"role": "user", "content": "hi"}]}, "m")
    assert parse_tokenize({"prompt": "hi"}, "m").prompt == "hi"
