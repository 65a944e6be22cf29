"""``radixd bench``: run against a real daemon (default model, loopback), the in-process
engine and the transformers peer (tiny models), and check that the JSON report's figures
are consistent with its per-request records and with what the server reported."""

from __future__ import annotations

import asyncio
import json
import math
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import Daemon

from radixd.cli import main as radixd_main

TOML = """
[server]
port = 0
[model]
max_context_len = 2048
[memory]
kv_cache_tokens = 16384
"""

# a server that refuses: one request running, one queued, the rest get 503 at once
TOML_REFUSING = """
[server]
port = 0
[model]
max_context_len = 1024
[memory]
kv_cache_tokens = 4096
[scheduler]
max_running_requests = 1
[limits]
max_queued_requests = 1
"""

SUMMARIES = ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms")


def bench(tmp_path: Path, *argv: str, name: str = "run") -> tuple[int, dict]:
    out = tmp_path / f"{name}.json"
    rc = radixd_main(["bench", *argv, "--output", str(out), "--no-progress"])
    return rc, (json.loads(out.read_text()) if out.exists() else {})


def check_consistent(doc: dict, *, exact_output: bool = True) -> None:
    """Figures against records, for every run of a report."""
    for run in doc["runs"]:
        f, recs = run["figures"], run["records"]
        ok = [r for r in recs if r["ok"]]
        assert f["requests"] == len(recs) and f["completed"] == len(ok) and f["failed"] == len(recs) - len(ok)
        assert f["errors"]["count"] == f["failed"]
        # tokens counted == tokens received == what the server says it sent
        assert f["output_tokens"] == sum(r["output_tokens"] for r in ok)
        for r in ok:
            assert r["chunks"] == r["output_tokens"], r      # radixd streams one event per token
            if r["usage_completion_tokens"] is not None:
                assert r["output_tokens"] == r["usage_completion_tokens"], r
            if r["output_ids"] is not None:
                assert len(r["output_ids"]) == r["output_tokens"]
            if exact_output:                                 # ignore_eos: exactly max_tokens
                assert r["output_tokens"] == r["max_tokens"], r
            assert len(r["itl_ms"]) == r["output_tokens"] - 1
            assert 0 < r["ttft_ms"] <= r["e2e_ms"]
        if f["usage_completion_tokens"] is not None:
            assert f["usage_completion_tokens"] == f["output_tokens"]
        if f["input_tokens_source"] == "server usage":
            assert f["input_tokens"] == sum(r["usage_prompt_tokens"] for r in ok)
        d = f["duration_s"]
        assert d >= max(r["start_ms"] + r["e2e_ms"] for r in ok) / 1000 - 0.05
        assert math.isclose(f["output_token_throughput"] * d, f["output_tokens"], rel_tol=1e-9)
        assert math.isclose(f["total_token_throughput"] * d, f["input_tokens"] + f["output_tokens"], rel_tol=1e-9)
        assert math.isclose(f["request_throughput"] * d, len(ok), rel_tol=1e-9)
        for key in SUMMARIES:
            s = f[key]
            assert s is not None, key
            assert s["min"] <= s["median"] <= s["p90"] <= s["p95"] <= s["p99"] <= s["max"], (key, s)
            assert s["min"] <= s["mean"] <= s["max"], (key, s)
        assert f["ttft_ms"]["count"] == len(ok) and f["itl_ms"]["count"] == sum(len(r["itl_ms"]) for r in ok)
        g = f["client_gc"]  # the client's own collections while the run was timed
        assert g["collections"] >= g["full_collections"] >= 0 and 0 <= g["max_pause_seconds"] <= g["pause_seconds"]
        if f["cache_hit_rate"] is not None:
            assert 0.0 <= f["cache_hit_rate"] <= 1.0
            assert f["cache"]["cached_tokens"] <= f["cache"]["prompt_tokens"]
    assert doc["figures"] == doc["runs"][-1]["figures"]


def max_in_flight(records: list[dict]) -> int:
    """Most requests in flight at once, from their send times and latencies."""
    return max(sum(1 for r in records if r["start_ms"] <= t < r["start_ms"] + r["e2e_ms"])
               for t in (x["start_ms"] for x in records))


def is_png(path: Path) -> bool:
    return path.exists() and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000


# ------------------------------------------------------------------------ a real daemon


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = Daemon(tmp_path_factory.mktemp("bench-daemon"), TOML)
    yield d
    assert d.stop() == 0


SHARED = ["--workload", "shared-prefix", "--groups", "4", "--prompts-per-group", "4", "--system-len", "256",
          "--question-len", "16", "--output-len", "16"]


@pytest.mark.slow
def test_shared_prefix_native(daemon, tmp_path):
    rc, doc = bench(tmp_path, "--url", daemon.url, "--api", "native", *SHARED, "--plot-dir", str(tmp_path))
    assert rc == 0
    f = doc["figures"]
    assert f["completed"] == 16 and f["failed"] == 0
    check_consistent(doc)
    # the radix cache: high on shared prefixes, never above what sharing allows
    theo = doc["workload"]["theoretical_max_hit_rate"]
    assert f["cache"]["source"] == "server /metrics"
    assert 0.5 < f["cache_hit_rate"] <= theo + 1e-9
    assert f["cache_hit_rate"] == pytest.approx(f["cache_hit_rate_usage"])  # /metrics == per-request usage
    assert f["cache"]["prompt_tokens"] == f["input_tokens"] == 16 * (256 + 16)
    # the exact configuration and the per-request records are in the report
    assert doc["config"]["groups"] == 4 and doc["config"]["system_len"] == 256 and doc["config"]["api"] == "native"
    assert len(doc["runs"][0]["records"]) == 16
    assert sorted({r["group"] for r in doc["runs"][0]["records"]}) == [0, 1, 2, 3]
    assert doc["target"]["server_info"]["model"] == "SmolLM2-135M-Instruct"
    assert is_png(tmp_path / "http-shared-prefix_latency_cdf.png")


@pytest.mark.slow
def test_random_completions_sweep_flushes_between_runs(daemon, tmp_path):
    rc, doc = bench(tmp_path, "--url", daemon.url, "--api", "completions", "--workload", "random",
                    "--num-prompts", "8", "--input-len", "64:128", "--output-len", "8:12",
                    "--sweep-concurrency", "2,8", "--plot-dir", str(tmp_path), "--name", "sweep")
    assert rc == 0
    check_consistent(doc)
    assert [r["max_concurrency"] for r in doc["runs"]] == [2, 8]
    for run in doc["runs"]:
        assert run["figures"]["completed"] == 8
        assert run["cache_flushed"] is True
        # random prompts share nothing, and the second run does not reuse the first's cache
        assert run["figures"]["cache_hit_rate"] < 0.1
    # the bound held: never more than 2 in flight; without it (8 >= all), all were sent at once
    bounded, unbounded = (run["records"] for run in doc["runs"])
    assert max_in_flight(bounded) == 2 and doc["runs"][0]["figures"]["concurrency"] <= 2 + 1e-6
    assert max_in_flight(unbounded) == 8 and max(r["start_ms"] for r in unbounded) < 1000
    lens = [r["max_tokens"] for r in doc["runs"][0]["records"]]
    assert min(lens) >= 8 and max(lens) <= 12
    for suffix in ("latency_cdf", "sweep_throughput", "sweep_ttft_p99"):
        assert is_png(tmp_path / f"sweep_{suffix}.png"), suffix


@pytest.mark.slow
def test_multi_turn_chat_resends_history(daemon, tmp_path):
    rc, doc = bench(tmp_path, "--url", daemon.url, "--api", "chat", "--workload", "multi-turn",
                    "--conversations", "3", "--turns", "3", "--turn-len", "24", "--output-len", "6")
    assert rc == 0
    check_consistent(doc)
    recs = doc["runs"][0]["records"]
    assert len(recs) == 9
    by_conv: dict[int, list[dict]] = {}
    for r in recs:
        by_conv.setdefault(r["session"], []).append(r)
    for turns in by_conv.values():
        turns.sort(key=lambda r: r["turn"])
        assert [r["turn"] for r in turns] == [0, 1, 2]
        prompts = [r["usage_prompt_tokens"] for r in turns]
        assert prompts[0] < prompts[1] < prompts[2]      # each turn carries the history
        assert turns[0]["usage_cached_tokens"] < turns[2]["usage_cached_tokens"]
    assert doc["figures"]["cache_hit_rate"] > 0.3


@pytest.mark.slow
def test_refusing_server_counts_errors(tmp_path):
    d = Daemon(tmp_path, TOML_REFUSING)
    try:
        rc, doc = bench(tmp_path, "--url", d.url, "--workload", "random", "--num-prompts", "12",
                        "--input-len", "32", "--output-len", "8", "--warmup", "0")
    finally:
        assert d.stop() == 0
    assert rc == 0
    f = doc["figures"]
    assert f["requests"] == 12 and f["failed"] > 0 and f["completed"] > 0
    assert f["errors"]["by_status"].get("503") == f["failed"]
    assert any("overloaded" in m for m in f["errors"]["first"])
    check_consistent(doc)


async def test_a_stream_cut_mid_way_is_a_failed_record_not_a_crash():
    """A server that sends one event and drops the connection, one that closes before its
    headers, and one that ends the stream without ``[DONE]``: each request is a failed record
    saying so, and the target stays usable."""
    from radixd.bench.targets import HttpTarget
    from radixd.bench.workloads import RequestSpec

    event = b'data: {"choices": [{"index": 0, "text": "a", "finish_reason": null}]}\n\n'
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"

    def chunk(b: bytes) -> bytes:
        return b"%x\r\n%s\r\n" % (len(b), b)

    async def serve(reader, writer):
        line = await reader.readline()
        while (await reader.readline()) not in (b"\r\n", b""):
            pass  # (the bodies are small: the server need not read them to answer)
        if line.startswith(b"GET /v1/models"):
            body = b'{"data": [{"id": "m"}]}'
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        elif b"cut" in line:
            writer.write(head + chunk(event))  # then the connection goes, no last chunk
        elif b"ended" in line:
            writer.write(head + chunk(event) + b"0\r\n\r\n")  # a clean end, but no [DONE]
        await writer.drain()
        writer.close()  # (also for /before: no response at all)

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    target = HttpTarget(f"http://127.0.0.1:{port}", "completions")
    try:
        assert (await target.start())["model"] == "m"
        spec = RequestSpec(input_ids=[1, 2, 3], messages=[], output_len=4)
        got = {}
        for path in ("/cut", "/before", "/ended"):
            target._body = lambda spec, ignore_eos, path=path: (path, {"prompt": [1]})
            got[path] = await target.request(spec)
    finally:
        await target.close()
        server.close()
        await server.wait_closed()
    assert not any(r.ok for r in got.values())
    assert got["/cut"].chunks == 1 and got["/cut"].error.startswith("ClientPayloadError"), got["/cut"].error
    assert got["/before"].chunks == 0 and got["/before"].error.startswith("ServerDisconnectedError"), got["/before"].error
    assert got["/ended"].chunks == 1 and got["/ended"].error == "the stream ended without [DONE]"


@pytest.mark.parametrize("keepalive_s", [60.0, 0.2])
async def test_a_connection_the_server_closed_while_the_client_was_busy_is_not_reused(keepalive_s):
    """A keep-alive server that closes connections idle for 0.4 s (hypercorn and uvicorn: 5 s),
    and a client busy in synchronous code past that (loading a tokenizer, building prompts)
    before its next request: the server's close is not read yet, so a pooled connection looks
    alive. The target drops pooled connections idle longer than ``keepalive_s`` (default 4 s,
    under those servers' 5) instead of writing its request into one; with no such limit below
    the server's (60 s here) the request fails, as ``radixd bench``'s warm-up did."""
    from radixd.bench.targets import HttpTarget
    from radixd.bench.workloads import RequestSpec

    done = b'data: {"choices": [{"index": 0, "text": "a", "finish_reason": "length"}]}\n\ndata: [DONE]\n\n'

    async def serve(reader, writer):
        try:
            while True:
                try:
                    line = await asyncio.wait_for(reader.readline(), 0.4)
                except TimeoutError:
                    return  # idle: the server closes the connection
                if not line:
                    return
                length = 0
                while (h := await reader.readline()) not in (b"\r\n", b""):
                    if h.lower().startswith(b"content-length:"):
                        length = int(h.split(b":")[1])
                await reader.readexactly(length)
                if line.startswith(b"GET"):
                    body, kind = b'{"data": [{"id": "m"}]}', b"application/json"
                else:
                    body, kind = done, b"text/event-stream"
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n%s"
                             % (kind, len(body), body))
                await writer.drain()
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    assert HttpTarget("http://x", "completions").keepalive_s == 4.0
    target = HttpTarget(f"http://127.0.0.1:{port}", "completions", keepalive_s=keepalive_s)
    try:
        await target.start()  # GET /v1/models and /server_info: a connection left in the pool
        time.sleep(0.8)  # busy, the loop blocked: the server's close waits unread
        rec = await target.request(RequestSpec(input_ids=[1, 2, 3], messages=[], output_len=1))
    finally:
        await target.close()
        server.close()
        await server.wait_closed()
    if keepalive_s > 0.4:
        assert not rec.ok and rec.error.startswith("ServerDisconnectedError"), rec.error
    else:
        assert rec.ok, rec.error
        assert rec.output_tokens == 1


@pytest.mark.slow
def test_compare_prints_ratios(daemon, tmp_path):
    args = ["--url", daemon.url, "--workload", "random", "--num-prompts", "4", "--input-len", "32",
            "--output-len", "4"]
    assert bench(tmp_path, *args, "--max-concurrency", "1", name="a")[0] == 0
    assert bench(tmp_path, *args, name="b")[0] == 0
    r = subprocess.run([sys.executable, "-m", "radixd", "bench", "compare", str(tmp_path / "a.json"),
                        str(tmp_path / "b.json")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    fa = json.loads((tmp_path / "a.json").read_text())["figures"]
    fb = json.loads((tmp_path / "b.json").read_text())["figures"]
    line = next(x for x in r.stdout.splitlines() if x.startswith("output token throughput"))
    ratio = float(line.split()[-1] if line.split()[-1][0].isdigit() else line.split()[-3])
    assert ratio == pytest.approx(fb["output_token_throughput"] / fa["output_token_throughput"], abs=1e-3)
    assert "TTFT p99 (ms)" in r.stdout and "cache hit rate" in r.stdout


@pytest.mark.slow
def test_greedy_check_default_model(tmp_path):
    rc, doc = bench(tmp_path, "--check-greedy", "2", "--workload", "random", "--input-len", "24:40",
                    "--output-len", "12")
    assert rc == 0
    res = doc["check_greedy"]
    assert res["all_identical"] and res["prompts"] == 2
    for p in res["per_prompt"]:
        assert p["engine_ids"] == p["hf_ids"] and len(p["engine_ids"]) == 12


# ------------------------------------------------------------------------ no daemon needed


def test_unreachable_target_exits_1_with_one_line():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = subprocess.run([sys.executable, "-m", "radixd", "bench", "--url", f"http://127.0.0.1:{port}"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("radixd bench: cannot reach") and str(port) in lines[0]
    assert r.stdout == ""


def test_json_workload_needs_grammars(capsys):
    assert radixd_main(["bench", "--workload", "json"]) == 2
    err = capsys.readouterr().err
    assert "grammar" in err and len(err.strip().splitlines()) == 1


def test_bad_options_exit_2(capsys):
    for argv in (["--input-len", "9:3"], ["--sweep-concurrency", "1,0"], ["--request-rate", "0"]):
        with pytest.raises(SystemExit) as exc:
            radixd_main(["bench", *argv])
        assert exc.value.code == 2, argv


def test_workloads_reproducible_from_seed(tiny_models):
    from transformers import AutoTokenizer

    from radixd.bench.workloads import build

    tok = AutoTokenizer.from_pretrained(str(tiny_models["llama"]))

    def ids(name, seed, **kw):
        w = build(name, tok, seed=seed, **kw)
        return [(w.spec(s, 0, []).input_ids, [t.output_len for t in s.turns]) for s in w.sessions]

    kw = dict(num_prompts=5, input_len=(10, 30), output_len=(2, 9))
    assert ids("random", 3, **kw) == ids("random", 3, **kw)
    assert ids("random", 3, **kw) != ids("random", 4, **kw)
    got = ids("random", 3, **kw)
    assert all(10 <= len(p) <= 30 and all(2 <= n <= 9 for n in o) for p, o in got)
    assert len({p[0] for p, _ in got}) == 5  # distinct first tokens: no shared prefix

    sp = build("shared-prefix", tok, seed=1, groups=3, prompts_per_group=4, system_len=20, question_len=5)
    assert len(sp.sessions) == 12 and sp.describe()["requests"] == 12
    by_group: dict[int, set] = {}
    for s in sp.sessions:
        spec = sp.spec(s, 0, [])
        assert len(spec.input_ids) == 25 and spec.output_len == 256  # the workload's default
        by_group.setdefault(s.group, set()).add(tuple(spec.input_ids[:20]))
        assert spec.messages[0]["role"] == "system" and spec.messages[1]["role"] == "user"
    assert all(len(v) == 1 for v in by_group.values()) and len(set().union(*by_group.values())) == 3
    assert sp.config["theoretical_max_hit_rate"] == pytest.approx(3 * 3 * 20 / (12 * 25))

    mt = build("multi-turn", tok, seed=1, conversations=2, turns=3, turn_len=(7, 7), output_len=(4, 4))
    s = mt.sessions[0]
    spec2 = mt.spec(s, 2, [([1, 2, 3, 4], "a"), ([5, 6, 7, 8], "b")])
    t = [x.user.ids for x in s.turns]
    assert spec2.input_ids == t[0] + [1, 2, 3, 4] + t[1] + [5, 6, 7, 8] + t[2]
    assert [m["role"] for m in spec2.messages] == ["user", "assistant", "user", "assistant", "user"]


async def test_http_lines_split_across_chunks_of_any_size():
    from radixd.bench.targets import body_lines

    long = "data: " + "x" * 200_000  # (an event with a long output's ids: no line limit)

    class Body:
        def __init__(self, chunks: list[bytes]):
            self.chunks = chunks

        async def iter_any(self):
            for c in self.chunks:
                yield c

    raw = f"data: {{\"a\": \"é\"}}\r\n\r\n: ping\n{long}\n\ndata: [DONE]".encode()
    want = ['data: {"a": "é"}', "", ": ping", long, "", "data: [DONE]"]
    for size in (1, 2, 7, 4096, len(raw)):
        got = [line async for line in body_lines(Body([raw[i:i + size] for i in range(0, len(raw), size)]))]
        assert got == want, size


def test_quiet_collector_freezes_the_heap_and_counts_the_runs_collections():
    import gc

    from radixd.bench.runner import quiet_collector

    frozen = gc.get_freeze_count()
    with quiet_collector() as pauses:
        assert gc.get_freeze_count() > frozen  # what existed before the run is never walked
        cycle: list = []
        cycle.append(cycle)
        del cycle
        assert gc.collect() >= 1
        gc.collect(0)
    assert pauses.count == 2 and pauses.full == 1 and pauses.max_seconds <= pauses.seconds
    assert pauses.callback not in gc.callbacks
    if frozen == 0:  # (no engine of this process holds a freeze)
        assert gc.get_freeze_count() == 0  # given back, as an engine gives its freeze back
    gc.collect()
    assert pauses.count == 2  # no longer counting


def test_poisson_arrivals_seeded_and_kept(tiny_models):
    import asyncio
    import statistics

    from transformers import AutoTokenizer

    from radixd.bench.runner import arrival_times, run_once
    from radixd.bench.targets import Target, new_record
    from radixd.bench.workloads import build

    assert arrival_times(5, math.inf, 1) == [0.0] * 5
    a = arrival_times(4000, 20.0, 1)
    assert a == arrival_times(4000, 20.0, 1) and a != arrival_times(4000, 20.0, 2)
    gaps = [y - x for x, y in zip(a, a[1:], strict=False)]
    assert a[0] == 0.0 and min(gaps) >= 0
    assert statistics.mean(gaps) == pytest.approx(1 / 20, rel=0.08)       # exponential: mean = sd
    assert statistics.stdev(gaps) == pytest.approx(1 / 20, rel=0.12)

    class Echo(Target):  # replies at once with one token per requested token
        async def request(self, spec, ignore_eos=True):
            rec = new_record(spec)
            await asyncio.sleep(0.002)
            rec.ok, rec.output_tokens, rec.ttft_ms, rec.e2e_ms = True, spec.output_len, 1.0, 2.0
            return rec

    tok = AutoTokenizer.from_pretrained(str(tiny_models["llama"]))
    w = build("random", tok, seed=1, num_prompts=12, input_len=(4, 8), output_len=(1, 3))
    records, duration = asyncio.run(run_once(Echo(), w, request_rate=40.0, seed=5, progress=False))
    expected = arrival_times(12, 40.0, 5)
    starts = sorted(r.start_ms / 1000 for r in records)
    assert len(records) == 12 and duration >= expected[-1]
    for got, want in zip(starts, expected, strict=True):   # sent at its arrival time, not before
        assert want - 1e-3 <= got <= want + 0.25


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_engine_and_hf_give_identical_greedy_outputs(tiny_models, tmp_path, arch):
    model = str(tiny_models[arch])
    common = ["--model", model, "--workload", "shared-prefix", "--groups", "2", "--prompts-per-group", "3",
              "--system-len", "60", "--question-len", "6", "--output-len", "10", "--hf-batch-size", "4"]
    rc_e, eng = bench(tmp_path, "--target", "engine", *common, name="engine")
    rc_h, hf = bench(tmp_path, "--target", "hf", *common, name="hf")
    assert rc_e == 0 and rc_h == 0
    check_consistent(eng)
    check_consistent(hf)
    out_e = {r["session"]: r["output_ids"] for r in eng["runs"][0]["records"]}
    out_h = {r["session"]: r["output_ids"] for r in hf["runs"][0]["records"]}
    assert len(out_e) == 6 and out_e == out_h
    assert len({tuple(v) for v in out_e.values()}) > 1   # not one constant output
    # the engine reports its cache (engine.stats()), the peer has none
    fe, fh = eng["figures"], hf["figures"]
    assert fe["cache"]["source"] == "engine.stats()" and 0.5 < fe["cache_hit_rate"] <= 1.0
    assert fh["cache_hit_rate"] is None and fh["cache"]["source"] is None
    assert eng["workload"] == hf["workload"]

    rc, doc = bench(tmp_path, "--check-greedy", "3", *common[:2], "--workload", "random", "--input-len", "8:20",
                    "--output-len", "12", name="check")
    assert rc == 0 and doc["check_greedy"]["all_identical"] and doc["check_greedy"]["identical"] == 3


def test_engine_args_reach_the_engine(tiny_models, tmp_path, capsys):
    common = ["--target", "engine", "--model", str(tiny_models["llama"]), "--workload", "shared-prefix",
              "--groups", "1", "--prompts-per-group", "4", "--system-len", "60", "--question-len", "4",
              "--output-len", "3"]
    rc, on = bench(tmp_path, *common, "--engine-arg", "kv_cache_tokens=2048", name="on")
    rc_off, off = bench(tmp_path, *common, "--engine-arg", "radix_cache=false", name="off")
    assert rc == 0 and rc_off == 0
    assert on["target"]["kv_pool_tokens"] == 2048 and on["target"]["radix_cache"] is True
    assert on["figures"]["cache_hit_rate"] > 0.5
    assert off["target"]["radix_cache"] is False and off["figures"]["cache_hit_rate"] == 0.0
    capsys.readouterr()
    for bad in ("policy=nope", "no_such_key=1", "kv_cache_tokens=many"):
        assert radixd_main(["bench", *common, "--engine-arg", bad, "--no-progress"]) == 2, bad
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("radixd bench: --engine-arg"), err


def test_greedy_check_reports_a_difference(tiny_models, tmp_path, capsys, monkeypatch):
    """The check can fail: give the hf peer another model's weights."""
    from radixd.bench import targets

    other = tiny_models["llama-tied"]
    real_load = targets.HFTarget._load

    def load_other(self):
        self.model_name = str(other)
        real_load(self)

    monkeypatch.setattr(targets.HFTarget, "_load", load_other)
    rc, doc = bench(tmp_path, "--check-greedy", "2", "--model", str(tiny_models["llama"]), "--workload", "random",
                    "--input-len", "8:20", "--output-len", "12")
    assert rc == 1
    assert not doc["check_greedy"]["all_identical"]
    assert re.search(r"NOT identical for [01]/2 prompts", capsys.readouterr().out)
