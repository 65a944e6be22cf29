"""Every hook of ``radixd.plugins.hookspecs`` is documented in docs/PLUGINS.md with its exact
arguments, and each one is exercised here with a registered plugin.

The server hooks run against the app built in-process (``build_app`` over a tiny engine,
driven through ``httpx.ASGITransport``). The daemon hooks (startup, shutdown, step stats)
are only called by ``radixd.server.daemon.Daemon``, so they run in a real ``radixd``
subprocess that finds a probe plugin through an entry point: a ``*.dist-info`` directory
with ``entry_points.txt`` next to the plugin module, on PYTHONPATH.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import os
import signal
import textwrap
from pathlib import Path

import httpx
import pytest
from conftest import Daemon
from starlette.responses import JSONResponse
from starlette.routing import Route

from radixd import Engine
from radixd.core.config import EngineConfig
from radixd.core.errors import ConfigError
from radixd.core.policy import PolicyContext
from radixd.core.sampling_params import SamplingParams
from radixd.core.tiers import CacheTier, Page
from radixd.plugins import hookimpl, hookspecs, make_plugin_manager
from radixd.plugins.policies import FCFS
from radixd.server.app import ServerState, build_app
from radixd.server.tool_parsing import CallForm, ToolParser
from radixd.settings import Settings, load_settings, settings_from_dict

DOC = Path(__file__).resolve().parent.parent / "docs" / "PLUGINS.md"
STEP_KEYS = {"batch_size", "prefill_tokens", "decode_tokens", "running", "waiting", "kv_usage", "step_ms", "idle_ms",
             "cycle_ms", "replica"}


def hook_specs() -> dict:
    """The hook specifications: functions of hookspecs carrying pluggy's ``radixd_spec`` mark."""
    return {name: f for name, f in vars(hookspecs).items()
            if inspect.isfunction(f) and hasattr(f, "radixd_spec")}


def test_every_hook_documented():
    specs = hook_specs()
    assert len(specs) >= 7, sorted(specs)  # the marker was found (a renamed project would find none)
    doc = DOC.read_text()
    for name, f in specs.items():
        sig = f"{name}({', '.join(inspect.signature(f).parameters)})"
        # the section's heading, then the signature alone in a code block
        assert f"### {name}\n\n```\n{sig}\n```\n" in doc, f"docs/PLUGINS.md has no section showing {sig}"
        assert callable(globals().get(f"test_hook_{name}")), f"tests/test_hooks.py has no test_hook_{name}"
    # the doc says that none is firstresult: a firstresult hook must change that sentence
    assert "None of these hooks is `firstresult`" in doc
    assert not any(f.radixd_spec.get("firstresult") for f in specs.values())
    # the stats keys the doc lists are the ones the spec promises
    for key in STEP_KEYS:
        assert key in hookspecs.radixd_step_stats.__doc__ and f"- `{key}`" in doc


# ------------------------------------------------------------------------ the app in-process


@contextlib.asynccontextmanager
async def served(tiny_models, *plugins, api_keys=(), settings: Settings | None = None):
    pm = make_plugin_manager(load_entry_points=False, extra=list(plugins))
    engine = Engine(model=str(tiny_models["llama"]), kv_cache_tokens=2048, plugin_manager=pm)
    try:
        state = ServerState(engine=engine, settings=settings or Settings(), model_name="tiny",
                            api_keys=list(api_keys), plugins=pm)
        app = build_app(state)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            client.app = app  # for tests that drive the ASGI app directly
            yield state, client
    finally:
        await engine.stop()


class RouteProbe:
    def __init__(self):
        self.states = []

    @hookimpl
    def radixd_routes(self, state):
        self.states.append(state)

        async def probe(request):
            st = request.app.state.radixd
            return JSONResponse({"probe": True, "model": st.model_name})

        return [Route("/probe", probe, methods=["GET", "POST"])]


async def test_hook_radixd_routes(tiny_models):
    plugin = RouteProbe()
    async with served(tiny_models, plugin) as (state, client):
        assert plugin.states == [state]  # called once, with the ServerState
        r = await client.get("/probe")
        assert r.status_code == 200 and r.json() == {"probe": True, "model": "tiny"}
        assert r.headers.get("x-request-id")  # through the gate like every route
        assert (await client.get("/v1/models")).status_code == 200  # built-ins still mounted

    plugin = RouteProbe()
    async with served(tiny_models, plugin, api_keys=["sekrit"]) as (state, client):
        assert len(plugin.states) == 1
        r = await client.get("/probe")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = await client.get("/probe", headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401
        r = await client.get("/probe", headers={"Authorization": "Bearer sekrit"})
        assert r.status_code == 200 and r.json()["probe"] is True
        # and the body limit
        big = b"x" * (state.settings.server.max_body_bytes + 1)
        r = await client.post("/probe", content=big, headers={"Authorization": "Bearer sekrit"})
        assert r.status_code == 413


class RequestProbe:
    def __init__(self):
        self.received = []
        self.finished = []

    @hookimpl
    def radixd_request_received(self, rid, route, prompt_tokens, params):
        self.received.append({"rid": rid, "route": route, "prompt_tokens": prompt_tokens, "params": params})

    @hookimpl
    def radixd_request_finished(self, rid, prompt_tokens, completion_tokens, cached_tokens, finish_reasons):
        self.finished.append({"rid": rid, "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                              "cached_tokens": cached_tokens, "finish_reasons": list(finish_reasons)})

    def clear(self):
        self.received.clear()
        self.finished.clear()


CHAT = {"messages": [{"role": "user", "content": "The capital of France is"}], "temperature": 0,
        "ignore_eos": True}


def sse_payloads(text: str) -> list[dict]:
    datas = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert datas and datas[-1] == "[DONE]", text[-500:]
    return [json.loads(d) for d in datas[:-1]]


async def test_hook_radixd_request_received(tiny_models):
    plugin = RequestProbe()
    async with served(tiny_models, plugin) as (state, client):
        r = await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 4, "n": 2, "seed": 3})
        assert r.status_code == 200
        body = r.json()
        assert len(plugin.received) == 1
        got = plugin.received[0]
        assert body["id"] == f"chatcmpl-{got['rid']}"
        assert got["route"] == "/v1/chat/completions"
        assert got["prompt_tokens"] == body["usage"]["prompt_tokens"] > 0
        assert isinstance(got["params"], SamplingParams)
        assert (got["params"].max_new_tokens, got["params"].n, got["params"].seed) == (4, 2, 3)

        plugin.clear()
        r = await client.post("/generate", json={"text": "hello world", "sampling_params": {"max_new_tokens": 3}})
        assert r.status_code == 200
        meta = r.json()["meta_info"]
        assert [(x["rid"], x["route"], x["prompt_tokens"]) for x in plugin.received] == [
            (meta["id"], "/generate", meta["prompt_tokens"])]

        plugin.clear()  # one call per prompt of a batched completion
        r = await client.post("/v1/completions", json={"prompt": [[5, 6, 7], [8, 9, 10, 11, 12]], "max_tokens": 2})
        assert r.status_code == 200
        assert [(x["route"], x["prompt_tokens"]) for x in plugin.received] == [
            ("/v1/completions", 3), ("/v1/completions", 5)]
        assert r.json()["id"] == f"cmpl-{plugin.received[0]['rid']}"

        plugin.clear()  # refused requests never reach the hook
        r = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 10**6})
        assert r.status_code == 400
        assert (await client.get("/health")).status_code == 200  # its probe generation neither
        assert plugin.received == [] and plugin.finished == []


async def test_hook_radixd_request_finished(tiny_models):
    plugin = RequestProbe()
    async with served(tiny_models, plugin) as (state, client):
        # non-streaming chat, twice: the second reads its prompt from the radix cache
        for _ in range(2):
            plugin.clear()
            r = await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 5})
            assert r.status_code == 200
            usage = r.json()["usage"]
            assert len(plugin.received) == 1 and len(plugin.finished) == 1
            fin = plugin.finished[0]
            assert fin["rid"] == plugin.received[0]["rid"]
            assert fin["prompt_tokens"] == usage["prompt_tokens"]
            assert fin["completion_tokens"] == usage["completion_tokens"] == 5
            assert fin["cached_tokens"] == usage["prompt_tokens_details"]["cached_tokens"]
            assert fin["finish_reasons"] == ["length"]
        assert fin["cached_tokens"] > 0  # the repeat hit the cache: the hook saw real numbers

        # streaming completion with usage
        plugin.clear()
        r = await client.post("/v1/completions", json={
            "prompt": "hello radix", "max_tokens": 4, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}})
        assert r.status_code == 200
        usage = sse_payloads(r.text)[-1]["usage"]
        assert len(plugin.finished) == 1
        fin = plugin.finished[0]
        assert fin["rid"] == plugin.received[0]["rid"]
        assert (fin["prompt_tokens"], fin["completion_tokens"], fin["cached_tokens"]) == (
            usage["prompt_tokens"], usage["completion_tokens"], usage["prompt_tokens_details"]["cached_tokens"])
        assert fin["finish_reasons"] == ["length"]

        # n samples: one finish reason each; a stop string ends one sample with "stop"
        plugin.clear()
        r = await client.post("/generate", json={"input_ids": [5, 6, 7], "sampling_params": {
            "max_new_tokens": 3, "n": 3, "temperature": 1.0, "seed": 1, "ignore_eos": True}})
        assert r.status_code == 200
        items = r.json()
        assert len(plugin.finished) == 1
        fin = plugin.finished[0]
        assert fin["completion_tokens"] == sum(i["meta_info"]["completion_tokens"] for i in items) == 9
        assert fin["finish_reasons"] == ["length"] * 3

        # a request refused before admission is not "finished" either
        plugin.clear()
        r = await client.post("/v1/chat/completions", json={**CHAT, "model": "other"})
        assert r.status_code == 404 and plugin.finished == []


async def test_request_finished_per_prompt_of_batched_completion(tiny_models):
    plugin = RequestProbe()
    async with served(tiny_models, plugin) as (state, client):
        r = await client.post("/v1/completions", json={"prompt": [[5, 6, 7], [8, 9, 10, 11, 12]], "max_tokens": 3,
                                                       "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200
        usage = r.json()["usage"]
        assert len(plugin.finished) == 2
        assert sum(f["prompt_tokens"] for f in plugin.finished) == usage["prompt_tokens"]
        assert sum(f["completion_tokens"] for f in plugin.finished) == usage["completion_tokens"]
        assert [f["finish_reasons"] for f in plugin.finished] == [["length"], ["length"]]


async def _call_and_disconnect(app, engine, plugin: RequestProbe, path: str, body: dict) -> None:
    """Drive the app over raw ASGI; the client goes away once 3 tokens were generated."""
    raw = json.dumps(body).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"host", b"t"), (b"content-type", b"application/json"),
                         (b"content-length", str(len(raw)).encode())],
             "client": ("127.0.0.1", 1), "server": ("t", 80)}
    gone = asyncio.Event()
    sent_body = False

    async def receive():
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        pass

    task = asyncio.ensure_future(app(scope, receive, send))
    async with asyncio.timeout(10):
        while not plugin.received:
            await asyncio.sleep(0.002)
        reqs = engine.outputs.by_rid[plugin.received[0]["rid"]]
        while len(reqs[0].output_ids) < 3:
            await asyncio.sleep(0.002)
        gone.set()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
async def test_request_finished_on_disconnect(tiny_models, stream):
    plugin = RequestProbe()
    async with served(tiny_models, plugin) as (state, client):
        await _call_and_disconnect(client.app, state.engine, plugin, "/v1/completions", {
            "prompt": "hello", "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": stream})
        await asyncio.sleep(0.05)
        assert state.engine.num_inflight == 0  # the abort itself works
        assert len(plugin.finished) == 1
        fin = plugin.finished[0]
        assert fin["rid"] == plugin.received[0]["rid"] and fin["completion_tokens"] < 400
        assert fin["finish_reasons"] == [None]


# ------------------------------------------------------------------------ scheduling policies


class CountingFCFS(FCFS):
    name = "hookprobe-fcfs"
    seen: list = []

    def order(self, waiting, ctx):
        type(self).seen.append((list(waiting), ctx))
        return super().order(waiting, ctx)


class PolicyProbe:
    calls = 0

    @hookimpl
    def radixd_schedule_policies(self):
        type(self).calls += 1
        return {"hookprobe-fcfs": CountingFCFS}


async def test_hook_radixd_schedule_policies(tiny_models):
    CountingFCFS.seen = []
    PolicyProbe.calls = 0
    pm = make_plugin_manager(load_entry_points=False, extra=[PolicyProbe()])
    engine = Engine(model=str(tiny_models["llama"]), kv_cache_tokens=512, plugin_manager=pm, policy="hookprobe-fcfs")
    try:
        assert PolicyProbe.calls == 1  # once, at construction
        assert isinstance(engine.policy, CountingFCFS) and isinstance(engine.policy.config, EngineConfig)
        outs = [o async for o in engine.generate(input_ids=[5, 6, 7], params=SamplingParams(max_new_tokens=2))]
        assert outs[-1].finished
        waiting, ctx = CountingFCFS.seen[0]
        assert [r.prompt_ids for r in waiting] == [[5, 6, 7]]
        assert isinstance(ctx, PolicyContext) and ctx.cache is engine.cache
    finally:
        await engine.stop()

    class Clash:
        @hookimpl
        def radixd_schedule_policies(self):
            return {"hookprobe-fcfs": FCFS}  # a different class under the same name

    pm = make_plugin_manager(load_entry_points=False, extra=[PolicyProbe(), Clash()])
    with pytest.raises(ValueError, match="hookprobe-fcfs"):
        Engine(model=str(tiny_models["llama"]), kv_cache_tokens=512, plugin_manager=pm)


class MemoTier(CacheTier):
    """A plugin tier: a dict, recording what the engine asked of it."""

    made: list = []

    def __init__(self, options, ctx):
        super().__init__(options, ctx)
        self.options, self.pages, self.calls = options, {}, []
        type(self).made.append(self)

    def store(self, key, page):
        self.calls.append("store")
        self.pages[key] = Page(page.host().clone())
        return True

    def contains(self, key):
        return key in self.pages

    def load(self, key):
        self.calls.append("load")
        return self.pages.get(key)

    def evict(self, key):
        self.pages.pop(key, None)


class TierProbe:
    calls = 0

    @hookimpl
    def radixd_cache_tiers(self):
        type(self).calls += 1
        return {"memo": MemoTier}


async def test_hook_radixd_cache_tiers(tiny_models):
    MemoTier.made = []
    TierProbe.calls = 0
    pm = make_plugin_manager(load_entry_points=False, extra=[TierProbe()])
    path = str(tiny_models["llama"])
    prompt = list(range(2, 70))
    params = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
    engine = Engine(model=path, kv_cache_tokens=256, plugin_manager=pm, cache_tiers=("memo",),
                    cache_write_policy="write_through", cache_page_tokens=8, cache_tier_options={"memo": {"x": 1}})
    try:
        assert TierProbe.calls == 1 and len(MemoTier.made) == 1
        tier = MemoTier.made[0]
        assert tier.options == {"x": 1} and tier.ctx.page_shape == (2, 2, 8, 2, 16)
        first = [t async for o in engine.generate(input_ids=prompt, params=params) for t in o.token_ids]
        engine.tiers.flush()  # a tier that is not `fast` is written by the write-behind thread
        assert "store" in tier.calls and len(tier.pages) == 8  # 70 tokens of KV: 8 whole pages
        assert engine.flush_cache()
        again = [t async for o in engine.generate(input_ids=prompt, params=params) for t in o.token_ids]
        assert "load" in tier.calls and again == first
        assert engine.stats()["cache_tiers"]["memo"]["tokens_loaded"] == 64
    finally:
        await engine.stop()



# ------------------------------------------------------------------------ the daemon's hooks

PROBE_PLUGIN = '''
"""Writes every daemon hook call it receives to $HOOKPROBE_OUT, one JSON line each."""
import json
import os

from radixd.plugins import hookimpl


def _write(event, **data):
    with open(os.environ["HOOKPROBE_OUT"], "a") as f:
        f.write(json.dumps({"event": event, **data}) + "\\n")


def _state(state):
    return {"type": type(state).__name__, "model": state.model_name, "draining": state.draining,
            "loop_running": state.engine.loop_running,
            "inflight": state.engine.num_inflight}


@hookimpl
async def radixd_startup(state):  # async: the daemon must await it, or nothing is written
    _write("startup", **_state(state))


@hookimpl
def radixd_shutdown(state):
    _write("shutdown", **_state(state))


@hookimpl
def radixd_step_stats(stats):
    _write("step", stats=stats)
'''


def read_events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture(scope="module")
def daemon_run(tiny_models, tmp_path_factory):
    """One daemon life with the probe plugin: start, two requests, SIGTERM. Returns what
    the plugin wrote, what it had written before the first request, and the responses."""
    tmp = tmp_path_factory.mktemp("hookprobe")
    site = tmp / "site"
    (site / "hookprobe-0.0.0.dist-info").mkdir(parents=True)
    (site / "hookprobe.py").write_text(textwrap.dedent(PROBE_PLUGIN))
    (site / "hookprobe-0.0.0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: hookprobe\nVersion: 0.0.0\n")
    (site / "hookprobe-0.0.0.dist-info" / "entry_points.txt").write_text("[radixd]\nhookprobe = hookprobe\n")
    out = tmp / "events.jsonl"
    toml = (f'[model]\npath = "{tiny_models["llama"]}"\n[server]\nport = 0\n[memory]\nkv_cache_tokens = 2048\n'
            '[scheduler]\nmax_running_requests = 4\n[plugins]\nallow = ["hookprobe"]\n')
    pythonpath = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
    d = Daemon(tmp, toml, env={"PYTHONPATH": pythonpath, "HOOKPROBE_OUT": str(out)})
    try:
        before = read_events(out)
        info = httpx.get(d.url + "/server_info", timeout=30).json()
        body = {"prompt": [5, 6, 7, 8], "max_tokens": 5, "temperature": 0, "ignore_eos": True}
        first = httpx.post(d.url + "/v1/completions", json=body, timeout=60).json()
        second = httpx.post(d.url + "/v1/completions", json=body, timeout=60).json()
        before_term = read_events(out)
        d.proc.send_signal(signal.SIGTERM)
        rc = d.proc.wait(60)
    finally:
        d.stop()
    return {"events": read_events(out), "before": before, "before_term": before_term, "rc": rc,
            "plugins": info["plugins"], "responses": [first, second]}


def test_hook_radixd_startup(daemon_run):
    assert "hookprobe" in daemon_run["plugins"]  # loaded through its entry point, allowed
    before = daemon_run["before"]
    # called exactly once, before the first request (the daemon was already listening)
    assert [e["event"] for e in before] == ["startup"]
    start = before[0]
    assert start["type"] == "ServerState" and start["model"] == "llama"
    assert start["loop_running"] is True and start["draining"] is False and start["inflight"] == 0
    assert [e["event"] for e in daemon_run["events"]].count("startup") == 1


def test_hook_radixd_shutdown(daemon_run):
    events = daemon_run["events"]
    assert "shutdown" not in [e["event"] for e in daemon_run["before_term"]]  # only after SIGTERM
    assert daemon_run["rc"] == 0
    assert [e["event"] for e in events].count("shutdown") == 1
    last = events[-1]
    assert last["event"] == "shutdown"  # after every step
    assert last["type"] == "ServerState" and last["draining"] is True and last["inflight"] == 0


def test_hook_radixd_step_stats(daemon_run):
    steps = [e["stats"] for e in daemon_run["events"] if e["event"] == "step"]
    usage = [r["usage"] for r in daemon_run["responses"]]
    assert [u["completion_tokens"] for u in usage] == [5, 5]
    # each request: one step that prefills (and samples the first token), 4 decode steps
    assert len(steps) == 10, steps
    for s in steps:
        assert STEP_KEYS - {"step_ms"} <= set(s), s
        assert s["batch_size"] == 1 and s["waiting"] == 0 and 0 <= s["running"] <= 1
        assert s["prefill_tokens"] + s["decode_tokens"] >= 1
        assert 0.0 < s["kv_usage"] <= 1.0
    first, second = steps[0], steps[5]
    assert (first["prefill_tokens"], first["decode_tokens"]) == (4, 0)  # the whole prompt, uncached
    # the repeat found 3 of its 4 prompt tokens cached: it computes 1 (counted as decode)
    assert usage[1]["prompt_tokens_details"]["cached_tokens"] == 3
    assert second["prefill_tokens"] + second["decode_tokens"] == 1
    assert all((s["prefill_tokens"], s["decode_tokens"]) == (0, 1) for s in steps[1:5] + steps[6:])
    assert steps[0]["running"] == 1 and steps[4]["running"] == 0  # the last step finished it
    kv = [s["kv_usage"] for s in steps[:5]]
    assert kv == sorted(kv)  # one more slot per step while the first request runs


def test_step_stats_step_ms(daemon_run):
    steps = [e["stats"] for e in daemon_run["events"] if e["event"] == "step"]
    assert steps and all(set(s) == STEP_KEYS for s in steps)
    assert all(0.0 < s["step_ms"] < 60_000 for s in steps)



# ------------------------------------------------------------------------ reasoning parsers


class _Tags:
    """``<<...>>`` reasoning; thinking unless the template's ``think`` is false."""

    start, end, implicit_ends = "<<", ">>", ()
    made = 0

    def __init__(self):
        _Tags.made += 1

    def thinks(self, template_kwargs):
        return template_kwargs.get("think", True)

    @classmethod
    def detect(cls, chat_template, generation_prompt):
        return False


class TagsProbe:
    @hookimpl
    def radixd_reasoning_parsers(self):
        return {"hookprobe-tags": _Tags}


async def test_hook_radixd_reasoning_parsers(tiny_models):
    from radixd.plugins import describe_plugins

    _Tags.made = 0
    settings = load_settings(None, {"model.reasoning_parser": "hookprobe-tags"})
    async with served(tiny_models, TagsProbe(), settings=settings) as (state, client):
        assert isinstance(state.reasoning, _Tags) and _Tags.made == 1
        body = {**CHAT, "max_tokens": 6}
        raw = (await client.post("/v1/chat/completions", json={**body, "separate_reasoning": False})).json()
        text = raw["choices"][0]["message"]["content"]
        assert text and "<<" not in text and ">>" not in text
        msg = (await client.post("/v1/chat/completions", json=body)).json()["choices"][0]["message"]
        assert msg["reasoning_content"] == text and msg["content"] is None  # thinking, never closed
        off = {**body, "chat_template_kwargs": {"think": False}}
        msg = (await client.post("/v1/chat/completions", json=off)).json()["choices"][0]["message"]
        assert msg["content"] == text and msg["reasoning_content"] is None
        provides = {name: what for name, _, what in describe_plugins(state.plugins)}
        assert any(p.get("reasoning parsers") == ["hookprobe-tags"] for p in provides.values())
    async with served(tiny_models) as (state, client):  # "auto": the tiny template has no markers
        assert state.reasoning is None
        msg = (await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 6})).json()["choices"][0]
        assert "reasoning_content" not in msg["message"]
    with pytest.raises(ConfigError, match="hookprobe-tags"):
        async with served(tiny_models, TagsProbe(), settings=load_settings(None, {"model.reasoning_parser": "x"})):
            pass


# ------------------------------------------------------------------------ grammar backends


class _EvenTokens:
    """A toy backend: only even token ids (and EOS) allowed; records its calls."""

    name = "hookprobe-even"
    made: list = []

    def __init__(self, config, *, tokenizer, vocab_size, eos_ids):
        type(self).made.append((config, vocab_size, tuple(eos_ids)))
        self.vocab_size, self.eos = vocab_size, tuple(eos_ids)
        self.compiled: list = []

    def compile(self, kind, spec):
        self.compiled.append((kind, spec))
        return self

    def matcher(self):
        return _EvenMatcher(self)


class _EvenMatcher:
    def __init__(self, b):
        self.b, self.seen = b, []

    def fill_mask(self, row):
        row[:] = False
        row[::2] = True
        row[list(self.b.eos)] = True

    def accept_token(self, token):
        self.seen.append(token)
        return token % 2 == 0 or token in self.b.eos

    def is_terminated(self):
        return len(self.seen) >= 3


class GrammarProbe:
    @hookimpl
    def radixd_grammar_backends(self):
        return {"hookprobe-even": _EvenTokens}


async def test_hook_radixd_grammar_backends(tiny_models):
    _EvenTokens.made = []
    pm = make_plugin_manager(load_entry_points=False, extra=[GrammarProbe()])
    engine = Engine(model=str(tiny_models["llama"]), kv_cache_tokens=512, plugin_manager=pm,
                    grammar_backend="hookprobe-even")
    try:
        assert len(_EvenTokens.made) == 1 and _EvenTokens.made[0][1] == engine.model_cfg.vocab_size
        params = SamplingParams(max_new_tokens=8, regex="anything", temperature=1.0, seed=3)
        outs = [o async for o in engine.generate("hello", params=params)]
        toks = [t for o in outs for t in o.token_ids]
        assert engine.grammars.backend.compiled == [("regex", "anything")]
        assert all(t % 2 == 0 or t in engine.eos_token_ids for t in toks), toks
        assert outs[-1].finished and len(toks) <= 3  # is_terminated() ended it
    finally:
        await engine.stop()
    with pytest.raises(ConfigError, match="grammar_backend"):
        Engine(model=str(tiny_models["llama"]), kv_cache_tokens=512, plugin_manager=pm, grammar_backend="nope")


class _AtParser(ToolParser):
    """Calls spelled ``@@name {...}``."""

    name = "hookprobe-at"
    markers = ("@@",)
    form = CallForm(begin="@@{name} ", end="", trigger="@@")

    def run(self, s):
        while True:
            marker = yield from s.text_until(("@@",))
            if marker is None:
                return
            region = s.pos - len(marker)
            name = yield from s.word()
            if not (s.known(name) and (yield from s.literal(" "))):
                s.as_text(region)
                continue
            yield from s.json_value(s.start_call(name))


class ToolParserProbe:
    @hookimpl
    def radixd_tool_parsers(self):
        return {"hookprobe-at": _AtParser}


async def test_hook_radixd_tool_parsers(tiny_models):
    pm = make_plugin_manager(load_entry_points=False, extra=[ToolParserProbe()])
    engine = Engine(model=str(tiny_models["llama"]), kv_cache_tokens=2048, plugin_manager=pm)
    engine.tokenizer.chat_template = ("{% if tools %}[{{ tools | map(attribute='function.name') | join(',') }}]"
                                      "{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}")
    settings = settings_from_dict({"model": {"tool_parser": "hookprobe-at"}})
    state = ServerState(engine=engine, settings=settings, model_name="tiny", api_keys=[], plugins=pm)
    assert state.tools.parser.name == "hookprobe-at" and state.tools.renders_tools
    tool = {"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"n": {"enum": [1, 2, 3]}}, "required": ["n"], "additionalProperties": False}}}
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(state)), base_url="http://t") as c:
            r = await c.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hello"}], "tools": [tool], "max_tokens": 24,
                "tool_choice": {"type": "function", "function": {"name": "pick"}}, "temperature": 0})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        (call,) = choice["message"]["tool_calls"]
        assert call["function"]["name"] == "pick" and json.loads(call["function"]["arguments"])["n"] in (1, 2, 3)
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    finally:
        await engine.stop()
    with pytest.raises(ConfigError, match="hookprobe-at"):
        ServerState(engine=engine, settings=settings, model_name="tiny", api_keys=[],
                    plugins=make_plugin_manager(load_entry_points=False))


class _MemmoveTransport:
    """A KV transfer backend for engines of one process: ``write`` is a ``memmove``."""

    sessions: dict[str, _MemmoveTransport] = {}
    writes = 0

    def __init__(self, hostname: str, options: dict):
        self.session_id = f"{hostname}:memmove-{len(self.sessions)}"
        self.sessions[self.session_id] = self
        self.buffers: list[tuple[int, int]] = []

    def register(self, buffers):
        self.buffers += buffers

    def write(self, peer, srcs, dsts, lens):
        import ctypes

        inside = lambda a, n, bufs: any(b <= a and a + n <= b + size for b, size in bufs)  # noqa: E731
        for s, d, n in zip(srcs, dsts, lens, strict=True):
            assert inside(s, n, self.buffers) and inside(d, n, self.sessions[peer].buffers)
            ctypes.memmove(d, s, n)
        type(self).writes += 1

    def close(self):
        self.buffers.clear()


class TransferProbe:
    @hookimpl
    def radixd_kv_transfer_backends(self):
        return {"hookprobe-memmove": _MemmoveTransport}


async def test_hook_radixd_kv_transfer_backends(tiny_models):
    """A prefill and a decode server in this process, the KV moved by the plugin's backend:
    the decode side computes one prompt position and answers as one engine alone."""
    import socket

    from radixd.server.disagg import Disagg

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    states = []
    for mode in ("prefill", "decode"):
        pm = make_plugin_manager(load_entry_points=False, extra=[TransferProbe()])
        engine = Engine(model=str(tiny_models["llama"]), kv_cache_tokens=1024, plugin_manager=pm)
        settings = settings_from_dict({"disaggregation": {"mode": mode, "bootstrap_port": port,
                                                          "transfer_backend": "hookprobe-memmove"}})
        st = ServerState(engine=engine, settings=settings, model_name="tiny", api_keys=[], plugins=pm)
        await engine.start()
        st.disagg = await Disagg.start(st, pm)
        states.append(st)
    body = {"model": "tiny", "prompt": "the quick brown fox jumps over", "max_tokens": 6, "temperature": 0}
    boot = {"bootstrap_host": "127.0.0.1", "bootstrap_port": port, "bootstrap_room": 7}
    try:
        clients = [httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(st)), base_url="http://t")
                   for st in states]
        alone = (await clients[0].post("/v1/completions", json=body)).json()
        prefill, decode = await asyncio.gather(*(c.post("/v1/completions", json={**body, **boot}) for c in clients))
        assert prefill.status_code == 200 and decode.status_code == 200, (prefill.text, decode.text)
        assert prefill.json()["usage"]["completion_tokens"] == 1
        assert decode.json()["choices"][0]["text"] == alone["choices"][0]["text"]
        usage = decode.json()["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1
        assert _MemmoveTransport.writes == 1
        async with httpx.AsyncClient() as c:  # the decode side gives room 9 up before its prefill request
            assert (await c.post(f"http://127.0.0.1:{port}/kv/abort", json={"bootstrap_room": 9})).json() == {
                "state": "failed"}
        r = await clients[0].post("/v1/completions", json={**body, **boot, "bootstrap_room": 9})
        assert r.status_code == 502 and "aborted by the decode instance" in r.json()["error"]["message"]
        for st in states:
            kv = st.engine.stats()["kv"]
            assert kv["locked"] == kv["private"] == kv["reserved"] == 0, kv
            st.engine.check_accounting()
        with pytest.raises(ConfigError, match="hookprobe-memmove"):  # a backend no plugin provides
            bad = ServerState(engine=states[1].engine, settings=states[1].settings, model_name="tiny", api_keys=[],
                              plugins=make_plugin_manager(load_entry_points=False))
            await Disagg.start(bad, bad.plugins)
    finally:
        for st in states:
            await st.disagg.stop()
            await st.engine.stop()


class RepeatLast:
    """Drafts the last token again (right only inside a run of one token), recording its calls."""

    name = "hookprobe-repeat"
    made: list = []

    def __init__(self, config, cache):
        self.config, self.cache, self.calls = config, cache, []
        type(self).made.append(self)

    def propose(self, reqs, ks):
        self.calls.append(([list(r.seq) for r in reqs], list(ks)))
        return [[r.seq[-1]] * k for r, k in zip(reqs, ks, strict=True)]


class DrafterProbe:
    @hookimpl
    def radixd_drafters(self):
        return {"hookprobe-repeat": RepeatLast}


async def test_hook_radixd_drafters(tiny_models):
    RepeatLast.made = []
    path, prompt = str(tiny_models["llama"]), [5, 6, 7, 7, 7]
    params = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
    plain = Engine(model=path, kv_cache_tokens=512, plugin_manager=make_plugin_manager(load_entry_points=False))
    try:
        want = [t for o in [o async for o in plain.generate(input_ids=prompt, params=params)] for t in o.token_ids]
    finally:
        await plain.stop()
    pm = make_plugin_manager(load_entry_points=False, extra=[DrafterProbe()])
    engine = Engine(model=path, kv_cache_tokens=512, plugin_manager=pm, speculative_algorithm="hookprobe-repeat",
                    speculative_num_draft_tokens=3)
    try:
        (drafter,) = RepeatLast.made  # one per replica
        assert isinstance(drafter.config, EngineConfig) and drafter.cache is engine.cache
        got = [t for o in [o async for o in engine.generate(input_ids=prompt, params=params)] for t in o.token_ids]
        assert got == want  # a drafter changes speed, never output
        seqs, ks = drafter.calls[0]
        assert seqs == [prompt + want[:1]] and ks == [3]  # after the prefill's pick, all tokens known
        assert engine.stats()["spec_verifies"] == len(drafter.calls)
    finally:
        await engine.stop()
    with pytest.raises(ConfigError, match="hookprobe-repeat"):
        Engine(model=path, kv_cache_tokens=512, plugin_manager=make_plugin_manager(load_entry_points=False),
               speculative_algorithm="hookprobe-repeat")
