"""Tool calling over HTTP with the official ``openai`` client, against real daemons: a tiny
random-weight model (whose template renders tools itself) and the default model (whose
template has no tools support: radixd writes them into the system message). Under
``tool_choice`` ``required`` / a named function every call's arguments parse and validate
against the function's schema; under ``auto`` calls are generated under the grammar once
opened; streamed and non-streamed answers agree; a history's calls and tool results reach
the model; a two-step loop (call -> tool result -> answer) works; the 32-function suite is
100% valid in required mode, greedy and sampled."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest
from conftest import Daemon, make_tiny_checkpoint

from benchmarks import tool_suite

pytestmark = pytest.mark.slow
KEY = "sk-tools"
# a template that renders tools, a history's calls (arguments as objects) and tool results
TEMPLATE = ("{% if tools %}<tools>{% for t in tools %}{{ t.function.name }} {% endfor %}</tools>\n{% endif %}"
            "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% for c in m.tool_calls or [] %}<tool_call>"
            "{{ c.function | tojson }}</tool_call>{% endfor %}\n{% endfor %}{% if add_generation_prompt %}<assistant>"
            "{% endif %}")
TINY_TOOLS = [tool_suite.tool("order_pizza"), tool_suite.tool("set_alarm")]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TINY_TOOLS}


def start(tmp, path, **sections) -> Daemon:
    tables = {"model": {"path": str(path), "served_name": "m"}, "server": {"port": 0}, "memory": {"kv_cache_tokens": 8192},
              "auth": {"api_keys": [KEY]}}
    for name, table in sections.items():
        tables.setdefault(name, {}).update(table)
    return Daemon(tmp, "".join(f"[{name}]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in t.items())
                               for name, t in tables.items()))


@pytest.fixture(scope="module")
def tiny_tok(tmp_path_factory):
    from transformers import AutoTokenizer

    path = make_tiny_checkpoint(tmp_path_factory.mktemp("model") / "llama", "llama")
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)
    tok.path = path
    return tok


@pytest.fixture(scope="module")
def tiny_daemon(tiny_tok, tmp_path_factory):
    d = start(tmp_path_factory.mktemp("tiny"), tiny_tok.path)
    yield d
    assert d.stop() == 0


@pytest.fixture(scope="module")
def smol_daemon(tmp_path_factory):
    d = start(tmp_path_factory.mktemp("smol"), "default", scheduler={"max_running_requests": 64})
    yield d
    assert d.stop() == 0


def client_of(d: Daemon) -> openai.OpenAI:
    return openai.OpenAI(base_url=d.url + "/v1", api_key=KEY, max_retries=0, timeout=300)


@pytest.fixture
def tiny(tiny_daemon):
    return client_of(tiny_daemon)


@pytest.fixture
def smol(smol_daemon):
    return client_of(smol_daemon)


def ask(client, messages, **kw) -> tuple[str | None, list[dict], str]:
    """(content, calls as dicts, finish_reason) of one choice, streamed or not; a stream is
    checked to open each call with its id, type and name before its argument fragments."""
    kw = {"temperature": 0, "max_tokens": 64, **kw}
    if not kw.get("stream"):
        choice = client.chat.completions.create(model="m", messages=messages, **kw).choices[0]
        calls = [{"id": c.id, "type": c.type, "name": c.function.name, "arguments": c.function.arguments}
                 for c in choice.message.tool_calls or []]
        return choice.message.content, calls, choice.finish_reason
    content, calls, finish = None, [], None
    for chunk in client.chat.completions.create(model="m", messages=messages, **kw):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        if delta.content:
            content = (content or "") + delta.content
        for c in delta.tool_calls or []:
            if c.index == len(calls):
                assert c.id and c.type == "function" and c.function.name and not c.function.arguments
                calls.append({"id": c.id, "type": c.type, "name": c.function.name, "arguments": ""})
            else:
                assert c.index == len(calls) - 1 and c.id is None and c.function.name is None
                calls[c.index]["arguments"] += c.function.arguments
        finish = chunk.choices[0].finish_reason or finish
    return content, calls, finish


def valid(calls: list[dict], schemas: dict[str, dict]) -> None:
    for c in calls:
        assert c["id"].startswith("call_") and c["type"] == "function"
        jsonschema.validate(json.loads(c["arguments"]), schemas[c["name"]])


USER = [{"role": "user", "content": "hello world"}]
TINY = 160  # tokens: a call's markup alone is some 60 of this tokenizer's (single-byte) tokens
NAMED = {"type": "function", "function": {"name": "set_alarm"}}


@pytest.mark.parametrize("choice", ["required", "named", "auto"])
def test_tool_calls_on_a_tiny_model(tiny, choice):
    tool_choice = NAMED if choice == "named" else choice
    got = [ask(tiny, USER, tools=TINY_TOOLS, tool_choice=tool_choice, stream=s, max_tokens=TINY) for s in (False, True)]
    seen = [(content or None, [(c["name"], c["arguments"]) for c in calls], finish) for content, calls, finish in got]
    assert seen[0] == seen[1]  # streamed as not
    content, calls, finish = got[0]
    valid(calls, SCHEMAS)
    if choice != "auto":
        assert calls and content is None and finish == "tool_calls"
    if choice == "named":
        assert [c["name"] for c in calls] == ["set_alarm"]


def test_parallel_tool_calls_false_gives_one_call(tiny):
    for seed in range(3):
        _, calls, finish = ask(tiny, USER, tools=TINY_TOOLS, tool_choice="required", parallel_tool_calls=False,
                               temperature=1.0, seed=seed, max_tokens=TINY)
        assert len(calls) == 1 and finish == "tool_calls"
        valid(calls, SCHEMAS)


def test_history_calls_and_tool_results_reach_the_template(tiny, tiny_tok):
    call = {"id": "call_abc", "type": "function", "function": {"name": "set_alarm", "arguments": '{"hour": 6}'}}
    history = USER + [{"role": "assistant", "content": None, "tool_calls": [call]},
                      {"role": "tool", "content": "alarm set", "tool_call_id": "call_abc"}]
    r = tiny.chat.completions.create(model="m", messages=history, max_tokens=1, tools=TINY_TOOLS)
    # rendered by the template, the call's arguments as an object (as templates index them)
    shown = USER + [{"role": "assistant", "content": "", "tool_calls": [
        {**call, "function": {"name": "set_alarm", "arguments": {"hour": 6}}}]},
        {"role": "tool", "content": "alarm set", "tool_call_id": "call_abc"}]
    text = tiny_tok.apply_chat_template(shown, tools=TINY_TOOLS, tokenize=False, add_generation_prompt=True)
    assert '<tool_call>{"name": "set_alarm", "arguments": {"hour": 6}}</tool_call>' in text and "alarm set" in text
    assert r.usage.prompt_tokens == len(tiny_tok(text, add_special_tokens=False).input_ids)


def test_refusals_name_the_field(tiny_daemon):
    with httpx.Client(base_url=tiny_daemon.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as http:
        def refused(body: dict, param: str, *words: str) -> None:
            r = http.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 4, **body})
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == param and all(w in err["message"] for w in words), err

        refused({"tools": [{"type": "code_interpreter"}]}, "tools", "code_interpreter")
        refused({"tools": TINY_TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
                "tool_choice", "nope")
        refused({"tools": TINY_TOOLS, "tool_choice": "always"}, "tool_choice")
        refused({"tool_choice": "required"}, "tool_choice")
        refused({"messages": USER + [{"role": "tool", "content": "x", "tool_call_id": 5}]}, "messages", "tool_call_id")
        unique = {"type": "function", "function": {"name": "tag", "strict": True, "parameters": {
            "type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}}}}}
        refused({"tools": [unique]}, "tools", "uniqueItems")
        refused({"tools": TINY_TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
                "tool_choice")
        # not strict: the arguments are held to be an object only
        loose = {**unique, "function": {**unique["function"], "strict": False}}
        r = http.post("/v1/chat/completions", json={"messages": USER, "max_tokens": TINY, "tools": [loose],
                                                     "tool_choice": "required", "temperature": 0})
        assert r.status_code == 200, r.text
        (call,) = r.json()["choices"][0]["message"]["tool_calls"]
        assert isinstance(json.loads(call["function"]["arguments"]), dict)
        assert http.get("/metrics").status_code == 200


# ------------------------------------------------------------------------ the default model

WEATHER = tool_suite.tool("get_weather")
SHOT = [{"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "content": "sunny, 24 C", "tool_call_id": "call_1"},
        {"role": "assistant", "content": "It is sunny in Paris, 24 C."}]


def test_default_model_calls_tools(smol):
    schemas = {"get_weather": WEATHER["function"]["parameters"], "add": tool_suite.FUNCTIONS["add"][1]}
    tools = [WEATHER, tool_suite.tool("add")]
    forced = [("required", False), ({"type": "function", "function": {"name": "add"}}, True)]
    # the four requests at once (one batch); each is checked on its own
    with ThreadPoolExecutor(4) as pool:
        forced_answers = [pool.submit(ask, smol, [{"role": "user", "content": "What is 17 plus 25?"}], tools=tools,
                                      tool_choice=choice, stream=stream) for choice, stream in forced]
        # auto: after one worked example the model calls the tool, under the grammar once opened
        auto_answers = [pool.submit(ask, smol, SHOT + [{"role": "user", "content": "What is the weather in Tokyo?"}],
                                    tools=tools, stream=stream) for stream in (False, True)]
    for answer in forced_answers:
        content, calls, finish = answer.result()
        assert calls and content is None and finish == "tool_calls"
        valid(calls, schemas)
    for answer in auto_answers:
        content, calls, finish = answer.result()
        assert [c["name"] for c in calls] == ["get_weather"] and finish == "tool_calls" and content is None
        valid(calls, schemas)
        assert json.loads(calls[0]["arguments"])["city"] == "Tokyo"


def test_default_model_two_step_tool_loop(smol):
    messages = [{"role": "user", "content": "What is the weather in Rome?"}]
    _, calls, _ = ask(smol, messages, tools=[WEATHER], tool_choice="required")
    (call,) = calls
    messages += [{"role": "assistant", "content": None, "tool_calls": [
                     {"id": call["id"], "type": "function",
                      "function": {"name": call["name"], "arguments": call["arguments"]}}]},
                 {"role": "tool", "content": "rainy, 14 degrees", "tool_call_id": call["id"]}]
    content, calls, finish = ask(smol, messages, tools=[WEATHER], tool_choice="none", max_tokens=32)
    assert calls == [] and finish in ("stop", "length") and content
    assert "rome" in content.lower(), content  # (an answer to the question, from the tool's result)


def test_default_model_suite_is_valid_in_required_mode(smol):
    # every function on its own, every other one sampled, all at once; few tokens: the grammar
    # closes each call within max_tokens
    def one(job: tuple[str, float]):
        name, temperature = job
        return job, ask(smol, [{"role": "user", "content": tool_suite.request(name)}], tools=[tool_suite.tool(name)],
                        tool_choice="required", temperature=temperature, seed=7, max_tokens=128)

    jobs = [(name, (0.0, 1.0)[i % 2]) for i, name in enumerate(tool_suite.FUNCTIONS)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(one, jobs))
    assert len(results) == len(tool_suite.FUNCTIONS) >= 30
    for (name, _), (_, calls, finish) in results:
        # (the grammar closes a call within max_tokens: one that ends on the last token is "length")
        assert calls and finish in ("tool_calls", "length") and [c["name"] for c in calls] == [name] * len(calls)
        valid(calls, {name: tool_suite.FUNCTIONS[name][1]})
