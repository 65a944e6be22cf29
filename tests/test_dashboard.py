"""The live dashboard over HTTP: off by default (404), the page, its SSE feed moving while a
shared-prefix workload runs (with each request's TTFT and the worker's idle time before each
step), the API keys (header or ``?key=``), the tree summary's bound and its reuse while the
radix cache is unchanged, one snapshot a tick for all viewers, a feed ending with its
viewer, one panel per replica with ``parallel.dp_size = 2``."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import random
import re
import shutil
import subprocess
import sys
import threading
import time
import types
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from conftest import Daemon

from radixd import top
from radixd.core.kv_pool import SlotAllocator
from radixd.core.radix_cache import RadixCache
from radixd.core.replica import StepStats
from radixd.core.scheduler_interface import ScheduledStep
from radixd.core.worker_clock import WorkerClock
from radixd.server import dashboard
from radixd.server.dashboard import Feed, tree_summary

KEY = "sk-dash-1234"
TOML = """[model]
path = "{model}"
[server]
port = 0
dashboard = {on}
[memory]
kv_cache_tokens = 4096
[auth]
api_keys = [{keys}]
"""
PREFIX = "You are a careful assistant. Answer every question briefly and well. "


@pytest.fixture(scope="module")
def daemon(tiny_models, tmp_path_factory):
    d = Daemon(tmp_path_factory.mktemp("dash"), TOML.format(model=tiny_models["llama"], on="true", keys=f'"{KEY}"'))
    yield d
    assert d.stop() == 0


def read_events(url: str, n: int, headers: dict | None = None, stop: threading.Event | None = None) -> list[dict]:
    """The first ``n`` snapshots of the feed (or those until ``stop`` is set)."""
    out = []
    with httpx.stream("GET", url, headers=headers, timeout=30) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                out.append(json.loads(line[6:]))
                if len(out) >= n or (stop is not None and stop.is_set()):
                    return out
    return out


def test_off_by_default_is_404(tiny_models, tmp_path):
    d = Daemon(tmp_path, TOML.format(model=tiny_models["llama"], on="false", keys=""))
    try:
        for path in ("/dashboard", "/dashboard/events"):
            r = httpx.get(d.url + path, timeout=10)
            assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    finally:
        assert d.stop() == 0


def test_keys_guard_the_page_and_the_feed(daemon):
    for path in ("/dashboard", "/dashboard/events"):
        r = httpx.get(daemon.url + path, timeout=10)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(daemon.url + path + "?key=wrong", timeout=10).status_code == 401
    r = httpx.get(daemon.url + "/dashboard", headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    page = httpx.get(daemon.url + f"/dashboard?key={KEY}", timeout=10)
    assert page.status_code == 200 and page.text == r.text
    assert "EventSource" in page.text and "http" not in page.text.replace('http-equiv', '')  # no fetches elsewhere
    assert read_events(daemon.url + f"/dashboard/events?key={KEY}", 1)[0]["replicas"]
    # the query key opens the dashboard's paths only
    assert httpx.get(daemon.url + f"/v1/models?key={KEY}", timeout=10).status_code == 401


def test_feed_moves_while_a_shared_prefix_workload_runs(daemon):
    first = read_events(daemon.url + f"/dashboard/events?key={KEY}", 1)[0]
    stop, seen = threading.Event(), []
    reader = threading.Thread(target=lambda: seen.extend(
        read_events(daemon.url + "/dashboard/events", 10_000, {"Authorization": f"Bearer {KEY}"}, stop)))
    reader.start()

    def ask(i: int) -> None:
        r = httpx.post(daemon.url + "/v1/completions", timeout=60,
                       headers={"Authorization": f"Bearer {KEY}", "X-Request-Id": f"dash-feed-{i}"},
                       json={"model": "llama", "prompt": PREFIX + f"Question {i}: what is {i} plus {i}?",
                             "max_tokens": 8 if i else 300, "ignore_eos": True, "temperature": 0})
        assert r.status_code == 200, r.text

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(ask, range(8)))
    last = read_events(daemon.url + f"/dashboard/events?key={KEY}", 1)[0]
    stop.set()
    reader.join(30)
    assert len(seen) >= 2
    t0, t1 = first["replicas"][0], last["replicas"][0]
    assert len(t1["tree"]["nodes"]) > len(t0["tree"]["nodes"])
    assert t1["tree"]["nodes"][0][3] > t0["tree"]["nodes"][0][3]  # tokens held by the tree
    assert t1["kv"]["evictable"] > t0["kv"]["evictable"] and t1["kv"]["free"] < t0["kv"]["free"]
    kv = t1["kv"]
    assert kv["free"] + kv["evictable"] + kv["locked"] + kv["private"] == kv["total"]
    # the shared prefix is one node with many hits, under which the questions branch
    assert max(n[4] for n in t1["tree"]["nodes"]) >= 4
    assert last["steps"] and {"prefill_tokens", "decode_tokens", "step_ms"} <= set(last["steps"][-1])
    assert last["stats"]["steps"] > first["stats"]["steps"]
    assert {"compiles", "hits", "cached"} <= set(last["grammar"]) and "cache_tiers" in last["stats"]
    running = [r for s in seen for r in s["replicas"][0]["running"]]  # the long request, seen mid-way
    assert any(0 < r["output_tokens"] < 300 and r["prompt_tokens"] > 20 for r in running)
    # each running request's TTFT is the one its access log line records; none before a token
    long = [(s, r) for s in seen for r in s["replicas"][0]["running"] if 8 < r["output_tokens"] < 300]
    assert long
    ttft = access_line(daemon, "dash-feed-0")["ttft_ms"]
    assert ttft > 0 and {r["ttft_ms"] for _, r in long} == {ttft}
    assert all(r["ttft_ms"] is None for s in seen for r in s["replicas"][0]["waiting"] if not r["output_tokens"])
    # the worker's idle gap before each step, within the time since the launch before
    steps = last["steps"]
    assert all(0 <= s["idle_ms"] <= s["cycle_ms"] and s["replica"] == 0 for s in steps)
    assert any(s["idle_ms"] > 0 for s in steps)
    share = sum(s["idle_ms"] for s in steps) / sum(s["cycle_ms"] for s in steps)
    assert last["idle_fraction"] == last["replicas"][0]["idle_fraction"] == pytest.approx(share, abs=1e-4)
    assert 0 < share < 1
    # radixd top renders the same figures (a snapshot with the long request running)
    snap, row = long[-1]
    text = rendered(snap)
    assert f"worker idle {100 * snap['idle_fraction']:.1f}%" in text, text
    assert f"{row['ttft_ms']:.1f}" in next(line for line in text.splitlines() if row["rid"][:24] in line)


def access_line(daemon: Daemon, rid: str) -> dict:
    """The access log's line of the request with ``X-Request-Id: rid`` (written as its response ends)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        lines = [x for x in daemon.log_lines() if x.get("event") == "access" and x.get("id") == rid]
        if lines:
            return lines[0]
        time.sleep(0.05)
    raise AssertionError(f"no access log line for {rid}")


def rendered(snap: dict) -> str:
    """``radixd top``'s rendering of a snapshot, as plain text."""
    from rich.console import Console

    console = Console(record=True, width=160, file=io.StringIO())
    console.print(top.render(snap))
    return console.export_text()


def test_worker_clock_notes_the_gap_before_each_launch(monkeypatch):
    """Idle: from the end of the worker's last call to a launch; the cycle: from the launch
    before (or the wake); nothing before the first wake."""
    now = iter([1.0, 1.5, 10.0, 10.25, 10.75, 11.0, 11.25, 20.0, 20.5, 21.0])
    monkeypatch.setattr("radixd.core.worker_clock.time", types.SimpleNamespace(monotonic=lambda: next(now)))
    clock, steps = WorkerClock(), [ScheduledStep(batch=None, reqs=[], sampled=[]) for _ in range(4)]
    assert clock.launch(steps[0], lambda x: x + 1, 1) == 2  # launch 1.0 - 1.5, before any wake
    clock.woke()                                            # 10.0 (work arrived after a rest)
    clock.launch(steps[1], lambda: None)                    # 10.25 - 10.75
    clock.resolve(lambda: None)                             # ends 11.0
    with pytest.raises(RuntimeError):                       # a failed launch ends a call too
        clock.launch(steps[2], _fail)                       # 11.25 - 20.0
    clock.launch(steps[3], lambda: None)                    # 20.5
    assert [(s.idle_ms, s.cycle_ms) for s in steps] == [(0.0, 0.0), (250.0, 250.0), (250.0, 1000.0), (500.0, 9250.0)]


def _fail() -> None:
    raise RuntimeError("forward pass failed")


def test_tree_summary_is_bounded_however_large_the_tree():
    alloc = SlotAllocator(20_001)
    cache = RadixCache(alloc)
    for i in range(2000):  # 2000 prompts over 40 shared prefixes: ~2040 nodes
        key = [1000 + i % 40] * 3 + [i + 5000, i + 7000]
        cache.insert(key, alloc.alloc(len(key)))
    s = tree_summary(cache, limit=50)
    assert len(s["nodes"]) == 50
    shown = sum(n[2] for n in s["nodes"])
    assert s["nodes"][0][3] == cache.total_size == shown + s["hidden"] == 40 * 3 + 2000 * 2
    assert s["complete"]
    ids = {n[0] for n in s["nodes"]}
    assert all(n[1] in ids for n in s["nodes"][1:])  # every parent is in the summary
    assert s["nodes"][1][3] >= s["nodes"][-1][3]  # the largest subtrees first
    small = tree_summary(cache, limit=50, walk=100)
    assert len(small["nodes"]) == 50 and not small["complete"]
    assert all(n[2] == 3 for n in small["nodes"][1:41])  # a cut walk still covers the top level


class CountedStep(StepStats):
    """A step that counts how often it is turned into a dict (once per encoding)."""

    __slots__ = ()
    encoded: list[int] = []

    def _asdict(self) -> dict:
        self.encoded.append(self.batch_size)
        return super()._asdict()


def test_feed_encodes_each_step_once(monkeypatch):
    """A snapshot re-sends the kept steps: each is encoded once, at the first snapshot after it,
    and the snapshot still holds the newest ``STEPS_KEPT`` in order, after the deque wraps too."""
    monkeypatch.setattr(dashboard, "INTERVAL_S", 0.0)  # every call builds a snapshot
    engine = types.SimpleNamespace(replicas=[], stats=dict, grammars=None)
    feed, kept = Feed(), dashboard.STEPS_KEPT
    CountedStep.encoded.clear()

    def step(i: int) -> CountedStep:  # idle and cycle times that vary, to the nanosecond
        return CountedStep(i, 0, i, 1, 0, 0.123456789, 10.0 + i / 7, 1.0 + (i % 5) / 3, 11.0 + (i % 3) / 7, 0)

    for i in range(kept + 40):
        feed.record(step(i))
    first = json.loads(feed.snapshot(engine))
    assert [s["batch_size"] for s in first["steps"]] == list(range(40, kept + 40))
    assert CountedStep.encoded == list(range(40, kept + 40))  # the dropped ones never
    for i in range(kept + 40, kept + 43):
        feed.record(step(i))
    second = json.loads(feed.snapshot(engine))
    assert [s["batch_size"] for s in second["steps"]] == list(range(43, kept + 43))
    assert CountedStep.encoded[kept:] == [kept + 40, kept + 41, kept + 42]  # only the new ones
    assert json.loads(feed.snapshot(engine))["steps"] == second["steps"]
    assert {"stats", "replicas", "time"} <= set(second)
    # times to the microsecond; the idle share is the kept steps' own (the dropped ones left the sums)
    kept = [step(i) for i in range(43, kept + 43)]
    us = [(round(s.idle_ms * 1000), round(s.cycle_ms * 1000)) for s in kept]
    assert [(s["idle_ms"], s["cycle_ms"]) for s in second["steps"]] == [(i / 1000, c / 1000) for i, c in us]
    assert second["steps"][0]["step_ms"] == round(kept[0].step_ms, 3) and second["steps"][0]["kv_usage"] == 0.1235
    assert second["idle_fraction"] == round(sum(i for i, _ in us) / sum(c for _, c in us), 4)
    assert second["idle_fraction"] != first["idle_fraction"]


def random_tree(rng: random.Random, prompts: int) -> tuple[SlotAllocator, RadixCache]:
    alloc = SlotAllocator(prompts * 40 + 10)
    cache = RadixCache(alloc)
    for _ in range(prompts):
        key = [rng.randrange(4) for _ in range(rng.randrange(1, 4))] + [rng.randrange(6) for _ in range(rng.randrange(30))]
        slots = alloc.alloc(len(key))
        if got := cache.insert(key, slots):
            alloc.free(slots[:got])
    return alloc, cache


def walk(node) -> list:
    """``node`` and everything under it, depth first."""
    out, stack = [], [node]
    while stack:
        out.append(stack.pop())
        stack.extend(out[-1].children.values())
    return out


def subtree_sizes(root) -> dict[int, int]:
    """Each node's tokens with everything under it, by ``id``, counted the plain way."""
    return {id(n): sum(len(m.key) for m in walk(n)) for n in walk(root)}


def test_tree_summary_shows_the_largest_subtrees_with_their_sizes():
    """Against a plain recursive count: every node shown has its true own and subtree tokens
    and its parent shown before it, and no node left out has a larger subtree than one shown."""
    rng = random.Random(0)
    for prompts in (0, 1, 3, 20, 150, 400):
        _, cache = random_tree(rng, prompts)
        sizes = subtree_sizes(cache.shared_root)
        total = sizes[id(cache.shared_root)]
        every = [n for n in walk(cache.shared_root) if n is not cache.shared_root]
        for limit in (200, 12, 2, 1):
            s = tree_summary(cache, limit=limit)
            nodes = s["nodes"]
            assert len(nodes) == min(limit, len(every) + 1) and s["complete"] and nodes[0][3] == total
            assert s["hidden"] == total - sum(n[2] for n in nodes)
            subtree = sorted((sizes[id(n)] for n in every), reverse=True)
            assert sorted((n[3] for n in nodes[1:]), reverse=True) == subtree[: len(nodes) - 1]
            assert [n[0] for n in nodes] == list(range(len(nodes)))
            assert all(n[1] < n[0] and nodes[n[1]][3] >= nodes[n[1]][2] + n[3] for n in nodes[1:])  # parents first


def test_radix_cache_version_moves_with_what_the_summary_shows():
    """Every change the tree summary shows moves the cache's version; reading does not."""
    alloc = SlotAllocator(200)
    cache = RadixCache(alloc)
    seen = [cache.version]

    def moved() -> bool:
        seen.append(cache.version)
        return seen[-1] != seen[-2]

    cache.insert([1, 2, 3, 4], alloc.alloc(4))
    assert moved()
    assert cache.peek_prefix_len([1, 2, 3, 4]) == 4 and cache.continuation([1, 2]) == [3, 4]
    cache.match_prefix([1, 2, 3, 4])  # no split
    assert not moved()
    m = cache.match_prefix([1, 2, 9])  # splits [1, 2, 3, 4] after 2
    assert moved()
    cache.lock(m.node)
    assert moved()
    cache.count_hit(m.node)
    assert moved() and m.node.hits == 1
    cache.unlock(m.node)
    assert moved()
    cache.mark_backed([m.node])
    assert moved() and m.node.backed
    assert cache.evict(10) == 4
    assert moved()


def test_feed_reuses_the_tree_summary_while_the_cache_is_unchanged(monkeypatch):
    monkeypatch.setattr(dashboard, "INTERVAL_S", 0.0)  # every call builds a snapshot
    alloc, cache = random_tree(random.Random(1), 30)
    sched = types.SimpleNamespace(waiting=[], running=[], accounting=lambda: {"total": 1})
    engine = types.SimpleNamespace(replicas=[types.SimpleNamespace(index=0, cache=cache, scheduler=sched)],
                                   stats=dict, grammars=None)
    feed = Feed()

    def tree() -> dict:
        return json.loads(feed.snapshot(engine))["replicas"][0]["tree"]

    first = tree()
    assert first == tree_summary(cache) and tree() == first and feed.tree_builds == 1 and feed.builds == 2
    node = cache.match_prefix([0]).node  # (a root child: every key starts with 0-3)
    cache.lock(node)
    locked = tree()
    assert feed.tree_builds == 2 and locked == tree_summary(cache) != first
    assert any(n[5] for n in locked["nodes"]) and not any(n[5] for n in first["nodes"])
    cache.unlock(node)
    cache.insert([7, 7, 7], alloc.alloc(3))
    assert tree() == tree_summary(cache) and tree()["nodes"][0][3] == first["nodes"][0][3] + 3
    assert feed.tree_builds == 3


def test_viewers_share_one_snapshot_a_tick(monkeypatch):
    """Two viewers, the second joining mid-interval: after its first snapshot it is on the
    first one's schedule, and each tick's snapshot is built once for both (the same bytes)."""
    monkeypatch.setattr(dashboard, "INTERVAL_S", 0.1)
    engine = types.SimpleNamespace(replicas=[], stats=dict, grammars=None)
    feed = Feed()
    got: dict[str, list[bytes]] = {"a": [], "b": []}

    async def read(name: str, delay: float, until: float) -> None:
        await asyncio.sleep(delay)
        async for ev in feed.stream(engine, lambda: time.monotonic() > until):
            got[name].append(ev)

    async def main() -> None:
        until = time.monotonic() + 1.5
        await asyncio.gather(read("a", 0.0, until), read("b", 0.06, until))

    asyncio.run(main())
    a, b = ([json.loads(ev[6:])["time"] for ev in got[k]] for k in "ab")
    assert len(a) >= 10 and len(b) >= 10
    assert set(b[1:]) <= set(a)  # b's later snapshots are a's
    assert feed.builds == len(set(a) | set(b)) <= len(a) + 1  # one build a tick (b's first its own)
    assert feed.viewers == 0 and json.loads(got["a"][-1][6:])["viewers"] == 2


def test_a_feed_ends_when_its_viewer_goes(daemon):
    """No polling for the disconnect: the stream of a viewer that left is cancelled, and the
    snapshots others read count it out."""
    url, headers = daemon.url + "/dashboard/events", {"Authorization": f"Bearer {KEY}"}
    stop, seen = threading.Event(), []

    def follow() -> None:  # each snapshot into ``seen`` as it comes
        with httpx.stream("GET", url, headers=headers, timeout=30) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    seen.append(json.loads(line[6:]))
                    if stop.is_set():
                        return

    reader = threading.Thread(target=follow)
    reader.start()
    try:
        deadline = time.monotonic() + 10
        while not (seen and seen[-1]["viewers"] == 1):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert read_events(url, 3, headers)[-1]["viewers"] == 2  # a second viewer, gone after three
        n = len(seen)
        while len(seen) < n + 4:
            assert time.monotonic() < deadline + 10
            time.sleep(0.05)
        assert any(s["viewers"] == 2 for s in seen) and seen[-1]["viewers"] == 1
    finally:
        stop.set()
        reader.join(30)


def test_check_config_refuses_a_non_boolean(tmp_path):
    cfg = tmp_path / "radixd.toml"
    cfg.write_text('[server]\ndashboard = "yes"\n')
    r = subprocess.run([sys.executable, "-m", "radixd", "check-config", str(cfg)], capture_output=True, text=True)
    assert r.returncode == 2 and "server.dashboard" in r.stderr, r.stderr


@contextlib.contextmanager
def dashboard_page(url: str):
    """The dashboard at ``url`` in headless Chromium, once its first snapshot is drawn: (the
    page, the console errors and page errors seen so far)."""
    sync_api = pytest.importorskip("playwright.sync_api")
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("no chromium on PATH")
    errors: list[str] = []
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1200, "height": 900})
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(url)
            page.wait_for_function("window.radixdSnapshot !== undefined", timeout=15_000)
            assert page.text_content("#status") == "live"
            yield page, errors
        finally:
            browser.close()


def test_the_page_in_headless_chromium(daemon, tmp_path):
    """The page loads without console errors, its tree and pool move with the workload, a
    running request's row shows its TTFT and the step timeline the worker's idle share."""
    with dashboard_page(daemon.url + f"/dashboard?key={KEY}") as (page, errors):

        def picture() -> tuple[str, str, str]:
            return (page.text_content("#rep0 .tree-note"), page.eval_on_selector("#rep0 .tree", "c => c.toDataURL()"),
                    page.eval_on_selector("#rep0 .pool", "c => c.toDataURL()"))

        before = picture()
        for i in range(4):
            r = httpx.post(daemon.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                           json={"model": "llama", "prompt": f"A new shared preamble for the browser. Item {i}",
                                 "max_tokens": 4, "temperature": 0})
            assert r.status_code == 200, r.text
        page.wait_for_function(f"document.querySelector('#rep0 .tree-note').textContent !== {json.dumps(before[0])}",
                               timeout=15_000)
        page.wait_for_timeout(600)  # a few more snapshots: the pool's history scrolls
        after = picture()
        assert after[0] != before[0] and after[1] != before[1] and after[2] != before[2]
        pool = ThreadPoolExecutor(1)
        long = pool.submit(httpx.post, daemon.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                           timeout=60, json={"model": "llama", "prompt": PREFIX + "A long answer for the browser",
                                             "max_tokens": 300, "ignore_eos": True})
        # the row and the snapshot it was drawn from, read together
        shown = page.wait_for_function("""() => {
            const s = window.radixdSnapshot, r = s.replicas[0].running.find(r => r.ttft_ms !== null);
            return r && {ttft: r.ttft_ms.toFixed(1), rid: r.rid.slice(0, 24), idle: s.idle_fraction,
                         table: document.querySelector('#rep0 .running').innerText,
                         steps: document.getElementById('steps-note').textContent,
                         replica: document.querySelector('#rep0 .rep-note').textContent};
        }""", timeout=15_000).json_value()
        page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
        assert long.result(60).status_code == 200
        pool.shutdown()
    row = next(line for line in shown["table"].splitlines() if line.startswith(shown["rid"]))
    assert "TTFT ms" in shown["table"] and shown["ttft"] in row.split()
    assert shows_idle(shown["steps"], shown["idle"]) and shows_idle(shown["replica"], shown["idle"])
    assert shown["replica"] == shown["steps"].split(",")[0]
    assert (tmp_path / "dashboard.png").stat().st_size > 10_000
    assert errors == []


def shows_idle(note: str, share: float) -> bool:
    """The page's "worker idle P% of its time" is ``share`` (JavaScript rounds half-way cases up,
    Python to even: compared within the rounding)."""
    m = re.match(r"worker idle (\d+\.\d)% of its time", note)
    return m is not None and abs(float(m.group(1)) - 100 * share) <= 0.05 + 1e-9


def test_top_renders_the_feed_in_a_terminal(daemon):
    """``radixd top --once`` under a pseudo-terminal shows the figures of the feed."""
    import os
    import pty

    for i in range(2):
        r = httpx.post(daemon.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                       json={"model": "llama", "prompt": PREFIX + f"In the terminal {i}", "max_tokens": 4})
        assert r.status_code == 200, r.text
    # the finished requests' pages reach the tree at a step boundary: wait for two equal snapshots
    snaps = read_events(daemon.url + f"/dashboard/events?key={KEY}", 2)
    while snaps[-1]["replicas"] != snaps[-2]["replicas"] or len(snaps[-1]["replicas"][0]["tree"]["nodes"]) < 2:
        assert len(snaps) < 40, "the daemon did not settle"
        snaps += read_events(daemon.url + f"/dashboard/events?key={KEY}", 1)
    snap = snaps[-1]
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "radixd", "top", "--url", daemon.url, "--once"], stdout=slave,
                            stderr=subprocess.PIPE, env={**os.environ, "RADIXD_API_KEY": KEY, "COLUMNS": "160"})
    os.close(slave)
    out = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # the child closed its end
            break
        if not chunk:
            break
        out += chunk
    os.close(master)
    assert proc.wait(30) == 0, proc.stderr.read()
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out.decode())
    kv, tree = snap["replicas"][0]["kv"], snap["replicas"][0]["tree"]["nodes"]
    assert f"free {kv['free']} · evictable {kv['evictable']}" in text, text
    assert f"radix cache: {tree[0][3]} tokens" in text and f"steps {snap['stats']['steps']}" in text
    biggest = max(tree[1:], key=lambda n: n[3])
    assert re.search(rf"\b{biggest[2]}\s+│?\s*{biggest[3]}\s+│?\s*{biggest[4]}\b", text), text
    # the worker's idle share, on the replica's line and the steps' line
    assert text.count(f"worker idle {100 * snap['idle_fraction']:.1f}%") == 2 and "TTFT ms" in text, text


DP_TOML = """[model]
path = "{model}"
[server]
port = 0
dashboard = true
[memory]
kv_cache_tokens = 1024
[parallel]
dp_size = 2
routing = "round_robin"
"""


def test_one_panel_per_replica_with_data_parallel(tiny_models, tmp_path):
    """``dp_size = 2``: the feed has each replica's pool, tree, queues and idle share, the
    page a panel of each with its own figures, ``radixd top`` a section of each."""
    d = Daemon(tmp_path, DP_TOML.format(model=tiny_models["llama"]))
    try:
        for i in range(2):  # one a replica
            r = httpx.post(d.url + "/v1/completions", timeout=60,
                           json={"model": "llama", "prompt": f"Replica number {i} gets this prompt", "max_tokens": 4})
            assert r.status_code == 200, r.text
        snap = read_events(d.url + "/dashboard/events", 1)[0]
        assert len(snap["replicas"]) == 2 and {s["replica"] for s in snap["steps"]} == {0, 1}
        for rep in snap["replicas"]:
            kv = rep["kv"]
            assert rep["tree"]["nodes"][0][3] > 0 and kv["free"] + kv["evictable"] + kv["locked"] + kv["private"] == kv["total"]
            assert 0 < rep["idle_fraction"] < 1
        with dashboard_page(d.url + "/dashboard") as (page, errors):
            shown = page.evaluate("""() => ({snap: window.radixdSnapshot,
                panels: [...document.querySelectorAll('#replicas > div')].map(el => ({id: el.id,
                    tree: el.querySelector('.tree-note').textContent, pool: el.querySelector('.pool-note').textContent,
                    note: el.querySelector('.rep-note').textContent}))})""")
        assert [p["id"] for p in shown["panels"]] == ["rep0", "rep1"]
        for p, rep in zip(shown["panels"], shown["snap"]["replicas"], strict=True):
            nodes, kv = rep["tree"]["nodes"], rep["kv"]
            assert p["tree"].startswith(f"{len(nodes) - 1} nodes shown, {nodes[0][3]} tokens") and nodes[0][3] > 0
            assert p["pool"].endswith(f"free {kv['free']} of {kv['total']}")
            assert shows_idle(p["note"], rep["idle_fraction"])
        assert errors == []
        text = rendered(snap)
        for i, rep in enumerate(snap["replicas"]):
            assert f"replica {i} KV: free {rep['kv']['free']}" in text, text
    finally:
        assert d.stop() == 0
