"""radixd.lang programs against the in-process engine and a real daemon (tiny models; the
default model in ``test_lang_default_model``)."""

from __future__ import annotations

import json
import re
import threading
import time

import httpx
import jsonschema
import pytest
import torch
from conftest import Daemon, _hf_model
from test_daemon_lifecycle import toml
from transformers import AutoTokenizer

from radixd.lang import (
    EngineRuntime,
    ProgramError,
    RuntimeEndpoint,
    assistant,
    function,
    gen,
    select,
    system,
    user,
)


@function
def chat(s, question):
    s += system("You are terse.")
    s += user(question)
    s += assistant(gen("answer", max_tokens=6, temperature=0, ignore_eos=True))
    s += user("And again?")
    s += assistant(gen("again", max_tokens=4, temperature=0, ignore_eos=True))


@function
def pick(s, question, choices):
    s += user(question)
    s += assistant(select("choice", choices=choices))


class Timed:
    """A back end wrapper recording when each generate call ran (to see concurrency)."""

    def __init__(self, inner):
        self.inner = inner
        self.spans: list[tuple[float, float, dict]] = []
        self.lock = threading.Lock()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def generate(self, text, params, on_text):
        t0 = time.monotonic()
        meta = self.inner.generate(text, params, on_text)
        with self.lock:
            self.spans.append((t0, time.monotonic(), meta))
        return meta


def hf_choice_scores(path, prefix: str, choices: list[str]) -> list[float]:
    """Independently: mean log-probability of each choice's tokens after ``prefix`` (fp32)."""
    tok = AutoTokenizer.from_pretrained(path)
    model = _hf_model(path)
    p_ids = tok(prefix).input_ids
    out = []
    for c in choices:
        ids = tok(prefix + c).input_ids
        start = max(1, next((i for i, (a, b) in enumerate(zip(p_ids, ids, strict=False)) if a != b), min(len(p_ids), len(ids))))
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
        vals = [float(lp[q - 1, ids[q]]) for q in range(start, len(ids))]
        out.append(sum(vals) / len(vals))
    return out


@pytest.fixture(scope="module")
def engine_rt(tiny_models):
    rt = EngineRuntime(model=str(tiny_models["llama"]), kv_cache_tokens=4096)
    yield rt
    rt.close()


def test_chat_program_renders_the_template(engine_rt, tiny_models):
    s = chat.run(question="hello there", backend=engine_rt)
    tok = AutoTokenizer.from_pretrained(tiny_models["llama"])
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "hello there"},
            {"role": "assistant", "content": s["answer"]}, {"role": "user", "content": "And again?"},
            {"role": "assistant", "content": s["again"]}]
    assert s.text() == tok.apply_chat_template(msgs, tokenize=False)
    assert s.get_meta_info("answer")["completion_tokens"] == 6
    assert s.get_meta_info("again")["cached_tokens"] > 0  # the first turn came from the cache


def test_select_is_argmax_of_loglikelihoods(engine_rt, tiny_models):
    choices = ["red", "green and blue", "a very long yellow", "x"]
    s = pick.run(question="Which colour?", backend=engine_rt, choices=choices)
    assert s["choice"] in choices
    prefix = s.text()[: s.text().rindex(s["choice"])]
    want = hf_choice_scores(tiny_models["llama"], prefix, choices)
    got = s.get_meta_info("choice")["normalized_logprobs"]
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-4
    assert s["choice"] == choices[max(range(len(choices)), key=lambda i: want[i])]


def test_fork_runs_branches_concurrently_on_the_cached_prefix(engine_rt):
    timed = Timed(engine_rt)

    @function
    def branches(s):
        s += "A long shared preamble for every branch: " + "lorem ipsum " * 20
        forks = s.fork(3)
        for i, f in enumerate(forks):
            f += f"Branch {i}: " + gen("x", max_tokens=24, temperature=0, ignore_eos=True)
        s += " | ".join(f["x"] for f in forks)

    s = branches.run(backend=timed)
    assert s.text().count(" | ") == 2
    spans = sorted(timed.spans)
    assert len(spans) == 3
    assert spans[1][0] < spans[0][1] and spans[2][0] < spans[0][1]  # all started before the first ended
    assert all(meta["cached_tokens"] > 0 for _, _, meta in spans[1:])  # the preamble came from the cache


def test_stream_and_errors_name_the_call(engine_rt):
    @function
    def two(s):
        s += "Count: " + gen("a", max_tokens=8, temperature=0, ignore_eos=True)

    st = two.run(backend=engine_rt, stream=True)
    chunks = list(st.text_iter())
    assert "".join(chunks) == st.text() and len(chunks) > 1

    @function
    def bad(s):
        s += "x" + gen("broken", max_tokens=4, temperature=-1.0)

    with pytest.raises(ProgramError, match=r"gen\('broken'\) failed: .*temperature"):
        bad.run(backend=engine_rt)


def test_open_turn_continues_inside_it(engine_rt, tiny_models):
    from radixd.lang import assistant_begin, assistant_end

    @function
    def partial(s):
        s += user("hi")
        s += assistant_begin() + "Sure: " + gen("g", max_tokens=3, temperature=0, ignore_eos=True)
        s += assistant_end()

    s = partial.run(backend=engine_rt)
    tok = AutoTokenizer.from_pretrained(tiny_models["llama"])
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure: " + s["g"]}]
    assert s.text() == tok.apply_chat_template(msgs, tokenize=False)


def test_run_batch_keeps_order(engine_rt):
    @function
    def echo(s, i):
        s += f"item {i}:" + gen("g", max_tokens=2, temperature=0, ignore_eos=True)

    states = echo.run_batch([{"i": i} for i in range(6)], backend=engine_rt, num_threads=3)
    assert [st.text().split(":")[0] for st in states] == [f"item {i}" for i in range(6)]
    results = echo.run_batch([{"i": 0}, {"j": 1}], backend=engine_rt, raise_errors=False)
    assert isinstance(results[1], TypeError) and not isinstance(results[0], Exception)


def cached_total(url: str) -> float:
    text = httpx.get(url + "/metrics").text
    m = re.search(r"^radixd_cached_prompt_tokens_total (\S+)$", text, re.M)
    return float(m.group(1))


def test_daemon_program_select_fork_and_errors(tiny_models, tmp_path):
    d = Daemon(tmp_path, toml(tiny_models["llama"]))
    rt = RuntimeEndpoint(d.url)
    try:
        s = chat.run(question="hi", backend=rt)
        assert s["answer"] and s.get_meta_info("again")["cached_tokens"] > 0
        choices = ["yes", "no", "maybe not"]
        s = pick.run(question="Well?", backend=rt, choices=choices)
        prefix = s.text()[: s.text().rindex(s["choice"])]
        want = hf_choice_scores(tiny_models["llama"], prefix, choices)
        assert s["choice"] == choices[max(range(3), key=lambda i: want[i])]
        before = cached_total(d.url)

        @function
        def branches(s):
            s += "shared context " * 30
            forks = s.fork(2)
            for f in forks:
                f += gen("x", max_tokens=4, temperature=0, ignore_eos=True)
            s += forks[0]["x"] + forks[1]["x"]

        branches.run(backend=rt)
        assert cached_total(d.url) > before  # the branches read the shared text from the cache

        @function
        def bad(s):
            s += "x" + gen("broken", max_tokens=4, top_p=0.0)

        with pytest.raises(ProgramError, match=r"gen\('broken'\) failed: HTTP 400: .*top_p"):
            bad.run(backend=rt)
        assert httpx.get(d.url + "/health").status_code == 200
    finally:
        rt.close()
        d.stop()


@pytest.mark.slow
def test_lang_default_model(tmp_path):
    """The default model behind a real daemon: a chat program answers, ``select`` picks the
    argmax of independently computed log-likelihoods, forks read their prefix from the cache."""
    from radixd.core.model_loader import resolve_model

    path = resolve_model("default", progress=False)
    d = Daemon(tmp_path, toml("default", model_keys={"gguf_weights": "fp32"}))  # (the weights transformers scores)
    rt = RuntimeEndpoint(d.url)
    try:
        @function
        def capital(s):
            s += user("What is the capital of France?")
            s += assistant(gen("answer", max_tokens=12, temperature=0))
            s += user("Which of these cities is it?")
            s += assistant(select("city", choices=["London", "Paris", "Berlin", "Madrid"]))

        s = capital.run(backend=rt)
        assert "Paris" in s["answer"]
        prefix = s.text()[: s.text().rindex(s["city"])]
        choices = ["London", "Paris", "Berlin", "Madrid"]
        want = hf_choice_scores(path, prefix, choices)
        got = s.get_meta_info("city")["normalized_logprobs"]
        assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-3
        assert s["city"] == choices[max(range(4), key=lambda i: want[i])] == "Paris"
        before = cached_total(d.url)

        @function
        def two_views(s):
            s += system("You are a travel guide. Keep answers to one sentence.")
            s += user("Describe Paris.")
            forks = s.fork(2)
            forks[0] += assistant(gen("a", max_tokens=16, temperature=0))
            forks[1] += assistant("In short: " + gen("b", max_tokens=16, temperature=0))
            s += forks[0]["a"] + forks[1]["b"]

        timed = Timed(rt)
        two_views.run(backend=timed)
        (s0, e0, m0), (s1, e1, m1) = sorted(timed.spans)
        assert s1 < e0  # concurrent
        assert cached_total(d.url) > before and max(m0["cached_tokens"], m1["cached_tokens"]) > 0

        schema = {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 30}, "price": {"type": "number", "minimum": 0},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3}},
            "required": ["name", "price", "tags"], "additionalProperties": False}

        @function
        def extract(s, text):
            s += user("Extract the product as JSON: " + text)
            s += assistant(gen("json", max_tokens=96, temperature=0, json_schema=schema))
            s += user("When was it released? Answer as YYYY-MM-DD.")
            s += assistant(gen("date", max_tokens=16, temperature=0, regex=r"(19|20)[0-9]{2}-[01][0-9]-[0-3][0-9]"))

        for st in extract.run_batch([{"text": "The Lumo desk lamp costs $35, dimmable, USB-C."},
                                     {"text": "Trailblazer boots, 120 euros, waterproof and light."}], backend=rt):
            jsonschema.validate(json.loads(st["json"]), schema)
            assert re.fullmatch(r"(19|20)[0-9]{2}-[01][0-9]-[0-3][0-9]", st["date"])
    finally:
        rt.close()
        d.stop()
