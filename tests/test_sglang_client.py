"""SGLang's own frontend (``import sglang``; ``sgl.RuntimeEndpoint``), unmodified, against a
real daemon on a tiny random-weight model: ``gen``, ``select``, regex ``gen``, ``fork``,
``run_batch`` and streaming; ``select`` picks what transformers' log-likelihoods pick.

The frontend is the pure-Python wheel ``sglang==0.4.10.post2`` (its declared dependencies are
the frontend's few; the server's are extras) plus ``pybase64``, which it imports: the test
extras."""

from __future__ import annotations

import json
import re

import httpx
import pytest
import torch
from conftest import Daemon, _hf_model
from test_daemon_lifecycle import toml
from transformers import AutoTokenizer

try:
    import sglang as sgl
except ImportError as exc:  # pragma: no cover - the test extras install it
    pytest.skip(f"SGLang's frontend is not installed ({exc}): pip install sglang==0.4.10.post2 pybase64",
                allow_module_level=True)


@pytest.fixture(scope="module")
def daemon(tiny_models, tmp_path_factory):
    d = Daemon(tmp_path_factory.mktemp("sglang"), toml(tiny_models["llama"]))
    yield d
    d.stop()


@pytest.fixture(scope="module")
def backend(daemon):
    return sgl.RuntimeEndpoint(daemon.url)


def hf_select_scores(path, prefix: str, choices: list[str]) -> list[float]:
    """SGLang's ``token_length_normalized`` scores, from transformers' fp32 log-softmax: the
    mean logprob of the tokens of prefix+choice from two before the prefix's end, the first
    dropped when its text ends the prefix (the frontend's token healing)."""
    tok = AutoTokenizer.from_pretrained(path)
    model = _hf_model(path)
    start = max(len(tok(prefix).input_ids) - 2, 0)
    scores = []
    for c in choices:
        ids = tok(prefix + c).input_ids
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
        vals = [None if i == 0 else logp[i - 1, ids[i]].item() for i in range(start, len(ids))]
        if prefix.endswith(tok.decode([ids[start]])):
            vals = vals[1:]
        kept = [v for v in vals if v]
        scores.append(sum(kept) / len(kept))
    return scores


def test_model_and_server_info(daemon, backend):
    assert backend.get_model_name() == backend.model_info["model_path"]
    info = backend.get_server_info()
    assert info["version"] and info["tp_size"] == 1 and info["internal_states"][0]["kv"]["total"] > 0
    assert httpx.get(daemon.url + "/health_generate", timeout=30).status_code == 200
    backend.flush_cache()  # raises unless 200


def test_gen_select_regex(tiny_models, backend):
    @sgl.function
    def prog(s):
        s += "The answer is"
        s += sgl.gen("free", max_tokens=8, temperature=0)
        s += "\nNumber: " + sgl.gen("num", regex=r"[0-9]{3}", temperature=0)
        s += "\nColour: " + sgl.select("colour", choices=["red", "green", "blue"])

    s = prog.run(backend=backend)
    assert s.get_meta_info("free")["completion_tokens"] == 8
    assert re.fullmatch(r"[0-9]{3}", s["num"])
    prefix = s.text()[: s.text().rindex(s["colour"])]
    choices = ["red", "green", "blue"]
    want = hf_select_scores(tiny_models["llama"], prefix, choices)
    got = s.get_meta_info("colour")["normalized_prompt_logprobs"]
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-3
    assert s["colour"] == choices[max(range(3), key=lambda i: want[i])]


def test_fork_and_run_batch(backend):
    @sgl.function
    def branches(s, topic):
        s += f"Topic: {topic}."
        forks = s.fork(2)
        for i, f in enumerate(forks):
            f += f" View {i}:" + sgl.gen("view", max_tokens=5, temperature=0)
        forks.join()
        s += forks[0]["view"] + forks[1]["view"]

    states = branches.run_batch([{"topic": "rivers"}, {"topic": "hills"}, {"topic": "rivers"}], backend=backend)
    assert all(st.text().startswith("Topic: ") for st in states)
    assert states[0].text() == states[2].text()  # greedy: the same program, the same text


def test_streaming(backend):
    @sgl.function
    def story(s):
        s += "Once upon a time" + sgl.gen("rest", max_tokens=12, temperature=0)

    state = story.run(stream=True, backend=backend)
    pieces = list(state.text_iter("rest"))
    assert len(pieces) > 1 and "".join(pieces) == state["rest"]
    assert "".join(pieces) == story.run(backend=backend)["rest"]


# SGLang's SamplingParams keys (sglang/srt/sampling/sampling_params.py) and its
# GenerateReqInput fields that ask for nothing at these values
SGLANG_PARAM_KEYS = ["max_new_tokens", "stop", "stop_token_ids", "temperature", "top_p", "top_k", "min_p",
                     "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n",
                     "json_schema", "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens",
                     "spaces_between_special_tokens", "no_stop_trim", "custom_params", "stream_interval",
                     "logit_bias"]
PARAM_NOOPS = {"spaces_between_special_tokens": True, "no_stop_trim": False, "structural_tag": None,
               "custom_params": None, "stream_interval": None, "logit_bias": {}}
BODY_NOOPS = {"lora_path": None, "image_data": None, "video_data": None, "audio_data": None, "input_embeds": None,
              "token_ids_logprob": None, "modalities": [], "session_params": None, "custom_logit_processor": None,
              "return_hidden_states": False, "log_metrics": True, "bootstrap_host": None, "bootstrap_port": None,
              "bootstrap_room": None, "data_parallel_rank": None}
PARAM_ASKS = {"spaces_between_special_tokens": False, "no_stop_trim": True,
              "custom_params": {"a": 1}, "stream_interval": 4, "logit_bias": {"5": 1.0}}
BODY_ASKS = {"lora_path": "adapter", "image_data": "x.png", "return_hidden_states": True, "log_metrics": False,
             "data_parallel_rank": 0, "session_params": {"id": "s"}}


def test_nulls_and_noops_accepted(daemon):
    sp = {k: None for k in SGLANG_PARAM_KEYS} | {"max_new_tokens": 3, "temperature": 0}
    body = {"text": "hello", "sampling_params": sp, "rid": "noop-1", "model": None, "stream": None,
            "return_logprob": None, "logprob_start_len": None, "top_logprobs_num": None,
            "return_text_in_logprobs": False, **BODY_NOOPS}
    r = httpx.post(daemon.url + "/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["meta_info"]["id"] == "noop-1" and out["meta_info"]["completion_tokens"] == 3
    assert out["meta_info"]["e2e_latency"] > 0
    r = httpx.post(daemon.url + "/generate", json={"text": "hello", "sampling_params": {
        "max_new_tokens": 3, "temperature": 0, **PARAM_NOOPS}}, timeout=60)
    assert r.status_code == 200 and r.json()["output_ids"] == out["output_ids"]
    r = httpx.post(daemon.url + "/generate", json={"text": ["a", "b"], "rid": ["r-a", "r-b"],
                                                   "sampling_params": {"max_new_tokens": 1}}, timeout=60)
    assert [a["meta_info"]["id"] for a in r.json()] == ["r-a", "r-b"]
    r = httpx.post(daemon.url + "/generate", json={"text": ["a", "b"], "rid": "one"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "rid"


@pytest.mark.parametrize("key", list(PARAM_ASKS) + list(BODY_ASKS))
def test_asking_for_missing_behaviour_is_refused(daemon, key):
    if key in PARAM_ASKS:
        body, param = {"text": "hi", "sampling_params": {key: PARAM_ASKS[key]}}, f"sampling_params.{key}"
    else:
        body, param = {"text": "hi", key: BODY_ASKS[key]}, key
    r = httpx.post(daemon.url + "/generate", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert r.json()["error"]["code"] == "unsupported_parameter"


def test_logprob_layout(tiny_models, daemon):
    path = tiny_models["llama"]
    tok = AutoTokenizer.from_pretrained(path)
    ids = tok("The quick brown fox").input_ids
    with torch.no_grad():
        logp = torch.log_softmax(_hf_model(path)(torch.tensor([ids])).logits[0].float(), -1)
    r = httpx.post(daemon.url + "/generate", json={
        "input_ids": ids, "sampling_params": {"max_new_tokens": 3, "temperature": 0}, "return_logprob": True,
        "logprob_start_len": 0, "top_logprobs_num": 2, "return_text_in_logprobs": True}, timeout=60)
    meta = r.json()["meta_info"]
    got = meta["input_token_logprobs"]
    assert [e[1] for e in got] == ids and got[0][0] is None
    assert [e[2] for e in got] == [tok.decode([t]) for t in ids]
    assert max(abs(got[i][0] - logp[i - 1, ids[i]].item()) for i in range(1, len(ids))) < 1e-3
    outs = meta["output_token_logprobs"]
    assert [e[1] for e in outs] == r.json()["output_ids"] and len(outs) == 3
    assert outs[0][1] == int(logp[-1].argmax()) and abs(outs[0][0] - logp[-1].max().item()) < 1e-3
    assert [len(t) for t in meta["output_top_logprobs"]] == [2, 2, 2]
    assert meta["output_top_logprobs"][0][0][1] == outs[0][1]
    # the defaults: only the last prompt token, no text; max_new_tokens 0 returns no output
    r = httpx.post(daemon.url + "/generate", json={
        "text": ["The quick brown fox", "a b"], "sampling_params": {"max_new_tokens": 0}, "return_logprob": True},
        timeout=60)
    first = r.json()[0]
    assert first["text"] == "" and first["output_ids"] == [] and first["meta_info"]["output_token_logprobs"] == []
    (entry,) = first["meta_info"]["input_token_logprobs"]
    assert entry[1:] == [ids[-1], None] and abs(entry[0] - logp[-2, ids[-1]].item()) < 1e-3


def test_stream_rid_and_abort(daemon):
    """SGLang's stream: ``data: {...}`` events with the text so far, then ``data: [DONE]``;
    ``/abort_request`` with the stream's ``rid`` ends it as aborted."""
    most = httpx.get(daemon.url + "/get_server_info", timeout=30).json()["context_length"] - 8
    body = {"text": "count", "rid": "to-abort", "stream": True,
            "sampling_params": {"max_new_tokens": most, "ignore_eos": True, "temperature": 0}}
    events = []
    with httpx.stream("POST", daemon.url + "/generate", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data:"):
                continue
            if line == "data: [DONE]":
                events.append(None)
                break
            events.append(json.loads(line[5:]))
            if len(events) == 3:
                assert httpx.post(daemon.url + "/abort_request", json={"rid": "to-abort"}, timeout=30).status_code == 200
    assert events[-1] is None and events[-2]["meta_info"]["finish_reason"] == "abort"
    texts = [e["text"] for e in events[:-1]]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:], strict=False))  # cumulative
    assert events[-2]["meta_info"]["id"] == "to-abort" and events[-2]["meta_info"]["completion_tokens"] < most
    assert httpx.post(daemon.url + "/abort_request", json={"rid": "gone"}, timeout=30).status_code == 200
