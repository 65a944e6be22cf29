"""SGLang's gateway (``smg`` from PyPI) in front of two radixd daemons on the default model:
everything it asks of a worker (registration's health, model and server info, the load it
polls, ``/generate`` with the fields it adds, the OpenAI routes, flush) works, with its
``cache_aware``, ``round_robin``, ``power_of_two`` and ``prefix_hash`` policies; and
``cache_aware`` keeps each shared system prompt on one daemon, which the prompt tokens the
daemons computed (their own counters) show against ``round_robin``'s. The ``/v1/loads`` body and the
``vllm:``/``sglang:`` gauges are checked in tests/test_engine_metrics.py."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from conftest import Daemon, SmgGateway

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
WORDS = ("river stone market lantern orbit copper meadow signal harbor velvet canyon ember"
         " glacier thread compass willow beacon prism tundra falcon anchor saffron quartz").split()
QUESTIONS = ["What is your name?", "What can you do?", "Say hello.", "Name a colour.", "Count to three.",
             "What day is it?", "Tell me a fact.", "Give me a word."]


def system_prompt(i: int) -> str:
    rng = random.Random(i)
    return f"You are assistant {i}. " + " ".join(rng.choice(WORDS) for _ in range(190))


@pytest.fixture(scope="module")
def daemons(tmp_path_factory):
    # 2400 slots: all eight ~230-token prompts (system prompt, template, question) and the
    # requests in flight fit on either daemon, so a hit rate counts where each prefix was
    # computed, never how cache_aware happened to split the new ones; both load at once
    dirs = [tmp_path_factory.mktemp(f"smg-worker{i}") for i in range(2)]
    with ThreadPoolExecutor(2) as pool:
        ds = list(pool.map(lambda tmp: Daemon(tmp, """
[model]
path = "default"
[server]
port = 0
[memory]
kv_cache_tokens = 2400
[limits]
default_max_tokens = 4
"""), dirs))
    yield ds
    for d in ds:
        assert d.stop() == 0


def counters(d: Daemon) -> tuple[int, int]:
    st = httpx.get(d.url + "/server_info", timeout=30).json()["stats"]
    return st["cache_hit_tokens"], st["cache_queried_tokens"]


def served_by(daemons: list[Daemon], prefix: str) -> dict[str, int]:
    """Request id -> the daemon whose access log has it (ids starting with ``prefix``)."""
    return {line["id"]: i for i, d in enumerate(daemons) for line in d.log_lines()
            if line.get("event") == "access" and str(line.get("id", "")).startswith(prefix)}


def run_workload(gw: SmgGateway, daemons: list[Daemon], tag: str) -> tuple[int, int, dict[int, set[int]]]:
    """8 system prompts x 8 questions through the gateway: the prompt tokens both daemons took
    from their caches and those they computed (their own counters), and which daemons served
    each system prompt.

    Each conversation's opening question comes first, two openings at a time (of two new
    prefixes in flight together, ``cache_aware`` gives one to each daemon); the other 56
    requests follow one at a time, shuffled."""
    assert httpx.post(gw.url + "/flush_cache", timeout=30).status_code == 200
    before = [counters(d) for d in daemons]
    order = random.Random(7)
    openings = [(s, order.randrange(8)) for s in order.sample(range(8), 8)]
    rest = [(s, q) for s in range(8) for q in range(8) if (s, q) not in openings]
    order.shuffle(rest)
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=120)

    def ask(job):
        s, q = job
        client.chat.completions.create(model=MODEL, max_tokens=1, temperature=0,
                                       messages=[{"role": "system", "content": system_prompt(s)},
                                                 {"role": "user", "content": QUESTIONS[q]}],
                                       extra_headers={"X-Request-Id": f"{tag}-{s}-{q}"})

    with ThreadPoolExecutor(2) as pool:
        for i in range(0, 8, 2):
            list(pool.map(ask, openings[i : i + 2]))
    for job in rest:  # one at a time: the CPU daemons gain nothing from more, and placement stays exact
        ask(job)
    after = [counters(d) for d in daemons]
    hits = sum(a[0] - b[0] for a, b in zip(after, before, strict=True))
    queried = sum(a[1] - b[1] for a, b in zip(after, before, strict=True))
    where: dict[int, set[int]] = {}
    for rid, i in served_by(daemons, tag + "-").items():
        where.setdefault(int(rid.split("-")[1]), set()).add(i)
    assert sum(1 for _ in served_by(daemons, tag + "-")) == 64
    return hits, queried - hits, where


def test_cache_aware_keeps_prefixes_apart(daemons, tmp_path):
    urls = [d.url for d in daemons]
    # cache_aware first, on daemons that have served nothing yet: the gateway places a new
    # prefix by the load the daemons report, and a generation rate measured under the other
    # policy's traffic would steer its first placements
    ca = SmgGateway(tmp_path, urls, "cache_aware")
    try:
        ca_hits, ca_computed, ca_where = run_workload(ca, daemons, "ca")
    finally:
        ca.stop()
    rr = SmgGateway(tmp_path, urls, "round_robin")
    try:
        rr_hits, rr_computed, rr_where = run_workload(rr, daemons, "rr")
    finally:
        rr.stop()
    print(f"hit rate: cache_aware {ca_hits / (ca_hits + ca_computed):.2f},"
          f" round_robin {rr_hits / (rr_hits + rr_computed):.2f}")
    assert all(len(v) == 1 for v in ca_where.values()), ca_where
    assert len({next(iter(v)) for v in ca_where.values()}) == 2  # both daemons serve some
    both = sum(len(v) == 2 for v in rr_where.values())
    assert both >= 1, rr_where
    # the same 64 prompts either way; round_robin computes each system prompt it sent to both
    # daemons once more (each is over 190 tokens), and nothing else differs: every prompt fits
    assert ca_hits + ca_computed == rr_hits + rr_computed
    assert rr_computed - ca_computed >= 190 * both, (ca_computed, rr_computed, both)


def test_prefix_hash_routes(daemons, tmp_path):
    gw = SmgGateway(tmp_path, [d.url for d in daemons], "prefix_hash")
    try:
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        for s in range(2):
            chat = client.chat.completions.create(model=MODEL, max_tokens=2, temperature=0, messages=[
                {"role": "system", "content": system_prompt(s)}, {"role": "user", "content": QUESTIONS[0]}])
            assert chat.usage.completion_tokens == 2
        r = httpx.post(gw.url + "/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 2}}, timeout=120)
        assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 2
    finally:
        gw.stop()


def test_every_route_through_the_gateway(daemons, tmp_path):
    gw = SmgGateway(tmp_path, [d.url for d in daemons], "power_of_two")
    try:
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        assert [m.id for m in client.models.list().data] == [MODEL]
        msgs = [{"role": "user", "content": "What is the capital of France?"}]
        chat = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, temperature=0)
        assert chat.choices[0].message.content and chat.usage.completion_tokens == 4
        text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model=MODEL, messages=msgs, max_tokens=4, temperature=0, stream=True) if c.choices)
        assert text == chat.choices[0].message.content
        comp = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=3, temperature=0)
        assert comp.choices[0].text and comp.usage.completion_tokens == 3
        # smg writes store: true (the Responses default) into every request; radixd stores nothing
        resp = client.responses.create(model=MODEL, input="Say hello.", max_output_tokens=4, store=False)
        assert resp.output_text and resp.store is False
        with pytest.raises(openai.BadRequestError, match="store"):
            client.responses.create(model=MODEL, input="Say hello.", max_output_tokens=4)
        # /generate: smg adds model ("unknown" when the client names none) and its defaults
        for body in ({"text": "The capital of France is", "sampling_params": {"max_new_tokens": 3, "temperature": 0}},
                     {"text": "The capital of France is", "model": MODEL,
                      "sampling_params": {"max_new_tokens": 3, "temperature": 0}}):
            r = httpx.post(gw.url + "/generate", json=body, timeout=120)
            assert r.status_code == 200, r.text
            assert r.json()["meta_info"]["completion_tokens"] == 3
        r = httpx.post(gw.url + "/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 2},
                                                   "stream": True}, timeout=120)
        assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
        flushed = httpx.post(gw.url + "/flush_cache", timeout=30)
        assert flushed.status_code == 200 and flushed.json()["workers_flushed"] == 2
        workers = httpx.get(gw.url + "/workers", timeout=10).json()["workers"]
        assert {w["runtime_type"] for w in workers} == {"sglang"}
        assert {w["labels"]["max_total_tokens"] for w in workers} == {"2400"}
    finally:
        gw.stop()
