"""The live dashboard over HTTP: off by default (404), the page, its SSE feed moving while a
shared-prefix workload runs, the API keys (header or ``?key=``), the tree summary's bound."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from conftest import Daemon

from radixd.core.kv_pool import SlotAllocator
from radixd.core.radix_cache import RadixCache
from radixd.server.dashboard import tree_summary

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
        r = httpx.post(daemon.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
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


def test_check_config_refuses_a_non_boolean(tmp_path):
    cfg = tmp_path / "radixd.toml"
    cfg.write_text('[server]\ndashboard = "yes"\n')
    r = subprocess.run([sys.executable, "-m", "radixd", "check-config", str(cfg)], capture_output=True, text=True)
    assert r.returncode == 2 and "server.dashboard" in r.stderr, r.stderr


def test_the_page_in_headless_chromium(daemon, tmp_path):
    """The page loads without console errors and its tree and pool move with the workload."""
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
            page.goto(daemon.url + f"/dashboard?key={KEY}")
            page.wait_for_function("window.radixdSnapshot !== undefined", timeout=15_000)
            assert page.text_content("#status") == "live"

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
            page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
        finally:
            browser.close()
    assert (tmp_path / "dashboard.png").stat().st_size > 10_000
    assert errors == []


def test_top_renders_the_feed_in_a_terminal(daemon):
    """``radixd top --once`` under a pseudo-terminal shows the figures of the feed."""
    import os
    import pty
    import re

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
