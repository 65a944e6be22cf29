"""Clients written for vLLM's OpenAI server, unchanged but for the address: every field that
asks for nothing is accepted (and refused, naming it, where it asks for something radixd
lacks), and vLLM's extras do what vLLM does. The real ``openai`` client against a real
daemon on a tiny random-weight model; ``logit_bias`` also in the sampler directly."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest
import torch
from conftest import Daemon, make_tiny_checkpoint

pytestmark = pytest.mark.slow
KEY = "sk-vllm-extras"
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}"
            "{% if not (loop.last and continue_final_message) %}\n{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}{% if greeting %}{{ greeting }}{% endif %}")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import AutoTokenizer

    path = make_tiny_checkpoint(tmp_path_factory.mktemp("model") / "llama", "llama")
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = TEMPLATE  # a template that reads a chat_template_kwargs variable
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tok(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def daemon(model_dir, tmp_path_factory):
    d = Daemon(tmp_path_factory.mktemp("vllm"), f"""
[model]
path = "{model_dir}"
[server]
port = 0
[memory]
kv_cache_tokens = 4096
[limits]
default_max_tokens = 8
max_n = 4
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
    with httpx.Client(base_url=daemon.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as c:
        yield c


def msgs(text: str = "hello world"):
    return [{"role": "user", "content": text}]


def chat(client, **kw):
    return client.chat.completions.create(model="llama", messages=kw.pop("messages", msgs()),
                                          max_tokens=kw.pop("max_tokens", 4), temperature=kw.pop("temperature", 0), **kw)


def complete(client, **kw):
    return client.completions.create(model="llama", prompt=kw.pop("prompt", "hello world"),
                                     max_tokens=kw.pop("max_tokens", 4), temperature=kw.pop("temperature", 0), **kw)


def refused(http, route: str, body: dict, param: str) -> dict:
    base = {"model": "llama", "max_tokens": 2}
    base.update({"messages": msgs()} if route == "chat" else {"prompt": "hello"})
    r = http.post("/v1/chat/completions" if route == "chat" else "/v1/completions", json={**base, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    return err


# ------------------------------------------------------------------------ fields that ask for nothing

BOTH_NO_OPS = {"best_of": 1, "use_beam_search": False, "length_penalty": 1.0, "lora_path": None,
               "allowed_token_ids": None, "bad_words": [], "logits_processors": [],
               "return_tokens_as_token_ids": False, "return_token_ids": False, "guided_decoding_backend": None,
               "guided_whitespace_pattern": None, "structural_tag": None, "cache_salt": None,
               "kv_transfer_params": None, "vllm_xargs": None}
CHAT_NO_OPS = {**BOTH_NO_OPS, "store": False, "metadata": {}, "tools": [], "functions": [], "tool_choice": "none",
               "function_call": "none", "parallel_tool_calls": True, "service_tier": "auto", "modalities": ["text"],
               "audio": None, "prediction": None, "reasoning_effort": None, "include_reasoning": True,
               "chat_template": None, "documents": [], "mm_processor_kwargs": {}}
COMPLETION_NO_OPS = {**BOTH_NO_OPS, "suffix": ""}
# a value of each that asks for something radixd does not do: 400 naming the field
ASKING = {"best_of": 2, "use_beam_search": True, "length_penalty": 0.5, "store": True, "tools": [
    {"type": "web_search"}], "tool_choice": {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": []}},
    "lora_path": "adapter", "suffix": " end", "allowed_token_ids": [1, 2], "bad_words": ["x"],
    "return_tokens_as_token_ids": True, "service_tier": "flex", "reasoning_effort": "high",
    "metadata": {"a": "b"}, "modalities": ["audio"], "chat_template": "{{ messages }}"}


@pytest.mark.parametrize("field", sorted(CHAT_NO_OPS))
def test_chat_no_op_fields(client, http, field):
    value = CHAT_NO_OPS[field]
    plain = chat(client)
    r = chat(client, extra_body={field: value})
    assert r.choices[0].message.content == plain.choices[0].message.content
    assert chat(client, extra_body={field: None}).choices[0].message.content == plain.choices[0].message.content
    if field in ASKING:
        err = refused(http, "chat", {field: ASKING[field]}, field)
        assert err["code"] == "unsupported_parameter"


@pytest.mark.parametrize("field", sorted(COMPLETION_NO_OPS))
def test_completion_no_op_fields(client, http, field):
    value = COMPLETION_NO_OPS[field]
    plain = complete(client)
    assert complete(client, extra_body={field: value}).choices[0].text == plain.choices[0].text
    assert complete(client, extra_body={field: None}).choices[0].text == plain.choices[0].text
    if field in ASKING:
        err = refused(http, "completion", {field: ASKING[field]}, field)
        assert err["code"] == "unsupported_parameter"


def test_stream_options_at_defaults_without_stream(client, http):
    opts = {"include_usage": False, "continuous_usage_stats": False}
    assert chat(client, stream_options=opts).choices[0].message.content is not None
    assert complete(client, extra_body={"stream_options": {"include_usage": None}}).choices[0].text is not None
    refused(http, "chat", {"stream_options": {"include_usage": True}}, "stream_options")


def test_readme_tables_name_every_field():
    from pathlib import Path

    from radixd.server.openai_extras import CHAT_EXTRA_SCHEMAS, EXTRA_SCHEMAS, NO_OPS

    readme = Path(__file__).resolve().parent.parent.joinpath("README.md").read_text()
    section = readme.split("## Coming from SGLang / vLLM")[1].split("\n## ")[0]
    rows = {m for line in section.splitlines() if line.startswith("| `")
            for m in re.findall(r"`([a-z_.]+)`", line.split(" | ")[0])}
    assert set(NO_OPS) | set(EXTRA_SCHEMAS) | set(CHAT_EXTRA_SCHEMAS) <= rows | {"guided_json", "guided_regex"}
    assert {"guided_json", "guided_regex", "guided_choice", "guided_grammar",
            "stream_options.continuous_usage_stats"} <= rows


def test_best_of_equal_to_n(client, http):
    r = chat(client, n=2, temperature=1, seed=3, extra_body={"best_of": 2})
    assert len(r.choices) == 2
    refused(http, "chat", {"n": 2, "best_of": 3}, "best_of")
    assert len(complete(client, n=3, best_of=3).choices) == 3
    refused(http, "completion", {"best_of": 2}, "best_of")


def test_parallel_tool_calls_is_a_boolean(http):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    refused(http, "chat", {"parallel_tool_calls": "no", "tools": tools}, "parallel_tool_calls")


def test_null_for_every_optional_field(http):
    from radixd.server.protocol import CHAT_SCHEMAS, COMPLETION_SCHEMAS

    for route, table, base in (("/v1/chat/completions", CHAT_SCHEMAS, {"messages": msgs()}),
                               ("/v1/completions", COMPLETION_SCHEMAS, {"prompt": "hello"})):
        nulls = {k: None for k, s in table.items() if {"type": "null"} in s.get("anyOf", [])}
        assert {"best_of", "logit_bias", "structured_outputs", "stream_options", "max_tokens"} <= set(nulls)
        r = http.post(route, json={**nulls, **base})
        assert r.status_code == 200, r.text


# ------------------------------------------------------------------------ structured outputs

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}, "n": {"type": "integer"}},
          "required": ["name", "n"], "additionalProperties": False}


def _valid(text: str) -> bool:
    doc = json.loads(text)
    return set(doc) == {"name", "n"} and isinstance(doc["name"], str) and type(doc["n"]) is int


@pytest.mark.parametrize("how", ["structured_outputs", "guided"])
def test_structured_outputs(client, http, how):
    def body(kind, value):
        return {"structured_outputs": {kind: value}} if how == "structured_outputs" else {f"guided_{kind}": value}

    for route in (chat, complete):
        def text(r):
            c = r.choices[0]
            return c.message.content if hasattr(c, "message") else c.text

        assert _valid(text(route(client, max_tokens=40, extra_body=body("json", SCHEMA))))
        assert _valid(text(route(client, max_tokens=40, extra_body=body("json", json.dumps(SCHEMA)))))
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", text(route(client, max_tokens=12,
                                                            extra_body=body("regex", r"[0-9]{3}-[a-z]{2}"))))
        choices = ["yes.", "no (a*b)", "maybe|not"]  # regex metacharacters are literals
        for seed in range(3):
            out = text(route(client, max_tokens=12, temperature=1, seed=seed, extra_body=body("choice", choices)))
            assert out in choices
        lark = 'start: "a" DIGIT+ "z"\nDIGIT: /[0-9]/'
        assert re.fullmatch(r"a[0-9]+z", text(route(client, max_tokens=10, extra_body=body("grammar", lark))))
    err = refused(http, "chat", body("grammar", 'root ::= "a" [0-9]+'), "structured_outputs" if
                  how == "structured_outputs" else "guided_grammar")
    assert "GBNF" in err["message"] and "Lark" in err["message"]
    refused(http, "chat", body("choice", []), "structured_outputs" if how == "structured_outputs"
            else "guided_choice")


def test_structured_outputs_json_object_and_conflicts(client, http):
    out = chat(client, max_tokens=30, extra_body={"structured_outputs": {"json_object": True, "disable_fallback": True}})
    assert isinstance(json.loads(out.choices[0].message.content), dict)
    refused(http, "chat", {"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs")
    refused(http, "chat", {"guided_regex": "a", "guided_choice": ["b"]}, "guided_regex")
    refused(http, "chat", {"guided_regex": "a", "regex": "b"}, "guided_regex")
    refused(http, "chat", {"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs")
    refused(http, "chat", {"structured_outputs": {"frobnicate": 1}}, "structured_outputs")


# ------------------------------------------------------------------------ streaming usage


def test_continuous_usage_stats(client):
    for create in (lambda **kw: chat(client, **kw), lambda **kw: complete(client, **kw)):
        stream = create(max_tokens=6, stream=True,
                        stream_options={"include_usage": True, "continuous_usage_stats": True})
        chunks = list(stream)
        assert chunks and all(c.usage is not None for c in chunks)
        done = [c.usage.completion_tokens for c in chunks]
        assert done == sorted(done) and done[-1] == 6
        assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in chunks)
        plain = list(create(max_tokens=6, stream=True, stream_options={"include_usage": True}))
        assert [c.usage is not None for c in plain] == [False] * (len(plain) - 1) + [True]


# ------------------------------------------------------------------------ prompt logprobs and echo


def test_echo_with_logprobs(client, tok):
    prompt = "hello radix attention"
    ids = tok(prompt).input_ids
    r = complete(client, prompt=prompt, echo=True, logprobs=2, max_tokens=3)
    c = r.choices[0]
    assert c.text.startswith(prompt)
    lp = c.logprobs
    assert len(lp.tokens) == len(ids) + 3 and "".join(lp.tokens[:len(ids)]) == prompt
    assert lp.token_logprobs[0] is None and all(v <= 0 for v in lp.token_logprobs[1:])
    assert lp.top_logprobs[0] is None and all(1 <= len(t) <= 2 for t in lp.top_logprobs[1:])
    for token, value, top in zip(lp.tokens[1:len(ids)], lp.token_logprobs[1:len(ids)], lp.top_logprobs[1:len(ids)],
                                 strict=True):  # the prompt's alternatives, as the generated tokens'
        assert max(top.values()) >= value and (token not in top or top[token] == pytest.approx(value))
    assert lp.text_offset[len(ids)] == len(prompt)
    # the same values as vLLM's prompt_logprobs, and streamed alike
    plp = complete(client, prompt=prompt, max_tokens=3, extra_body={"prompt_logprobs": 0}).choices[0]
    assert [v for d in plp.prompt_logprobs[1:] for v in [next(iter(d.values()))["logprob"]]] == \
        pytest.approx(lp.token_logprobs[1:len(ids)])
    for choice in complete(client, prompt=prompt, echo=True, logprobs=1, max_tokens=2, n=2, temperature=1,
                           seed=5).choices:  # every sample leads with the same prompt logprobs
        assert choice.logprobs.token_logprobs[:len(ids)] == pytest.approx(lp.token_logprobs[:len(ids)])
    streamed = list(complete(client, prompt=prompt, echo=True, logprobs=2, max_tokens=3, stream=True))
    text = "".join(ch.choices[0].text for ch in streamed if ch.choices)
    toks = [t for ch in streamed if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.tokens]
    assert text == c.text and toks == lp.tokens


def test_stop_reason(client, http):
    """vLLM's ``stop_reason``: the stop string or stop token id that ended a choice, null
    when it ended otherwise; on the finishing stream chunk too."""
    plain = complete(client, max_tokens=8, extra_body={"ignore_eos": True}).choices[0]
    assert plain.finish_reason == "length" and plain.model_extra["stop_reason"] is None
    text = plain.text
    stop = text[len(text) // 2:][:2]
    c = complete(client, max_tokens=8, stop=[stop], extra_body={"ignore_eos": True}).choices[0]
    assert c.finish_reason == "stop" and c.model_extra["stop_reason"] == stop and c.text == text[:text.index(stop)]
    ids = http.post("/generate", json={"text": "hello world", "sampling_params": {
        "max_new_tokens": 8, "temperature": 0, "ignore_eos": True}}).json()["output_ids"]  # the same greedy run
    by_id = complete(client, max_tokens=8, extra_body={"ignore_eos": True, "stop_token_ids": [ids[2]]}).choices[0]
    assert by_id.finish_reason == "stop" and by_id.model_extra["stop_reason"] == ids[2]
    last = [ch for ch in complete(client, max_tokens=8, stop=[stop], stream=True, extra_body={"ignore_eos": True})
            if ch.choices and ch.choices[0].finish_reason][-1]
    assert last.choices[0].model_extra["stop_reason"] == stop


def test_chat_echo(client):
    """vLLM's chat ``echo``: a reply to an assistant prefill leads with the prefill."""
    prefill = msgs() + [{"role": "assistant", "content": "The capital"}]
    plain = chat(client, messages=prefill, extra_body={"continue_final_message": True})
    echoed = chat(client, messages=prefill, extra_body={"continue_final_message": True, "echo": True})
    assert echoed.choices[0].message.content == "The capital" + plain.choices[0].message.content
    assert (echoed.usage.prompt_tokens, echoed.usage.completion_tokens) == \
        (plain.usage.prompt_tokens, plain.usage.completion_tokens)  # the echo is not generated
    streamed = list(chat(client, messages=prefill, stream=True, extra_body={"continue_final_message": True,
                                                                            "echo": True}))
    deltas = [c.choices[0].delta.content for c in streamed if c.choices and c.choices[0].delta.content]
    assert deltas[0] == "The capital" and "".join(deltas) == echoed.choices[0].message.content
    # the last message is the user's: nothing to echo
    assert chat(client, extra_body={"echo": True}).choices[0].message.content == chat(client).choices[0].message.content


def test_prompt_logprobs(client, http, tok, model_dir):
    r = chat(client, extra_body={"prompt_logprobs": 0})
    plp = r.model_extra["prompt_logprobs"]
    assert len(plp) == r.usage.prompt_tokens and plp[0] is None
    for entry in plp[1:]:
        (tid, v), = entry.items()
        assert v["logprob"] <= 0 and v["decoded_token"] == tok.decode([int(tid)])
    c = complete(client, prompt=[5, 6, 7, 8], extra_body={"prompt_logprobs": 0}).choices[0]
    assert [list(d) if d else None for d in c.prompt_logprobs] == [None, ["6"], ["7"], ["8"]]
    # with alternatives: the token itself (its rank) and the 3 most likely, against transformers
    from conftest import _hf_model
    ids = [5, 6, 7, 8, 9, 10]
    with torch.no_grad():
        logp = torch.log_softmax(_hf_model(model_dir)(torch.tensor([ids])).logits[0].float(), -1)
    c = complete(client, prompt=ids, extra_body={"prompt_logprobs": 3}).choices[0]
    for q, entry in enumerate(c.prompt_logprobs[1:], start=1):
        want = logp[q - 1]
        top3 = want.topk(3).indices.tolist()
        assert set(entry) == {str(t) for t in [ids[q], *top3]}
        own = entry[str(ids[q])]
        assert own["logprob"] == pytest.approx(want[ids[q]].item(), abs=1e-4)
        assert own["rank"] == int((want > want[ids[q]]).sum()) + 1
        assert [entry[str(t)]["rank"] for t in top3 if t != ids[q]] == [r + 1 for r, t in enumerate(top3) if t != ids[q]]
        assert all(entry[str(t)]["logprob"] == pytest.approx(want[t].item(), abs=1e-4) for t in top3)
    refused(http, "chat", {"prompt_logprobs": 21}, "prompt_logprobs")
    refused(http, "completion", {"prompt_logprobs": 0, "stream": True}, "prompt_logprobs")


# ------------------------------------------------------------------------ the chat template


def test_template_options(client, http, tok):
    def rendered(messages, **kw):
        out = tok.apply_chat_template(messages, tokenize=True, **kw)
        return len(out["input_ids"] if hasattr(out, "keys") else out)

    m = msgs()
    assert chat(client).usage.prompt_tokens == rendered(m, add_generation_prompt=True)
    assert chat(client, extra_body={"add_generation_prompt": False}).usage.prompt_tokens == rendered(m)
    prefill = m + [{"role": "assistant", "content": "The capital"}]
    r = chat(client, messages=prefill, extra_body={"continue_final_message": True})
    assert r.usage.prompt_tokens == rendered(prefill, continue_final_message=True)
    assert rendered(prefill, continue_final_message=True) < rendered(prefill, add_generation_prompt=True)
    r = chat(client, extra_body={"chat_template_kwargs": {"greeting": "hello world"}})
    assert r.usage.prompt_tokens == rendered(m, add_generation_prompt=True, greeting="hello world")
    assert r.usage.prompt_tokens > chat(client).usage.prompt_tokens
    refused(http, "chat", {"continue_final_message": True, "add_generation_prompt": True}, "continue_final_message")
    refused(http, "chat", {"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs")


def test_assistant_tool_calls_rendered(client, http):
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    history = msgs() + [{"role": "assistant", "content": None, "tool_calls": [call]},
                        {"role": "tool", "content": "42", "tool_call_id": "c1"}]
    without = msgs() + [{"role": "assistant", "content": None}, {"role": "tool", "content": "42"}]
    # (this template shows only contents: the call is spelled in the assistant's content)
    assert chat(client, messages=history).usage.prompt_tokens > chat(client, messages=without).usage.prompt_tokens
    err = refused(http, "chat", {"messages": msgs() + [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {}}}]}]}, "messages[1].tool_calls")
    assert "arguments" in err["message"]
    empty = msgs() + [{"role": "assistant", "content": "hi", "tool_calls": []}] + msgs()
    assert chat(client, messages=empty).choices[0].message.content is not None


# ------------------------------------------------------------------------ output text options


def test_include_stop_str_in_output(client):
    full = complete(client, max_tokens=16, extra_body={"ignore_eos": True}).choices[0].text
    stop = next(full[i:i + 2] for i in range(2, len(full) - 2) if full[i:i + 2].strip())
    cut = full.index(stop)
    without = complete(client, max_tokens=16, stop=[stop], extra_body={"ignore_eos": True}).choices[0]
    kept = complete(client, max_tokens=16, stop=[stop],
                    extra_body={"ignore_eos": True, "include_stop_str_in_output": True}).choices[0]
    assert without.text == full[:cut] and kept.text == full[:cut + len(stop)]
    assert without.finish_reason == kept.finish_reason == "stop"
    streamed = list(complete(client, max_tokens=16, stop=[stop], stream=True,
                             extra_body={"ignore_eos": True, "include_stop_str_in_output": True}))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == kept.text


def test_spaces_between_special_tokens(client, http):
    plain = complete(client, extra_body={"skip_special_tokens": False}).choices[0].text
    for value in (True, False):
        r = complete(client, extra_body={"skip_special_tokens": False, "spaces_between_special_tokens": value})
        assert r.choices[0].text == plain
    refused(http, "completion", {"spaces_between_special_tokens": "yes"}, "spaces_between_special_tokens")


def test_truncate_prompt_tokens(client, http, tok):
    ids = list(range(3, 53))
    r = complete(client, prompt=ids, extra_body={"truncate_prompt_tokens": 10})
    assert r.usage.prompt_tokens == 10
    assert r.choices[0].text == complete(client, prompt=ids[-10:]).choices[0].text
    text = "hello world, hello radix attention"
    r = complete(client, prompt=text, extra_body={"truncate_prompt_tokens": 3})
    assert r.usage.prompt_tokens == 3
    assert chat(client, extra_body={"truncate_prompt_tokens": 4}).usage.prompt_tokens == 4
    assert complete(client, prompt=ids, extra_body={"truncate_prompt_tokens": -1}).usage.prompt_tokens == 50
    refused(http, "completion", {"truncate_prompt_tokens": 0}, "truncate_prompt_tokens")


# ------------------------------------------------------------------------ logit_bias


def test_logit_bias_changes_greedy_token(client, http):
    ids = [5, 17, 42, 9]
    first = complete(client, prompt=ids, max_tokens=1, logprobs=1).choices[0]
    greedy = first.logprobs.tokens[0]
    top = complete(client, prompt=ids, max_tokens=1, logprobs=5).choices[0].logprobs.top_logprobs[0]
    assert max(top, key=top.get) == greedy
    target = 77  # a token greedy does not pick: +100 makes it the pick
    forced = complete(client, prompt=ids, max_tokens=3, logit_bias={str(target): 100}).choices[0]
    tok_text = http.post("/v1/detokenize", json={"tokens": [target]}).json()["prompt"]
    assert forced.text == tok_text * 3
    greedy_id = http.post("/v1/tokenize", json={"prompt": first.text}).json()["tokens"]
    assert len(greedy_id) == 1  # -100 on the greedy token: another one is picked
    banned = complete(client, prompt=ids, max_tokens=1, logit_bias={str(greedy_id[0]): -100}).choices[0]
    assert banned.text != first.text
    # on chat, sampled, and alongside a request without a bias in the same batch
    r = chat(client, max_tokens=2, temperature=1, seed=1, n=2, logit_bias={str(target): 100})
    assert all(c.message.content == tok_text * 2 for c in r.choices)
    refused(http, "completion", {"logit_bias": {"5": 101}}, "logit_bias")
    refused(http, "completion", {"logit_bias": {"256": 1}}, "logit_bias")
    refused(http, "completion", {"logit_bias": {"x": 1}}, "logit_bias")


def test_response_format_structural_tag(client, http):
    """SGLang's structural tag as response_format on both routes: the random model, pushed
    towards the trigger (<pad>, a special token), writes structures that validate."""
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["n"], "additionalProperties": False}
    begin = '{"name": "f", "arguments": '
    tag = {"type": "structural_tag", "triggers": ["<pad>"],
           "structures": [{"begin": "<pad>" + begin, "schema": schema, "end": "}"}]}
    for route in (chat, complete):  # (the client's completions.create has no response_format argument)
        r = route(client, max_tokens=60, temperature=1, seed=4, logit_bias={"1": 8.0},
                  extra_body={"skip_special_tokens": False, "response_format": tag})
        c = r.choices[0]
        text = c.message.content if hasattr(c, "message") else c.text
        done = 0
        for piece in text.split("<pad>")[1:]:
            assert piece.startswith(begin) or begin.startswith(piece), text
            rest = piece[len(begin):].lstrip(" \t\n\r")
            try:
                doc, at = json.JSONDecoder().raw_decode(rest)
            except json.JSONDecodeError:
                continue  # cut short by max_tokens
            assert 0 <= doc["n"] <= 99 and set(doc) == {"n"} and rest[at:at + 1] in ("}", ""), text
            done += rest[at:at + 1] == "}"
        assert done, text
    err = refused(http, "chat", {"response_format": {"type": "structural_tag", "structures": [], "triggers": ["<a>"]}},
                  "structural_tag")
    assert "'structures'" in err["message"]
    refused(http, "chat", {"response_format": {"type": "structural_tag", "triggers": ["<a>"], "schema": {}}},
            "response_format")
