"""The daemon's life cycle on a tiny model: READY over $NOTIFY_SOCKET, SIGTERM drains
(streams complete or end with a final event, exit 0), SIGHUP reloads live keys, a client
that disconnects frees its KV, and a full queue answers 503 at once."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time

import httpx
from conftest import Daemon, assert_kv_idle, plugin_site


def toml(model, **over) -> str:
    server = {"port": 0, "drain_timeout_s": 30.0}
    server.update(over.pop("server", {}))
    limits = over.pop("limits", {})
    sched = {"max_running_requests": 4, **over.pop("scheduler", {})}

    def table(name, d):
        return f"[{name}]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in d.items())

    return (table("model", {"path": str(model), **over.pop("model_keys", {})}) + table("server", server) + table("memory", {"kv_cache_tokens": 4096})
            + table("scheduler", sched) + (table("limits", limits) if limits else ""))


class NotifySocket:
    """A stand-in for systemd's notify socket: collects the datagrams radixd sends."""

    def __init__(self, path):
        self.path = str(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.sock.settimeout(0.2)
        self.messages: list[str] = []
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop:
            try:
                self.messages.append(self.sock.recv(4096).decode())
            except TimeoutError:
                continue
            except OSError:
                return

    def wait_for(self, text: str, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(text in m for m in self.messages):
                return
            time.sleep(0.05)
        raise AssertionError(f"{text!r} not received; got {self.messages}")

    def close(self):
        self._stop = True
        self._thread.join()
        self.sock.close()


def stream_completion(url: str, max_tokens: int, out: dict, key: str = "events"):
    body = {"prompt": [5, 6, 7, 8], "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    events = out.setdefault(key, [])
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        out[key + "_status"] = r.status_code
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])


def wait_events(out: dict, n: int, key: str = "events", timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while len(out.get(key, [])) < n:
        assert out.get(key + "_status", 200) == 200, out
        assert time.monotonic() < deadline, out
        time.sleep(0.01)


def kv(url: str) -> dict:
    return httpx.get(url + "/server_info").json()["stats"]


def test_ready_and_sigterm_drain(tiny_models, tmp_path):
    ns = NotifySocket(tmp_path / "notify.sock")
    d = Daemon(tmp_path, toml(tiny_models["llama"]), env={"NOTIFY_SOCKET": ns.path})
    try:
        ns.wait_for("READY=1")
        assert httpx.get(d.url + "/health").status_code == 200
        out: dict = {}
        t = threading.Thread(target=stream_completion, args=(d.url, 300, out))
        t.start()
        wait_events(out, 3)
        d.proc.send_signal(signal.SIGTERM)
        ns.wait_for("STOPPING=1")
        t.join(60)
        assert d.proc.wait(60) == 0
        events = out["events"]
        assert events[-1] == "[DONE]"
        final = json.loads(events[-2])["choices"][0]
        assert final["finish_reason"] == "length"  # the in-flight stream ran to completion
        texts = sum(1 for e in events[:-1] if json.loads(e)["choices"][0]["text"] is not None)
        assert texts >= 300 - 1
        assert any(x.get("event") == "draining" for x in d.log_lines())
    finally:
        d.stop()
        ns.close()


def test_drain_timeout_ends_streams_with_final_event(tiny_models, tmp_path):
    d = Daemon(tmp_path, toml(tiny_models["llama"], server={"drain_timeout_s": 0.0}))
    try:
        out: dict = {}
        t = threading.Thread(target=stream_completion, args=(d.url, 500, out))
        t.start()
        wait_events(out, 3)
        d.proc.send_signal(signal.SIGTERM)
        t.join(60)
        assert d.proc.wait(60) == 0
        events = out["events"]
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["choices"][0]["finish_reason"] == "abort"
        # new requests during the drain were refused (checked in the log: no crash, exit 0)
    finally:
        d.stop()


GATE = '''
"""Each forward pass waits while $GATE_FLAG exists: the test holds the running request there."""
import os
import time

from radixd.plugins import hookimpl


@hookimpl
def radixd_startup(state):
    worker = state.engine.worker
    launch = worker.launch

    def gated_launch(batch, prev):
        while os.path.exists(os.environ["GATE_FLAG"]):
            time.sleep(0.01)
        return launch(batch, prev)

    worker.launch = gated_launch
'''


def test_queue_full_is_refused_at_once(tiny_models, tmp_path):
    # the running stream is held in its forward pass (a gate plugin) until the check is done,
    # however fast the model and the machine; the queued one is served once it may run
    site = plugin_site(tmp_path, "gateprobe", GATE)
    gate = tmp_path / "gate.flag"
    gate.touch()
    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p),
           "GATE_FLAG": str(gate)}
    d = Daemon(tmp_path, toml(tiny_models["llama"], scheduler={"max_running_requests": 1},
                              limits={"max_queued_requests": 1}) + '[plugins]\nallow = ["gateprobe"]\n', env=env)
    try:
        out: dict = {}
        threads = [threading.Thread(target=stream_completion, args=(d.url, n, out, f"s{i}")) for i, n in enumerate((200, 16))]
        for t in threads:
            t.start()
            time.sleep(0.3)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (kv(d.url)["running"], kv(d.url)["waiting"]) != (1, 1):
            time.sleep(0.02)
        assert (kv(d.url)["running"], kv(d.url)["waiting"]) == (1, 1)  # (held there by the gate)
        t0 = time.monotonic()
        r = httpx.post(d.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert time.monotonic() - t0 < 2
        assert r.status_code == 503 and r.json()["error"]["code"] == "queue_full"
        gate.unlink()
        for t in threads:
            t.join(120)
        assert out["s0"][-1] == "[DONE]" and out["s1"][-1] == "[DONE]"
        with httpx.Client(base_url=d.url) as http:
            assert_kv_idle(http)
    finally:
        gate.unlink(missing_ok=True)
        assert d.stop() == 0


def test_sighup_reloads_live_keys(tiny_models, tmp_path):
    d = Daemon(tmp_path, toml(tiny_models["llama"], limits={"default_max_tokens": 3}))
    try:
        r = httpx.post(d.url + "/v1/completions", json={"prompt": [5, 6], "temperature": 0, "ignore_eos": True})
        assert r.json()["usage"]["completion_tokens"] == 3
        d.config.write_text(toml(tiny_models["llama"], limits={"default_max_tokens": 5}, scheduler={"max_running_requests": 2}))
        d.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not any(x.get("event") == "reloaded" for x in d.log_lines()):
            time.sleep(0.05)
        reloaded = [x for x in d.log_lines() if x.get("event") == "reloaded"]
        assert reloaded and reloaded[0]["needs_restart"] == ["scheduler.max_running_requests"]
        r = httpx.post(d.url + "/v1/completions", json={"prompt": [5, 6], "temperature": 0, "ignore_eos": True})
        assert r.json()["usage"]["completion_tokens"] == 5
        # an invalid file is refused and the running configuration kept
        d.config.write_text("[limits]\ndefault_max_tokens = -4\n")
        d.proc.send_signal(signal.SIGHUP)
        time.sleep(0.5)
        r = httpx.post(d.url + "/v1/completions", json={"prompt": [5, 6], "temperature": 0, "ignore_eos": True})
        assert r.json()["usage"]["completion_tokens"] == 5
        assert any(x.get("event", "").startswith("reload refused") for x in d.log_lines())
    finally:
        assert d.stop() == 0


def test_bad_config_exits_2(tmp_path):
    import subprocess
    import sys

    bad = tmp_path / "bad.toml"
    bad.write_text("[scheduler]\nmax_running_requests = 0\n")
    r = subprocess.run([sys.executable, "-m", "radixd", "--config", str(bad)], capture_output=True, text=True)
    assert r.returncode == 2
    assert "scheduler.max_running_requests" in r.stderr and "0" in r.stderr and ">= 1" in r.stderr
    bad.write_text("[nonsense]\nx = 1\n")
    r = subprocess.run([sys.executable, "-m", "radixd", "check-config", str(bad)], capture_output=True, text=True)
    assert r.returncode == 2 and "nonsense" in r.stderr
