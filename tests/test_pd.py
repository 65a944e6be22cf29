"""Prefill/decode disaggregation: two daemons on the default model (prefill, decode) behind a
real SGLang gateway (``smg launch --pd-disaggregation``), the KV moved by the Mooncake
transfer engine over TCP on loopback.

Greedy outputs through the pair equal one daemon's computed alone (the prefill daemon asked
without bootstrap fields serves the request colocated) for chat, completions and /generate,
streamed and not; the decode side computes one prompt position, the rest arrives; the
prefill side's radix cache serves repeated prefixes; the faults (decode gone, a transfer
timing out, the client leaving either side, the prefill instance killed mid-transfer) end
in a clear error, with both pools idle after (from each daemon's KV accounting).
"""

from __future__ import annotations

import asyncio
import json
import random
import shutil
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.conftest import Daemon

pytestmark = [pytest.mark.slow, pytest.mark.skipif(shutil.which("smg") is None, reason="smg is not installed")]

mooncake = pytest.importorskip("mooncake.engine", reason="the Mooncake transfer engine is not installed")

MODEL = "SmolLM2-135M-Instruct"
PREFILL_TIMEOUT_S = 3.0   # prefill: a decode instance must ask for a room within this
DECODE_TIMEOUT_S = 1.5    # decode: the KV must arrive within this
DECODE_SLOTS = 1024       # small: a long stream leaves no room for another long prompt


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def role_toml(mode: str, bootstrap_port: int) -> str:
    return f"""
[model]
path = "default"
[server]
port = 0
watchdog = false
drain_timeout_s = 1.0
[memory]
kv_cache_tokens = {4096 if mode == "prefill" else DECODE_SLOTS}
[disaggregation]
mode = "{mode}"
bootstrap_port = {bootstrap_port}
bootstrap_timeout_s = {PREFILL_TIMEOUT_S if mode == "prefill" else 2.0}
transfer_timeout_s = {DECODE_TIMEOUT_S if mode == "decode" else 5.0}
heartbeat_interval_s = 0.2
"""


class Pair:
    def __init__(self, tmp, bootstrap_port: int):
        self.bootstrap_port = bootstrap_port
        with ThreadPoolExecutor(2) as pool:  # both load the model at once
            prefill = pool.submit(Daemon, tmp / "prefill", role_toml("prefill", bootstrap_port))
            decode = pool.submit(Daemon, tmp / "decode", role_toml("decode", bootstrap_port))
            self.prefill, self.decode = prefill.result(), decode.result()
        port = free_port()
        self.gateway_log = open(tmp / "smg.log", "w")
        self.gateway = subprocess.Popen(
            ["smg", "launch", "--pd-disaggregation", "--prefill", self.prefill.url, str(bootstrap_port),
             "--decode", self.decode.url, "--host", "127.0.0.1", "--port", str(port), "--backend", "sglang",
             "--retry-max-retries", "40", "--retry-initial-backoff-ms", "100", "--retry-max-backoff-ms", "500", "--disable-circuit-breaker"],
            stdout=self.gateway_log, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{port}"
        for d in (self.prefill, self.decode):  # warm both up alone: the pair's first request is then no slower
            httpx.post(d.url + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 1}, timeout=60)
        deadline = time.monotonic() + 60
        while True:
            try:
                r = httpx.post(self.url + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 1},
                               timeout=30)
                if r.status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or self.gateway.poll() is not None:
                raise RuntimeError(f"smg did not come up:\n{(tmp / 'smg.log').read_text()[-3000:]}")
            time.sleep(0.3)

    def stop(self) -> None:
        self.gateway.kill()  # (its graceful shutdown waits out idle connections)
        self.gateway.wait(20)
        self.gateway_log.close()
        self.decode.stop()
        self.prefill.stop()


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pd")
    for d in ("prefill", "decode"):
        (tmp / d).mkdir()
    p = Pair(tmp, free_port())
    yield p
    p.stop()


def kv_of(url: str) -> dict:
    return httpx.get(url + "/server_info", timeout=10).json()["stats"]["kv"]


def assert_idle(*urls: str, timeout: float = 10.0) -> None:
    """Each pool back to idle: nothing locked, private or reserved, every slot accounted."""
    for url in urls:
        deadline = time.monotonic() + timeout
        while True:
            kv = kv_of(url)
            if kv["locked"] == 0 and kv["private"] == 0 and kv["reserved"] == 0:
                break
            assert time.monotonic() < deadline, f"{url}: not idle: {kv}"
            time.sleep(0.1)
        assert kv["free"] + kv["evictable"] == kv["total"], kv


def room() -> int:
    return random.getrandbits(63)


MESSAGES = [{"role": "user", "content": "Name three colours of the rainbow."}]
PROMPT = "The three primary colours are"


def test_outputs_equal_colocated(pair):
    """Chat, completions (the official client) and /generate, streamed and not, greedy."""
    pd = openai.OpenAI(base_url=pair.url + "/v1", api_key="x", max_retries=0)
    alone = openai.OpenAI(base_url=pair.prefill.url + "/v1", api_key="x", max_retries=0)
    kw = dict(model=MODEL, max_tokens=12, temperature=0)

    def chat(c, stream):
        if not stream:
            return c.chat.completions.create(messages=MESSAGES, **kw).choices[0].message.content
        return "".join(ch.choices[0].delta.content or "" for ch in
                       c.chat.completions.create(messages=MESSAGES, stream=True, **kw) if ch.choices)

    def completion(c, stream):
        if not stream:
            return c.completions.create(prompt=PROMPT, **kw).choices[0].text
        return "".join(ch.choices[0].text for ch in c.completions.create(prompt=PROMPT, stream=True, **kw)
                       if ch.choices)

    for stream in (False, True):
        want = chat(alone, stream)
        assert want and chat(pd, stream) == want
        want = completion(alone, stream)
        assert want and completion(pd, stream) == want

    body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 12, "temperature": 0}}
    want = httpx.post(pair.prefill.url + "/generate", json=body, timeout=60).json()
    got = httpx.post(pair.url + "/generate", json=body, timeout=60).json()
    assert got["text"] == want["text"] and got["output_ids"] == want["output_ids"]
    # the decode side computed the last prompt position only: the rest came from the prefill side
    assert got["meta_info"]["cached_tokens"] == got["meta_info"]["prompt_tokens"] - 1
    with httpx.stream("POST", pair.url + "/generate", json={**body, "stream": True}, timeout=60) as r:
        events = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
    assert events[-1]["text"] == want["text"]
    assert_idle(pair.prefill.url, pair.decode.url)
    m = httpx.get(pair.decode.url + "/metrics").text
    assert 'radixd_pd_role{role="decode"} 1.0' in m and 'radixd_pd_transfers_total{outcome="success"}' in m
    assert "radixd_pd_first_token_mismatches_total 0.0" in m
    assert "radixd_pd_transfer_bytes_total" in httpx.get(pair.prefill.url + "/metrics").text


def test_prefill_cache_serves_repeated_prefix(pair):
    system = "You are a terse assistant who answers in one short sentence. " * 4
    c = openai.OpenAI(base_url=pair.url + "/v1", api_key="x", max_retries=0)
    for q in ("What is two plus two?", "What colour is the sky?"):
        c.chat.completions.create(model=MODEL, max_tokens=4, temperature=0,
                                  messages=[{"role": "system", "content": system}, {"role": "user", "content": q}])
    prefill = [x for x in pair.prefill.log_lines() if x.get("event") == "access" and x.get("path") ==
               "/v1/chat/completions"]
    assert prefill[-1]["cached_tokens"] >= 40, prefill[-1]  # the shared system prompt
    assert_idle(pair.prefill.url, pair.decode.url)


def boot(pair, number: int) -> dict:
    return {"bootstrap_host": "127.0.0.1", "bootstrap_port": pair.bootstrap_port, "bootstrap_room": number}


def test_bad_bootstrap_fields(pair):
    for extra, field in (({"bootstrap_room": "seven"}, "bootstrap_room"), ({"bootstrap_host": 5}, "bootstrap_host"),
                         ({"bootstrap_port": -1}, "bootstrap_port")):
        r = httpx.post(pair.decode.url + "/v1/completions", timeout=30,
                       json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2, **boot(pair, 1), **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    r = httpx.post(pair.prefill.url + "/generate", timeout=30, json={
        "text": [PROMPT, PROMPT], "bootstrap_host": ["127.0.0.1"] * 2, "bootstrap_port": [1, 1], "bootstrap_room": [1, 2]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "bootstrap_host"
    assert_idle(pair.prefill.url, pair.decode.url)


def test_decode_gone(pair):
    """The prefill side computes, no decode instance asks: a clear error after its timeout."""
    t0 = time.monotonic()
    r = httpx.post(pair.prefill.url + "/v1/completions", timeout=30,
                   json={"model": MODEL, "prompt": PROMPT, "max_tokens": 4, **boot(pair, room())})
    assert r.status_code == 504 and "no decode instance asked" in r.json()["error"]["message"]
    assert r.json()["error"]["code"] == "kv_transfer_failed"
    assert time.monotonic() - t0 < PREFILL_TIMEOUT_S + 5
    assert_idle(pair.prefill.url)


def test_transfer_timeout(pair):
    """The decode side reserved KV for a room the prefill side never computes: 504 after its
    transfer timeout, the room aborted there, the reservation returned."""
    r = httpx.post(pair.decode.url + "/v1/completions", timeout=30,
                   json={"model": MODEL, "prompt": PROMPT, "max_tokens": 4, **boot(pair, room())})
    assert r.status_code == 504, r.text
    assert f"did not arrive within {DECODE_TIMEOUT_S} s" in r.json()["error"]["message"]
    assert_idle(pair.prefill.url, pair.decode.url)


@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_client_disconnects(pair, side):
    daemon = getattr(pair, side)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(daemon.url + "/v1/completions", timeout=httpx.Timeout(30, read=0.5),
                   json={"model": MODEL, "prompt": PROMPT, "max_tokens": 4, **boot(pair, room())})
    assert_idle(pair.prefill.url, pair.decode.url, timeout=1.0)  # before any timeout would have freed it

    def gone():
        return any(x.get("status") == 499 for x in daemon.log_lines() if x.get("event") == "access")

    deadline = time.monotonic() + 5
    while not gone():
        assert time.monotonic() < deadline, "no 499 logged"
        time.sleep(0.1)


def test_gateway_retries_while_decode_has_no_room(pair):
    """A long stream holds most of the decode pool (600 + 40 of 1024 slots): the next long
    prompt (511 tokens) gets 503 (no KV room; the prefill side's room aborted at once) and
    smg retries it until the stream has ended."""

    async def run():
        async with httpx.AsyncClient(timeout=60) as c:
            async with c.stream("POST", pair.url + "/v1/completions", json={
                    "model": MODEL, "prompt": PROMPT * 120, "max_tokens": 40, "temperature": 0,
                    "ignore_eos": True, "stream": True}) as blocker:
                lines = blocker.aiter_lines()
                while not (await anext(lines)).startswith("data: {"):
                    pass  # the blocker decodes on the decode side now
                second = await c.post(pair.url + "/v1/completions", json={
                    "model": MODEL, "prompt": "Tell me about the sea. " * 85, "max_tokens": 2, "temperature": 0})
                async for _ in lines:
                    pass
                return second

    r = asyncio.run(run())
    assert r.status_code == 200, r.text
    log = [x for x in pair.decode.log_lines() if x.get("event") == "access" and x.get("path") == "/v1/completions"]
    assert any(x["status"] == 503 and x["error_code"] == "kv_full" for x in log), [(x["status"], x["prompt_tokens"], x["duration_ms"], x["timestamp"]) for x in log[-4:]]
    assert_idle(pair.prefill.url, pair.decode.url)


def failed_transfers(url: str) -> float:
    line = [x for x in httpx.get(url + "/metrics").text.splitlines()
            if x.startswith('radixd_pd_transfers_total{outcome="failed"}')]
    return float(line[0].split()[-1]) if line else 0.0


def test_prefill_killed_mid_transfer(pair):
    """Last in this module: the prefill instance dies while the decode side waits for KV. The
    decode side ends the transfer at once and returns its slots, by whichever notices first:
    its report stream from the prefill instance breaks (a failure naming the prefill
    instance), or smg drops the request on seeing the prefill fail (the client gone); never by
    its timeout. (smg goes on retrying against the dead instance until its retries run out:
    not waited for.)"""
    before = [x for x in pair.decode.log_lines() if x.get("event") == "kv transfer failed"]
    failed = failed_transfers(pair.decode.url)

    async def run():
        async with httpx.AsyncClient(timeout=60) as c:
            req = asyncio.ensure_future(c.post(pair.url + "/v1/completions", json={
                "model": MODEL, "prompt": PROMPT * 40, "max_tokens": 4}))
            deadline = time.monotonic() + 20
            while "radixd_pd_waiting_for_kv 1.0" not in (await c.get(pair.decode.url + "/metrics")).text:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)
            pair.prefill.proc.kill()
            killed = time.monotonic()
            while True:  # nothing waits for a timeout: the decode pool is idle within seconds
                kv = (await c.get(pair.decode.url + "/server_info")).json()["stats"]["kv"]
                if kv["reserved"] == 0 and kv["private"] == 0 and kv["locked"] == 0:
                    break
                assert time.monotonic() - killed < 5, kv
                await asyncio.sleep(0.05)
            req.cancel()

    asyncio.run(run())
    assert_idle(pair.decode.url)
    assert failed_transfers(pair.decode.url) > failed  # (the transfer ended as failed, either way)
    new = [x for x in pair.decode.log_lines() if x.get("event") == "kv transfer failed"][len(before):]
    assert all("prefill instance" in x["error"] for x in new), new
