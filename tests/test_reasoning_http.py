"""Reasoning over HTTP with the official ``openai`` client: ``reasoning_content`` apart from
``content``, streamed and not, ``enable_thinking: false``, SGLang's and vLLM's request fields,
and ``response_format`` applying after the reasoning (vllm #47027).

The model is a tiny random Qwen3 whose tokenizer has ``<think>`` / ``</think>`` as added
tokens and whose chat template handles thinking as Qwen3's does (so ``reasoning_parser =
"auto"`` picks qwen3). Random weights do not close a think block on their own: a
``logit_bias`` on ``</think>`` does, at a step chosen from the model's own greedy logits
(the first step from the third on whose margin to ``</think>`` is below all earlier ones),
so every output here is deterministic."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from conftest import Daemon, _tokenizer, hf_greedy, make_tiny_checkpoint

pytestmark = pytest.mark.slow
KEY = "sk-reasoning"
TEMPLATE = (
    "{%- if tools %}<tools>{% for t in tools %}{{ t.function.name }} {% endfor %}</tools>\n{% endif %}"
    "{%- for m in messages %}{%- set c = m['content'] %}"
    "{%- if m['role'] == 'assistant' and '</think>' in c and not loop.last %}{%- set c = c.split('</think>')[-1] %}"
    "{%- endif %}<{{ m['role'] }}>{{ c }}{% if not (loop.last and continue_final_message) %}\n{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<assistant>"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{%- endif %}"
    "{%- endif %}")
OFF = {"chat_template_kwargs": {"enable_thinking": False}}
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                              "maximum": 99}},
          "required": ["ok", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    tok = _tokenizer()
    tok.add_tokens(["<think>", "</think>"])  # Qwen3's: added tokens, not special ones
    tok.chat_template = TEMPLATE
    return make_tiny_checkpoint(tmp_path_factory.mktemp("model") / "qwen3-think", "qwen3", tokenizer=tok)


@pytest.fixture(scope="module")
def daemon(model_dir, tmp_path_factory):
    d = Daemon(tmp_path_factory.mktemp("reasoning"), f"""
[model]
path = "{model_dir}"
[server]
port = 0
[memory]
kv_cache_tokens = 4096
[auth]
api_keys = ["{KEY}"]
""")
    yield d
    assert d.stop() == 0


@pytest.fixture(scope="module")
def client(daemon):
    return openai.OpenAI(base_url=daemon.url + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def http(daemon):
    with httpx.Client(base_url=daemon.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as c:
        yield c


MESSAGES = [{"role": "user", "content": "hello world"}]


@pytest.fixture(scope="module")
def closing(model_dir, http):
    """(the ``logit_bias`` that makes greedy decoding close the think block, the number of
    reasoning tokens before it)."""

    ids = http.post("/v1/tokenize", json={"model": "qwen3-think", "messages": MESSAGES}).json()["tokens"]
    return closing_bias(model_dir, ids)


def closing_bias(model_dir, ids: list[int]) -> tuple[dict, int]:
    from transformers import AutoTokenizer

    end = AutoTokenizer.from_pretrained(model_dir).convert_tokens_to_ids("</think>")
    _, logits = hf_greedy(model_dir, ids, 16)
    margins = (logits.max(-1).values - logits[:, end]).tolist()
    for k in range(2, len(margins)):
        below = min(margins[:k])
        if margins[k] < below - 0.05:
            return {str(end): (margins[k] + below) / 2}, k
    raise AssertionError(f"no step closes the think block first: margins {margins}")


def chat(client, bias, **kw):
    return client.chat.completions.create(model="qwen3-think", messages=kw.pop("messages", MESSAGES),
                                          temperature=0, logit_bias=bias, **kw)


def fields(message) -> tuple[str | None, str | None]:
    extra = message.model_extra or {}
    assert extra.get("reasoning") == extra.get("reasoning_content")  # vLLM's name and SGLang's
    return extra.get("reasoning_content"), message.content


def streamed(client, bias, **kw) -> tuple[str, str, list]:
    reasoning, content, chunks = [], [], []
    for chunk in chat(client, bias, stream=True, **kw):
        chunks.append(chunk)
        for c in chunk.choices:
            extra = c.delta.model_extra or {}
            assert extra.get("reasoning") == extra.get("reasoning_content")
            if extra.get("reasoning_content"):
                assert not "".join(content), "reasoning after content"
                reasoning.append(extra["reasoning_content"])
            content.append(c.delta.content or "")
    return "".join(reasoning), "".join(content), chunks


def test_reasoning_apart_from_content(client, closing):
    bias, k = closing
    raw = chat(client, bias, max_tokens=k + 6, extra_body={"separate_reasoning": False})
    text = raw.choices[0].message.content
    assert "</think>" in text and "reasoning_content" not in (raw.choices[0].message.model_extra or {})
    r = chat(client, bias, max_tokens=k + 6)
    reasoning, content = fields(r.choices[0].message)
    assert [reasoning, content] == text.split("</think>", 1) and reasoning and content
    tokens = (raw.usage.prompt_tokens, raw.usage.completion_tokens)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == tokens  # the split costs no tokens
    sr, sc, chunks = streamed(client, bias, max_tokens=k + 6, stream_options={"include_usage": True})
    assert (sr, sc) == (reasoning, content)
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == tokens and chunks[-2].choices[0].finish_reason == r.choices[0].finish_reason
    both = chat(client, bias, max_tokens=k + 6, n=2)  # a splitter per choice
    assert [fields(c.message) for c in both.choices] == [(reasoning, content)] * 2
    per = {0: ["", ""], 1: ["", ""]}
    for chunk in chat(client, bias, max_tokens=k + 6, n=2, stream=True):
        for c in chunk.choices:
            per[c.index][0] += (c.delta.model_extra or {}).get("reasoning_content") or ""
            per[c.index][1] += c.delta.content or ""
    assert per == {0: [reasoning, content], 1: [reasoning, content]}
    # SGLang's stream_reasoning false: the reasoning in one delta
    one = [c for c in chat(client, bias, max_tokens=k + 6, stream=True, extra_body={"stream_reasoning": False})
           if c.choices and (c.choices[0].delta.model_extra or {}).get("reasoning_content")]
    assert len(one) == 1 and one[0].choices[0].delta.model_extra["reasoning_content"] == reasoning
    # vLLM's include_reasoning false: the reasoning dropped, the content alone
    dropped = chat(client, bias, max_tokens=k + 6, extra_body={"include_reasoning": False}).choices[0].message
    assert dropped.content == content and "reasoning_content" not in (dropped.model_extra or {})


def test_cut_while_thinking(client, closing):
    bias, k = closing
    r = chat(client, bias, max_tokens=k)
    reasoning, content = fields(r.choices[0].message)
    assert reasoning and content is None and r.choices[0].finish_reason == "length"
    assert streamed(client, bias, max_tokens=k)[:2] == (reasoning, "")


def test_thinking_off(client, closing):
    bias, k = closing
    raw = chat(client, bias, max_tokens=k + 6, extra_body={**OFF, "separate_reasoning": False})
    r = chat(client, bias, max_tokens=k + 6, extra_body=OFF)
    assert fields(r.choices[0].message) == (None, raw.choices[0].message.content)
    assert streamed(client, bias, max_tokens=k + 6, extra_body=OFF)[:2] == ("", raw.choices[0].message.content)


def test_continued_message_inside_the_reasoning(client, closing):
    bias, _ = closing
    msgs = [*MESSAGES, {"role": "assistant", "content": "<think>I was"}]
    r = chat(client, {}, messages=msgs, max_tokens=4, extra_body={"continue_final_message": True,
                                                                    "add_generation_prompt": False})
    reasoning, content = fields(r.choices[0].message)
    assert reasoning and content is None  # the output goes on inside the open block
    done = [*MESSAGES, {"role": "assistant", "content": "<think>x</think>The"}]
    r = chat(client, {}, messages=done, max_tokens=4, extra_body={"continue_final_message": True,
                                                                    "add_generation_prompt": False})
    assert fields(r.choices[0].message)[0] is None and r.choices[0].message.content


def test_response_format_after_the_reasoning(client, closing):
    bias, k = closing
    free, _ = fields(chat(client, bias, max_tokens=k + 6).choices[0].message)
    rf = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    r = chat(client, bias, max_tokens=k + 40, response_format=rf)
    reasoning, content = fields(r.choices[0].message)
    assert reasoning == free  # the reasoning is not held to the schema
    doc = json.loads(content)
    assert set(doc) == {"ok", "n"} and isinstance(doc["ok"], bool) and 0 <= doc["n"] <= 99
    sr, sc, _ = streamed(client, bias, max_tokens=k + 40, response_format=rf)
    assert (sr, sc) == (reasoning, content)
    # json_object too; and with thinking off the grammar holds from the first token
    r = chat(client, bias, max_tokens=k + 40, response_format={"type": "json_object"})
    assert fields(r.choices[0].message)[0] == free and isinstance(json.loads(r.choices[0].message.content), dict)
    r = chat(client, bias, max_tokens=40, response_format=rf, extra_body=OFF)
    reasoning, content = fields(r.choices[0].message)
    assert reasoning is None and set(json.loads(content)) == {"ok", "n"}


WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
           "additionalProperties": False}


def test_tool_call_after_the_reasoning(client, model_dir):
    """A required tool call from a thinking model: the reasoning stays free, the call's
    grammar starts after it, and the call comes back as ``tool_calls``."""
    from transformers import AutoTokenizer

    tools = [{"type": "function", "function": {"name": "weather", "parameters": WEATHER}}]
    ids = AutoTokenizer.from_pretrained(model_dir).apply_chat_template(MESSAGES, tools=tools, tokenize=True,
                                                                       add_generation_prompt=True)
    bias, k = closing_bias(model_dir, ids["input_ids"] if hasattr(ids, "keys") else ids)
    free, _ = fields(chat(client, bias, max_tokens=k + 2, extra_body={"tools": tools}).choices[0].message)
    assert free  # it thinks first
    r = chat(client, bias, max_tokens=k + 120, tools=tools, tool_choice="required", parallel_tool_calls=False)
    choice = r.choices[0]
    reasoning, _ = fields(choice.message)
    assert reasoning == free and choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.function.name == "weather" and set(json.loads(call.function.arguments)) == {"city"}
    assert not (choice.message.content or "").strip()  # no call markup left in the content


def test_server_info_names_the_parser(http):
    assert http.get("/get_server_info").json()["reasoning_parser"] == "qwen3"  # "auto" found it


def test_bad_fields(http):
    for key in ("separate_reasoning", "stream_reasoning", "include_reasoning"):
        r = http.post("/v1/chat/completions", json={"model": "qwen3-think", "messages": MESSAGES, key: "no"})
        assert r.status_code == 400 and r.json()["error"]["param"] == key, r.text
