"""``POST /v1/responses``: the Responses body mapped onto chat, chat's outputs mapped onto
Responses objects and events (recorded chat completions and chunks in, checked by the
``openai`` package's own models and stream accumulator), and the official client against a
real daemon on a tiny random model and on the default model."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from conftest import Daemon, assert_kv_idle, make_tiny_checkpoint
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from radixd.server.errors import ApiError
from radixd.server.responses import ResponseBuilder, settings
from radixd.server.responses_protocol import parse_responses, renamed

KEY = "sk-responses"
EVENT = TypeAdapter(ResponseStreamEvent)
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


# ------------------------------------------------------------------------ the body -> chat


def test_string_input_and_settings_become_a_chat_body():
    req = parse_responses({"model": "m", "input": "hi", "instructions": "be brief", "max_output_tokens": 7,
                           "temperature": 0.5, "top_p": 0.9, "user": "u", "stream": True, "store": False,
                           "metadata": {"k": "v"}, "reasoning": {"effort": None}})
    assert req.chat == {"model": "m", "stream": True, "temperature": 0.5, "top_p": 0.9, "max_tokens": 7, "user": "u",
                        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]}
    assert req.stream and req.echo["metadata"] == {"k": "v"} and req.echo["instructions"] == "be brief"
    assert req.echo["tool_choice"] == "auto" and req.echo["text"] == {"format": {"type": "text"}}


def test_items_become_messages_with_tool_calls_tool_results_and_reasoning():
    req = parse_responses({"input": [
        {"role": "developer", "content": "rules"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "weather "},
                                                        {"type": "input_text", "text": "in Paris?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "look up"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
        {"type": "function_call", "call_id": "call_1", "name": "weather", "arguments": '{"city":"Paris"}'},
        {"type": "function_call", "call_id": "call_2", "name": "weather", "arguments": '{"city":"Lyon"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "rain"}]},
    ], "tools": [{"type": "function", "name": "weather", "parameters": WEATHER, "strict": True}],
        "tool_choice": {"type": "function", "name": "weather"}, "parallel_tool_calls": False})
    call = lambda i, city: {"id": f"call_{i}", "type": "function",  # noqa: E731
                            "function": {"name": "weather", "arguments": json.dumps({"city": city}, separators=(",", ":"))}}
    assert req.chat["messages"] == [
        {"role": "developer", "content": "rules"},
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "look up",
         "tool_calls": [call(1, "Paris"), call(2, "Lyon")]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "rain"},
    ]
    assert req.chat["tools"] == [{"type": "function", "function": {"name": "weather", "parameters": WEATHER,
                                                                   "strict": True}}]
    assert req.chat["tool_choice"] == {"type": "function", "function": {"name": "weather"}}
    assert req.chat["parallel_tool_calls"] is False
    assert req.echo["tools"] == [{"type": "function", "name": "weather", "description": None, "parameters": WEATHER,
                                  "strict": True}]


@pytest.mark.parametrize("fmt, want", [
    ({"type": "text"}, None),
    ({"type": "json_object"}, {"type": "json_object"}),
    ({"type": "json_schema", "name": "w", "schema": WEATHER, "strict": True},
     {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER, "strict": True}}),
])
def test_text_format_becomes_response_format(fmt, want):
    req = parse_responses({"input": "x", "text": {"format": fmt}})
    assert req.chat.get("response_format") == want and req.echo["text"] == {"format": fmt}


@pytest.mark.parametrize("body, param, words", [
    ({"store": True}, "store", "stores nothing"),
    ({"previous_response_id": "resp_1"}, "previous_response_id", "keeps no responses"),
    ({"tools": [{"type": "web_search"}]}, "tools", "'web_search' is not supported"),
    ({"tools": [{"type": "file_search", "vector_store_ids": []}]}, "tools", "'file_search' is not supported"),
    ({"frobnicate": 1}, "frobnicate", "unrecognized request argument"),
    ({"reasoning": {"effort": "high"}}, "reasoning", "'reasoning.effort' must be null"),
    ({"background": True}, "background", "not supported"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input",
     "'input[0].content[0]' has type 'input_image'"),
    ({"input": [{"role": "user", "content": [{"type": "output_text", "text": "x"}]}]}, "input",
     "not allowed in a user message"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input", "has type 'item_reference'"),
    ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "gAAA"}]}, "input", "encrypted"),
    ({"input": [{"role": "user", "content": "q"}, {"type": "reasoning", "summary": []}]}, "input",
     "not followed by the assistant message"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input", "lacks the required field 'call_id'"),
    ({"max_output_tokens": -1}, "max_output_tokens", ">= 0"),
    ({"temperature": "hot"}, "temperature", "must be a number"),
    ({"tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}}, "tool_choice", "'allowed_tools'"),
    ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "text", "lacks the required field 'name'"),
    ({"metadata": {"k": 1}}, "metadata", "'metadata.k' must be a string"),
    ({"tools": 5}, "tools", "must be a list or null"),
    ({"input": None}, "input", "'input' is required"),
    ({"stream_options": {"include_obfuscation": 0}}, "stream_options", "must be False"),
])
def test_refused_bodies_name_the_field(body, param, words):
    with pytest.raises(ApiError) as err:
        parse_responses({"input": "x", **body})
    assert err.value.status == 400 and err.value.param == param and words in err.value.message, err.value.message


def test_chat_errors_get_the_responses_names():
    def rename(param, message="m"):
        exc = renamed(ApiError(400, message, param=param, code="c"))
        return exc.param, exc.message
    assert rename("max_tokens", "'max_tokens': must be >= 0") == ("max_output_tokens", "'max_output_tokens': must be >= 0")
    assert rename("messages", "'messages[1].content' has x")[0] == "input"
    assert rename("response_format") == ("text.format", "m")
    assert rename("tools[2].function.parameters")[0] == "tools[2].parameters"
    assert rename("tool_choice.function.name")[0] == "tool_choice.name"
    assert rename("temperature") == ("temperature", "m")


# ------------------------------------------------------------------------ chat outputs -> Responses


class _Params:
    temperature, top_p = 0.7, 1.0


def builder() -> ResponseBuilder:
    echo = parse_responses({"input": "x", "tools": [{"type": "function", "name": "weather", "parameters": WEATHER}]}).echo
    return ResponseBuilder("resp_test", "m", settings(echo, _Params()))


USAGE = {"prompt_tokens": 11, "completion_tokens": 9, "total_tokens": 20, "prompt_tokens_details": {"cached_tokens": 4},
         "completion_tokens_details": {"reasoning_tokens": 3}}
CALLS = [{"id": "call_a", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}},
         {"id": "call_b", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Lyon"}'}}]
# a chat completion of the reasoning and tools slices' shapes, and the same as stream chunks
MESSAGE = {"role": "assistant", "reasoning_content": "Two cities.", "content": "Let me check.", "tool_calls": CALLS}
CHUNKS = [
    {"role": "assistant", "content": ""},
    {"reasoning_content": "Two "}, {"reasoning_content": "cities."},
    {"content": "Let me"}, {"content": " check."},
    {"tool_calls": [{"index": 0, "id": "call_a", "type": "function", "function": {"name": "weather", "arguments": ""}}]},
    {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]},
    {"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]},
    {"tool_calls": [{"index": 1, "id": "call_b", "type": "function", "function": {"name": "weather",
                                                                                  "arguments": '{"city": "Lyon"}'}}]},
    {},
]


def non_streamed(message: dict, finish: str) -> dict:
    b = builder()
    b.feed({**message, "tool_calls": [{**tc, "index": i} for i, tc in enumerate(message.get("tool_calls") or [])]})
    b.finish(finish, USAGE)
    return b.response()


def streamed(deltas: list[dict], finish: str) -> list[dict]:
    b = builder()
    events = b.start()
    for d in deltas:
        events += b.feed(d)
    return events + b.finish(finish, USAGE)


def without_ids(response: dict) -> dict:
    out = json.loads(json.dumps(response))
    out.pop("completed_at")
    for item in out["output"]:
        item.pop("id")
    return out


def test_a_chat_completion_becomes_a_response():
    r = non_streamed(MESSAGE, "tool_calls")
    parsed = Response.model_validate(r)  # openai's own model, validated strictly
    assert parsed.status == "completed" and parsed.incomplete_details is None and parsed.error is None
    assert [i.type for i in parsed.output] == ["reasoning", "message", "function_call", "function_call"]
    assert parsed.output[0].content[0].text == "Two cities." and parsed.output[0].summary == []
    assert parsed.output_text == "Let me check."
    assert [(c.call_id, c.name, json.loads(c.arguments)) for c in parsed.output[2:]] == [
        ("call_a", "weather", {"city": "Paris"}), ("call_b", "weather", {"city": "Lyon"})]
    assert all(i.status == "completed" for i in parsed.output)
    u = parsed.usage
    assert (u.input_tokens, u.output_tokens, u.total_tokens) == (11, 9, 20)
    assert u.input_tokens_details.cached_tokens == 4 and u.output_tokens_details.reasoning_tokens == 3
    assert parsed.tools[0].name == "weather" and parsed.temperature == 0.7 and r["store"] is False
    assert "output_text" not in r  # a property of openai's client, not a field of the API


def test_finish_reasons_give_the_status():
    r = Response.model_validate(non_streamed({"role": "assistant", "content": "cut"}, "length"))
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].status == "incomplete" and r.output_text == "cut"
    r = Response.model_validate(non_streamed({"role": "assistant", "content": ""}, "stop"))
    assert r.status == "completed" and [i.type for i in r.output] == ["message"] and r.output_text == ""
    r = Response.model_validate(non_streamed({"role": "assistant", "content": "x"}, "abort"))
    assert r.status == "failed" and r.error.code == "server_error"


def test_chat_chunks_become_the_stream_events_in_order():
    events = streamed(CHUNKS, "tool_calls")
    for e in events:
        EVENT.validate_python(e)  # every event parses as openai's event union, strictly
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.reasoning_text.delta", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed"]
    added = [e for e in events if e["type"] == "response.output_item.added"]
    assert [e["output_index"] for e in added] == [0, 1, 2, 3]
    assert added[2]["item"]["call_id"] == "call_a" and added[2]["item"]["name"] == "weather"
    assert added[2]["item"]["arguments"] == ""  # the added item is as it was then, not as it ended
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    # the stream ends in the response the same chat output gives unstreamed
    assert without_ids(events[-1]["response"]) == without_ids(non_streamed(MESSAGE, "tool_calls"))


def test_openai_stream_accumulator_assembles_the_stream():
    state = ResponseStreamState(input_tools=[], text_format=openai.omit)
    texts = []
    for e in streamed(CHUNKS, "tool_calls"):
        for out in state.handle_event(EVENT.validate_python(e)):
            if out.type == "response.output_text.delta":
                texts.append(out.snapshot)
    assert texts == ["Let me", "Let me check."]
    final = state._completed_response
    assert final.output_text == "Let me check." and json.loads(final.output[2].arguments) == {"city": "Paris"}


def test_a_cut_stream_ends_incomplete():
    events = streamed([{"content": "a"}, {"content": "b"}], "length")
    assert events[-1]["type"] == "response.incomplete"
    r = Response.model_validate(events[-1]["response"])
    assert r.status == "incomplete" and r.output_text == "ab" and r.output[0].status == "incomplete"
    done = [e for e in events if e["type"] == "response.output_text.done"]
    assert [d["text"] for d in done] == ["ab"]


# ------------------------------------------------------------------------ over HTTP, tiny model


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    from test_tool_calls import TEMPLATE  # the tiny template, plus tools and calls rendered
    from transformers import AutoTokenizer

    path = make_tiny_checkpoint(tmp_path_factory.mktemp("model") / "llama", "llama")
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)
    d = Daemon(tmp_path_factory.mktemp("responses"), f"""
[model]
path = "{path}"
[server]
port = 0
[memory]
kv_cache_tokens = 4096
[limits]
default_max_tokens = 8
[auth]
api_keys = ["{KEY}"]
""")
    yield d
    assert d.stop() == 0


@pytest.fixture
def client(daemon):
    return openai.OpenAI(base_url=daemon.url + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture
def http(daemon):
    with httpx.Client(base_url=daemon.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as c:
        yield c


def chat_text(client, messages, n):
    r = client.chat.completions.create(model="llama", messages=messages, max_tokens=n, temperature=0)
    return r.choices[0].message.content, r.usage.prompt_tokens


def test_create_is_the_chat_pipeline(client, http):
    r = client.responses.create(model="llama", input="hello world", instructions="be brief", max_output_tokens=6,
                                temperature=0, metadata={"run": "1"})
    want, prompt_tokens = chat_text(client, [{"role": "system", "content": "be brief"},
                                             {"role": "user", "content": "hello world"}], 6)
    assert r.id.startswith("resp_") and r.object == "response" and r.model == "llama"
    assert r.output_text == want and r.usage.input_tokens == prompt_tokens
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"  # random weights: no EOS
    assert r.usage.output_tokens == 6 and r.usage.total_tokens == prompt_tokens + 6
    assert r.instructions == "be brief" and r.metadata == {"run": "1"} and r.temperature == 0 and r.store is False
    assert r.max_output_tokens == 6 and r.tool_choice == "auto" and r.tools == [] and r.text.format.type == "text"
    assert_kv_idle(http)


def test_message_list_input(client):
    items = [{"role": "system", "content": "sys"},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hello"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "hi there"}]},
             {"role": "user", "content": "again"}]
    r = client.responses.create(model="llama", input=items, max_output_tokens=4, temperature=0)
    want, prompt_tokens = chat_text(client, [{"role": "system", "content": "sys"}, {"role": "user", "content": "hello"},
                                             {"role": "assistant", "content": "hi there"},
                                             {"role": "user", "content": "again"}], 4)
    assert r.output_text == want and r.usage.input_tokens == prompt_tokens


def test_output_items_sent_back_as_input(client):
    first = client.responses.create(model="llama", input="hello", max_output_tokens=3, temperature=0)
    r = client.responses.create(model="llama", input=[{"role": "user", "content": "hello"}, *first.output,
                                                      {"role": "user", "content": "more"}],
                                max_output_tokens=3, temperature=0)
    want, prompt_tokens = chat_text(client, [{"role": "user", "content": "hello"},
                                             {"role": "assistant", "content": first.output_text},
                                             {"role": "user", "content": "more"}], 3)
    assert r.output_text == want and r.usage.input_tokens == prompt_tokens


def test_stream_events(client, http):
    want = client.responses.create(model="llama", input="hello world", max_output_tokens=5, temperature=0)
    with client.responses.create(model="llama", input="hello world", max_output_tokens=5, temperature=0,
                                 stream=True) as stream:
        events = list(stream)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == want.output_text
    final = events[-1].response
    assert final.output_text == want.output_text and final.usage.output_tokens == 5 and final.id == events[0].response.id
    raw = http.post("/v1/responses", json={"input": "hi", "stream": True, "max_output_tokens": 2}).text
    assert raw.startswith("event: response.created") and "[DONE]" not in raw  # OpenAI's framing: no [DONE]
    assert_kv_idle(http)


def test_json_schema_format_gives_valid_json(client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"}},
              "required": ["ok", "n"], "additionalProperties": False}
    r = client.responses.create(model="llama", input="answer", max_output_tokens=40, temperature=0,
                                text={"format": {"type": "json_schema", "name": "answer", "schema": schema,
                                                 "strict": True}})
    assert r.status == "completed", r.output_text  # the grammar closes the document, then only EOS
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema" and r.text.format.name == "answer"


def test_stream_helper_with_text_format(client):
    from pydantic import BaseModel

    class Answer(BaseModel):
        ok: bool

    with client.responses.stream(model="llama", input="answer", max_output_tokens=30, temperature=0,
                                 text_format=Answer) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.status == "completed" and "".join(deltas) == final.output_text
    assert isinstance(final.output_parsed, Answer)
    parsed = client.responses.parse(model="llama", input="answer", max_output_tokens=30, temperature=0,
                                    text_format=Answer)
    assert parsed.output_parsed == final.output_parsed


@pytest.mark.parametrize("kw, param", [
    (dict(store=True), "store"),
    (dict(previous_response_id="resp_abc"), "previous_response_id"),
    (dict(tools=[{"type": "web_search"}]), "tools"),
    (dict(reasoning={"effort": "high"}), "reasoning"),
    (dict(extra_body={"n": 2}), "n"),
    (dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]), "input"),
    (dict(max_output_tokens=100000), "max_output_tokens"),  # past the context: chat's error, renamed
])
def test_refused_over_http(client, http, kw, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(**{"model": "llama", "input": "hi", **kw})
    assert err.value.body["param"] == param and err.value.body["type"] == "invalid_request_error", err.value.body
    assert_kv_idle(http)


def test_absent_store_and_null_no_ops_are_accepted(client):
    r = client.responses.create(model="llama", input="hi", max_output_tokens=1, store=False, previous_response_id=None,
                                reasoning={"effort": None}, truncation="disabled", include=[], service_tier="auto")
    assert r.store is False and r.usage.output_tokens == 1


def test_tool_loop_end_to_end(client, http):
    """Function tools through the chat route's tool calling: a required call whose arguments
    validate, streamed and not, then its output sent back. (Runs once the chat route takes
    ``tools``; before that the chat route's refusal is the answer, checked above.)"""
    tools = [{"type": "function", "name": "weather", "description": "the weather in a city", "parameters": WEATHER,
              "strict": True}]
    probe = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 1,
                                                    "tools": [{"type": "function", "function": {"name": "f"}}]})
    if probe.status_code == 400 and probe.json()["error"]["param"] == "tools":
        pytest.skip("the chat route does not take tools yet")
    one = {"tool_choice": "required", "parallel_tool_calls": False}  # one call, then the grammar ends
    r = client.responses.create(model="llama", input="weather in Paris?", tools=tools, **one,
                                max_output_tokens=120, temperature=0)
    calls = [i for i in r.output if i.type == "function_call"]
    assert calls and r.status == "completed", r.output
    for c in calls:
        assert c.name == "weather" and c.call_id
        jsonschema.validate(json.loads(c.arguments), WEATHER)
    with client.responses.create(model="llama", input="weather in Paris?", tools=tools, **one,
                                 max_output_tokens=120, temperature=0, stream=True) as stream:
        events = list(stream)
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert args == "".join(c.arguments for c in calls) and events[-1].type == "response.completed"
    follow = client.responses.create(model="llama", tools=tools, max_output_tokens=4, temperature=0, input=[
        {"role": "user", "content": "weather in Paris?"}, *calls,
        *[{"type": "function_call_output", "call_id": c.call_id, "output": "sunny"} for c in calls]])
    assert follow.output and follow.usage.input_tokens > r.usage.input_tokens
    assert_kv_idle(http)


# ------------------------------------------------------------------------ the default model


@pytest.mark.slow
def test_default_model_answers(tmp_path):
    d = Daemon(tmp_path, "[server]\nport = 0\n[memory]\nkv_cache_tokens = 4096\n")
    try:
        client = openai.OpenAI(base_url=d.url + "/v1", api_key="none", max_retries=0)
        r = client.responses.create(model="SmolLM2-135M-Instruct", instructions="Answer in one short sentence.",
                                    input="What is the capital of France?", max_output_tokens=32, temperature=0)
        assert "Paris" in r.output_text and r.status == "completed", r.output_text
        with client.responses.stream(model="SmolLM2-135M-Instruct", input="What is the capital of France?",
                                     instructions="Answer in one short sentence.", max_output_tokens=32,
                                     temperature=0) as stream:
            final = stream.get_final_response()
        assert final.output_text == r.output_text
    finally:
        assert d.stop() == 0
