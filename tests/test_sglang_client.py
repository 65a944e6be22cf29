"""SGLang's own frontend (``import sglang``; ``sgl.RuntimeEndpoint``), unmodified, against a
real daemon on a tiny random-weight model: ``gen``, ``select``, regex ``gen``, ``fork``,
``run_batch`` and streaming; ``select`` picks what transformers' log-likelihoods pick.

The frontend is the pure-Python wheel installed without its server's dependencies:
``pip install --no-deps sglang==0.4.10.post2`` plus ``pybase64``, ``aiohttp`` and
``requests`` (the test extras)."""

from __future__ import annotations

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
    pytest.skip(f"SGLang's frontend is not installed ({exc}): pip install --no-deps sglang==0.4.10.post2",
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
