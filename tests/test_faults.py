"""Faults against a real daemon on a tiny model: a stalled batching step and a hook that
blocks the event loop (watchdog pings stop, /health fails), clients that vanish or never
read, hostile bodies, and what the log may hold (never API keys; prompts only at debug)."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time

import httpx
import pytest
from conftest import Daemon, plugin_site
from test_daemon_lifecycle import GATE, NotifySocket

# Fault injection: a forward pass that hangs while $GATE_FLAG exists (the lifecycle tests'
# gate), and a step hook that blocks the event loop for the seconds written in $BLOCK_FLAG.
PROBE = GATE + '''

@hookimpl
def radixd_step_stats(stats):
    flag = os.environ["BLOCK_FLAG"]
    if os.path.exists(flag):
        seconds = float(open(flag).read())
        os.unlink(flag)
        time.sleep(seconds)
'''


def stats(url: str) -> dict:
    return httpx.get(url + "/server_info", headers=auth(), timeout=30).json()["stats"]


def wait_idle(url: str, timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        st = stats(url)
        kv = st["kv"]
        if (st["running"], st["waiting"], st["inflight"], kv["locked"], kv["private"]) == (0, 0, 0, 0, 0):
            assert kv["free"] + kv["evictable"] == kv["total"], kv
            return st
        assert time.monotonic() < deadline, st
        time.sleep(0.05)


def pings(ns: NotifySocket) -> int:
    return sum(m == "WATCHDOG=1" for m in ns.messages)


def test_stall_watchdog(tiny_models, tmp_path):
    site = plugin_site(tmp_path, "stallprobe", PROBE)
    stall, block = tmp_path / "stall.flag", tmp_path / "block.flag"
    ns = NotifySocket(tmp_path / "notify.sock")
    toml = (f'[model]\npath = "{tiny_models["llama"]}"\n[server]\nport = 0\nstall_timeout_s = 1.0\n'
            '[memory]\nkv_cache_tokens = 2048\n[plugins]\nallow = ["stallprobe"]\non_error = "disable"\n'
            'hook_timeout_s = 1.0\n')
    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p),
           "GATE_FLAG": str(stall), "BLOCK_FLAG": str(block), "NOTIFY_SOCKET": ns.path,
           "WATCHDOG_USEC": "400000"}  # WatchdogSec=0.4: a ping every 0.2 s
    d = Daemon(tmp_path, toml, env=env)
    body = {"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    try:
        ns.wait_for("READY=1")
        ns.wait_for("WATCHDOG=1")
        assert httpx.get(d.url + "/health").json()["status"] == "ok"

        # 1. a forward pass hangs (in the worker thread): /health says so, pings stop
        stall.touch()
        result: dict = {}
        t = threading.Thread(target=lambda: result.update(r=httpx.post(d.url + "/v1/completions", json=body,
                                                                        timeout=60)))
        t.start()
        time.sleep(1.6)
        r = httpx.get(d.url + "/health", timeout=5)
        assert r.status_code == 503 and r.json()["status"] == "stalled", r.text
        assert "stall_timeout_s" in r.json()["reason"]
        before = pings(ns)
        time.sleep(1.0)
        assert pings(ns) == before  # systemd would restart the service after WatchdogSec
        stall.unlink()
        t.join(30)
        assert result["r"].status_code == 200 and result["r"].json()["usage"]["completion_tokens"] == 4
        deadline = time.monotonic() + 5
        while pings(ns) == before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pings(ns) > before  # healthy again: pings resume
        assert httpx.get(d.url + "/health").status_code == 200

        # 2. a step hook blocks the event loop itself: nothing on the loop can answer, the
        # watchdog thread notices and the pings stop; the overrun hook's plugin is disabled
        block.write_text("2.0")
        r = httpx.post(d.url + "/v1/completions", json=body, timeout=60)  # its first step blocks
        assert r.status_code == 200
        ns.wait_for("WATCHDOG=1")
        lines = d.log_lines()
        stalled = [x for x in lines if x.get("event") == "batching loop stalled; watchdog pings stop"]
        assert any("event loop blocked" in x["reason"] and "stallprobe" in x["reason"]
                   and "radixd_step_stats" in x["reason"] for x in stalled), stalled
        assert any(x.get("event") == "plugin disabled" and x["plugin"] == "stallprobe" for x in lines)
        metrics = httpx.get(d.url + "/metrics").text
        assert 'radixd_plugin_faults_total{hook="radixd_step_stats",kind="timeout",plugin="stallprobe"} 1.0' in metrics
        wait_idle(d.url)
    finally:
        assert d.stop() == 0
        ns.close()


def test_stall_blocks_pings_for_the_whole_block(tiny_models, tmp_path):
    """Timing of the pings around a loop block: none while it lasts (more than the limit)."""
    site = plugin_site(tmp_path, "stallprobe", PROBE)
    block = tmp_path / "block.flag"
    ns = StampedNotifySocket(tmp_path / "notify.sock")
    toml = (f'[model]\npath = "{tiny_models["llama"]}"\n[server]\nport = 0\nstall_timeout_s = 0.5\n'
            '[memory]\nkv_cache_tokens = 2048\n[plugins]\nallow = ["stallprobe"]\nhook_timeout_s = 0.0\n')
    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p),
           "GATE_FLAG": str(tmp_path / "none"), "BLOCK_FLAG": str(block), "NOTIFY_SOCKET": ns.path,
           "WATCHDOG_USEC": "200000"}
    d = Daemon(tmp_path, toml, env=env)
    try:
        ns.wait_for("WATCHDOG=1")
        block.write_text("3.0")
        t0 = time.monotonic()
        r = httpx.post(d.url + "/v1/completions", json={"prompt": [5, 6], "max_tokens": 2}, timeout=60)
        assert r.status_code == 200 and time.monotonic() - t0 >= 3.0
        time.sleep(0.5)
        # the longest gap between pings covers the block, less the limit
        gaps = [b - a for a, b in zip(ns.stamps, ns.stamps[1:], strict=False)]
        assert max(gaps) >= 3.0 - 0.5 - 0.3, gaps
        assert sorted(gaps)[len(gaps) // 2] < 0.5  # otherwise a ping every 0.1 s or so
    finally:
        assert d.stop() == 0
        ns.close()


class StampedNotifySocket(NotifySocket):
    """Also records when each watchdog ping arrived."""

    def __init__(self, path):
        self.stamps: list[float] = []
        super().__init__(path)

    def _run(self):
        while not self._stop:
            try:
                message = self.sock.recv(4096).decode()
            except TimeoutError:
                continue
            except OSError:
                return
            if message == "WATCHDOG=1":
                self.stamps.append(time.monotonic())
            self.messages.append(message)


# ------------------------------------------------------------------------ clients


TOML = """
[model]
path = "{model}"
[server]
port = 0
send_timeout_s = 1.0
stream_buffer = 8
max_body_bytes = 65536
[memory]
kv_cache_tokens = 8192
[scheduler]
max_running_requests = 8
chunked_prefill_size = 32
[limits]
max_n = 16
[logging]
level = "info"
log_prompts = true
[auth]
api_keys = ["sk-secret-AAAA1111", "sk-secret-BBBB2222"]
"""
KEY = "sk-secret-AAAA1111"


@pytest.fixture(scope="module")
def daemon(tiny_models, tmp_path_factory):
    d = Daemon(tmp_path_factory.mktemp("faults"), TOML.format(model=tiny_models["llama"]))
    yield d
    assert d.stop() == 0


def auth(key: str = KEY) -> dict:
    return {"Authorization": f"Bearer {key}"}


def raw_request(path: str, body: bytes, *, headers: dict | None = None) -> bytes:
    head = [f"POST {path} HTTP/1.1", "Host: t", "Content-Type: application/json",
            f"Content-Length: {len(body)}", f"Authorization: Bearer {KEY}"]
    head += [f"{k}: {v}" for k, v in (headers or {}).items()]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def connect(url: str, rcvbuf: int | None = None) -> socket.socket:
    port = int(url.rsplit(":", 1)[1])
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.connect(("127.0.0.1", port))
    return s


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_disconnects_at_every_point(daemon):
    url = daemon.url
    base = wait_idle(url)
    fds = open_fds(daemon.proc.pid)
    long = json.dumps({"prompt": list(range(3, 400)), "max_tokens": 100, "ignore_eos": True,
                       "stream": True}).encode()
    full = raw_request("/v1/completions", long)
    cuts = [
        full[:10],                              # mid request line
        full[: full.index(b"\r\n\r\n") - 5],    # mid headers
        full[: full.index(b"\r\n\r\n") + 4],    # headers, no body
        full[:-20],                             # part of the body
        full,                                   # all of it, then gone during the prefill
    ]
    for cut in cuts:
        s = connect(url)
        s.sendall(cut)
        s.close()
    # mid-stream: read a few events, then leave
    s = connect(url)
    s.sendall(raw_request("/v1/completions", json.dumps({"prompt": [5, 6, 7], "max_tokens": 400,
                                                         "ignore_eos": True, "stream": True}).encode()))
    got = b""
    while got.count(b"data: ") < 3:
        got += s.recv(4096)
    s.close()
    st = wait_idle(url)
    # the prefill request was aborted: far fewer than its 100 tokens were decoded
    assert st["decode_tokens"] - base["decode_tokens"] < 100
    assert httpx.get(url + "/health").status_code == 200
    deadline = time.monotonic() + 10
    while open_fds(daemon.proc.pid) > fds and time.monotonic() < deadline:
        time.sleep(0.1)
    assert open_fds(daemon.proc.pid) <= fds


def test_slow_reader_is_aborted_and_freed(daemon):
    url = daemon.url
    wait_idle(url)
    fds = open_fds(daemon.proc.pid)
    before = httpx.get(url + "/metrics").text
    # ~9 MB of events (16 samples x 480 tokens x 20 top logprobs): more than the kernel's
    # socket buffers (up to 4 MiB each way on loopback) can hide
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 480, "n": 16, "logprobs": True,
            "top_logprobs": 20, "temperature": 1.0, "ignore_eos": True, "stream": True}
    s = connect(url, rcvbuf=4096)
    s.sendall(raw_request("/v1/chat/completions", json.dumps(body).encode()))
    # never read: the server must give up on its own, free the KV and close its side
    t0 = time.monotonic()
    st = wait_idle(url, timeout=60)
    freed_after = time.monotonic() - t0
    assert st["slow_consumer_aborts"] >= 1, (st, freed_after, daemon.log_path.read_text()[-3000:])
    assert st["decode_tokens"] < 16 * 480
    after = httpx.get(url + "/metrics").text
    assert _value(after, "radixd_slow_clients_total") == _value(before, "radixd_slow_clients_total") + 1
    assert freed_after < 30
    deadline = time.monotonic() + 20
    while open_fds(daemon.proc.pid) > fds and time.monotonic() < deadline:
        time.sleep(0.2)
    assert open_fds(daemon.proc.pid) <= fds, "the server kept the slow client's connection"
    s.close()
    assert httpx.get(url + "/health").status_code == 200


def _value(metrics: str, name: str) -> float:
    for line in metrics.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


@pytest.mark.parametrize("case", [
    "truncated", "invalid-utf8", "lone-surrogate", "nul-bytes", "deep-nesting", "huge-n", "huge-max-tokens",
    "huge-int", "many-stops", "long-stop", "nan", "huge-body-chunked", "wrong-content-type"])
def test_hostile_bodies(daemon, case):
    url = daemon.url
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    bodies = {
        "truncated": b'{"messages": [{"role": "user", "content": "hi',
        "invalid-utf8": b'{"prompt": "\xff\xfe\xfa", "max_tokens": 2}',
        "lone-surrogate": b'{"prompt": "a\\ud800b", "max_tokens": 2}',
        "nul-bytes": b'{"prompt": "a\\u0000b\x00", "max_tokens": 2}',
        "deep-nesting": b'{"a": ' + b"[" * 30000 + b"]" * 30000 + b"}",
        "huge-n": json.dumps({**chat, "n": 10**9}).encode(),
        "huge-max-tokens": json.dumps({**chat, "max_tokens": 10**18}).encode(),
        "huge-int": json.dumps({**chat, "seed": 10**40}).encode(),
        "many-stops": json.dumps({**chat, "stop": [f"s{i}" for i in range(5000)]}).encode(),
        "long-stop": json.dumps({**chat, "stop": ["x" * 60000]}).encode(),
        "nan": b'{"prompt": "hi", "max_tokens": 2, "temperature": NaN}',
        "huge-body-chunked": None,
        "wrong-content-type": json.dumps(chat).encode(),
    }
    path = "/v1/completions" if case in ("invalid-utf8", "lone-surrogate", "nul-bytes", "nan") else "/v1/chat/completions"
    headers = {**auth(), "content-type": "text/plain" if case == "wrong-content-type" else "application/json"}
    t0 = time.monotonic()
    if case == "huge-body-chunked":
        r = httpx.post(url + path, content=(b"x" * 8192 for _ in range(1000)), headers=headers, timeout=30)
    else:
        r = httpx.post(url + path, content=bodies[case], headers=headers, timeout=30)
    assert time.monotonic() - t0 < 10
    assert r.status_code < 500, r.text
    if r.status_code != 200:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
    expected = {"truncated": 400, "invalid-utf8": 400, "deep-nesting": 400, "huge-n": 400, "huge-max-tokens": 400,
                "huge-int": 400, "many-stops": 400, "huge-body-chunked": 413, "nan": 400, "lone-surrogate": 400}
    if case in expected:
        assert r.status_code == expected[case], r.text
    wait_idle(url)


def test_control_characters_in_stop_strings(daemon):
    url = daemon.url
    stops = ["\x00", "\n\n", "\x1b[31m", "\u2028", "\r", "\t\x07"]
    r = httpx.post(url + "/v1/completions", headers=auth(), timeout=60, json={
        "prompt": "hello", "max_tokens": 40, "temperature": 1.0, "seed": 1, "stop": stops})
    assert r.status_code == 200
    text = r.json()["choices"][0]["text"]
    assert not any(s in text for s in stops)
    wait_idle(url)


def test_keys_never_logged_prompts_only_at_debug(daemon):
    url = daemon.url
    quiet = "quiet-prompt-7731"
    loud = "loud-prompt-9947"
    r = httpx.post(url + "/v1/completions", headers=auth(), json={"prompt": quiet, "max_tokens": 2})
    assert r.status_code == 200
    httpx.post(url + "/v1/completions", headers=auth("sk-wrong-CCCC3333"), json={"prompt": "x", "max_tokens": 1})
    text = daemon.config.read_text().replace('level = "info"', 'level = "debug"')
    daemon.config.write_text(text)
    daemon.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while not any(x.get("event") == "reloaded" for x in daemon.log_lines()):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    r = httpx.post(url + "/v1/completions", headers={**auth("sk-secret-BBBB2222"), "x-request-id": "rq-loud-1"},
                   json={"prompt": loud, "max_tokens": 2})
    assert r.status_code == 200
    httpx.post(url + "/v1/chat/completions", headers=auth(), json={"messages": [{"role": "user", "content": loud}],
                                                                    "max_tokens": 1})
    log = daemon.log_path.read_text()
    for secret in ("sk-secret-AAAA1111", "sk-secret-BBBB2222", "sk-wrong-CCCC3333", "AAAA1111", "BBBB2222"):
        assert secret not in log
    assert quiet not in log  # level info: prompts are not logged
    prompts = [x for x in daemon.log_lines() if x.get("event") == "prompt"]
    assert any(x["id"] == "rq-loud-1" and x["prompt"] == loud and x["level"] == "debug" for x in prompts), prompts
    assert any(x["prompt"] == [{"role": "user", "content": loud}] for x in prompts)
    daemon.config.write_text(text.replace('level = "debug"', 'level = "info"'))
    daemon.proc.send_signal(signal.SIGHUP)
