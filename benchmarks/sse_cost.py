"""The event loop's CPU time per streamed token over real HTTP + SSE, the device taken out.

A real radixd daemon (``Daemon``: hypercorn on the engine's loop, the ``Gate``, the routes,
sse) runs in a subprocess on loopback, on a tiny Llama shape with random weights and a small
byte-level BPE tokenizer; each replica's worker is replaced by ``sim_device.SimDevice`` (no
forward pass; picks at once, or after ``--step-ms`` of simulated device time per step), so
what the daemon's process spends is the batching loop plus the serving path: outputs ->
``generation`` -> JSON -> SSE framing -> hypercorn/h11 -> the socket. A client process of its
own (raw asyncio sockets, so that it is cheap and its CPU is not counted) keeps N streaming
``/v1/completions`` requests open (``stream_interval = 1``: one event per token), prompts of
random token ids, ``ignore_eos``; every stream is checked afterwards (status, one event per
token, ``[DONE]`` last).

Reported per tree (``--tree NAME=DIR``: the daemon imports radixd from DIR; rounds
alternate between the trees so that background load hits each alike) and per stream count:
CPU µs per streamed token event of the event loop's thread (the headline) and of the whole
daemon process (and the process's system time: the kernel's side of the writes), body writes
per token (HTTP chunks: several events in one write count once), tokens/s (wall: only meaningful on a quiet machine), and the same workload
through the in-process ``Engine`` of the same daemon (consumers iterating ``generate``), so
that the serving path's share is the difference. One more run per tree and stream count
under cProfile (the loop thread's CPU clock) gives the top functions and the time per
package (radixd core / server, sse-starlette, starlette, hypercorn, h11, anyio, asyncio, json).

    python -m benchmarks.sse_cost --streams 64 256 --rounds 3 \\
        --tree before=/tmp/radixd-base --tree after=. --out benchmarks/results/sse_cost/sse_cost.json

``/tmp/radixd-base`` being e.g. ``git archive <commit> | tar -x -C /tmp/radixd-base``; with no
``--tree`` only this checkout is measured.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve()


# ------------------------------------------------------------------------ the daemon (subprocess)


def serve(a: argparse.Namespace) -> int:
    """The daemon of one tree, with its device simulated and a few routes for the benchmark:
    ``GET /bench/cpu`` (CPU seconds of the loop's thread and the process), ``POST
    /bench/profile`` ({"on": true|false}: cProfile of the loop's thread; off returns the
    stats), ``POST /bench/inprocess`` (the workload through the engine, no HTTP)."""
    import cProfile
    from dataclasses import replace

    import torch
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    import radixd.server.daemon as daemon
    from benchmarks.sim_device import SimDevice
    from radixd import SamplingParams
    from radixd.bench.metrics import summary
    from radixd.logs import configure_logging
    from radixd.plugins import hookimpl
    from radixd.plugins.wiring import Engine
    from radixd.settings import load_settings

    torch.set_num_threads(1)
    prof: list[cProfile.Profile] = []

    async def cpu(request: Request):
        return JSONResponse({"loop_thread_s": time.thread_time(), "process_s": time.process_time(),
                             "process_sys_s": os.times().system})

    async def profile(request: Request):
        body = await request.json()
        if body["on"]:
            prof.append(cProfile.Profile(time.thread_time))
            prof[-1].enable()
            return JSONResponse({})
        p = prof.pop()
        p.disable()
        return JSONResponse(profile_report(p))

    class Bench:
        @hookimpl
        def radixd_routes(self, state):
            async def inprocess(request: Request):
                w = await request.json()
                return JSONResponse(await run_inprocess(state.engine, w))

            return [Route("/bench/cpu", cpu, methods=["GET"]), Route("/bench/profile", profile, methods=["POST"]),
                    Route("/bench/inprocess", inprocess, methods=["POST"])]

        @hookimpl
        def radixd_startup(self, state):
            for rep in state.engine.replicas:
                dev = SimDevice(state.engine.model_cfg.vocab_size, a.step_ms / 1e3, 0.0, 0.0)
                rep.worker.launch, rep.worker.resolve = dev.launch, dev.resolve

    async def run_inprocess(engine, w: dict) -> dict:
        params = SamplingParams(max_new_tokens=w["new"], temperature=0.0, ignore_eos=True)
        sem = asyncio.Semaphore(w["streams"])
        tokens = 0
        gaps: list[float] | None = [] if w.get("itl") else None  # seconds between a stream's outputs

        async def one(ids):
            nonlocal tokens
            async with sem:
                last = None
                async for out in engine.generate(input_ids=ids, params=params):
                    tokens += len(out.token_ids)
                    if gaps is not None and out.token_ids:
                        now = time.perf_counter()
                        if last is not None:
                            gaps.append(now - last)
                        last = now

        prompts = workload(w["requests"], w["prompt"], w["seed"])
        c0, p0, t0 = time.thread_time(), time.process_time(), time.perf_counter()
        await asyncio.gather(*(one(p) for p in prompts))
        res = {"loop_thread_s": time.thread_time() - c0, "process_s": time.process_time() - p0,
               "wall_s": time.perf_counter() - t0, "tokens": tokens}
        if gaps:  # as ``radixd bench`` summarizes its inter-token latencies
            res["itl_ms"] = summary([g * 1000 for g in gaps])
        return res

    make_pm = daemon.make_plugin_manager
    daemon.make_plugin_manager = lambda **kw: make_pm(extra=[Bench()], **kw)
    # random weights (a config-only checkpoint): an engine option the file has no key for
    daemon.Engine = lambda cfg, **kw: Engine(replace(cfg, load_format="dummy"), **kw)
    settings = load_settings(a.config, None)
    configure_logging(settings.logging.level, settings.logging.format)
    return asyncio.run(daemon.Daemon(settings, a.config).run())


PACKAGES = (("radixd/core", "radixd core (engine, outputs)"), ("radixd/server", "radixd server"),
            ("radixd/", "radixd other"), ("benchmarks/", "simulated device"), ("sse_starlette", "sse-starlette"),
            ("starlette", "starlette"), ("hypercorn", "hypercorn"), ("h11", "h11"), ("anyio", "anyio"),
            ("json", "json"), ("asyncio", "asyncio"), ("structlog", "structlog"), ("prometheus", "prometheus"),
            ("tokenizers", "tokenizers/transformers"), ("transformers", "tokenizers/transformers"))


def profile_report(prof) -> dict:
    """Top functions of a ``cProfile.Profile`` by own and cumulative time, and own time per package."""
    import io
    import pstats

    stats = pstats.Stats(prof, stream=io.StringIO())
    by_pkg: dict[str, float] = {}
    total = 0.0
    for (path, _, _), (_, _, tt, _, _) in stats.stats.items():
        total += tt
        label = next((lab for key, lab in PACKAGES if f"/{key}" in path or path.startswith(key)), None)
        if label is None:
            label = "builtins (C calls)" if path == "~" else "other"
        by_pkg[label] = by_pkg.get(label, 0.0) + tt
    out = {"total_s": round(total, 4),
           "by_package_s": {k: round(v, 4) for k, v in sorted(by_pkg.items(), key=lambda kv: -kv[1])}}
    # paths relative to the checkout, site-packages and the standard library (no machine's paths)
    import radixd

    prefixes = [str(Path(radixd.__file__).resolve().parents[1]) + "/", sysconfig.get_paths()["purelib"] + "/",
                sysconfig.get_paths()["stdlib"] + "/"]
    for key, n in (("tottime", 30), ("cumulative", 40)):
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats(key).print_stats(n)
        text = s.getvalue()
        for prefix in prefixes:
            text = text.replace(prefix, "")
        out[key] = text
    return out


def workload(n: int, prompt: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, 200) for _ in range(prompt)] for _ in range(n)]


class Server:
    """One tree's daemon subprocess."""

    def __init__(self, name: str, tree: Path, ckpt: str, a: argparse.Namespace):
        self.name, self.tree = name, tree
        self.tmp = Path(tempfile.mkdtemp(prefix=f"radixd-sse-{name}-"))
        cfg = self.tmp / "radixd.toml"
        kv = max(a.streams) * (a.prompt + a.new) * 2 + 4096
        cfg.write_text(f'[model]\npath = "{ckpt}"\ndevice = "cpu"\ndtype = "float32"\nattention_backend = "torch"\n'
                       f'cuda_graphs = false\n[server]\nport = 0\nwatchdog = false\n[memory]\nkv_cache_tokens = {kv}\n'
                       f'[scheduler]\nmax_running_requests = {max(a.streams)}\nmax_prefill_tokens = 16384\n'
                       f'chunked_prefill_size = 8192\nstream_interval = 1\n'
                       f'[logging]\naccess_log = false\nformat = "json"\n[plugins]\nentry_points = false\n')
        self.log = open(self.tmp / "log", "w")
        boot = ("import runpy, sys; sys.argv = sys.argv[1:]; "
                "runpy.run_path(sys.argv[0], run_name='__main__')")
        env = {**os.environ, "PYTHONPATH": str(tree.resolve())}
        self.proc = subprocess.Popen([sys.executable, "-c", boot, str(HERE), "--serve", "--config", str(cfg),
                                      "--step-ms", str(a.step_ms)], stdout=self.log, stderr=subprocess.STDOUT,
                                     env=env, cwd=self.tmp)
        self.url = self._wait()
        self.port = int(self.url.rsplit(":", 1)[1])

    def _wait(self) -> str:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            for line in (self.tmp / "log").read_text().splitlines():
                if "listening" in line and (m := re.search(r'port["=: ]+(\d+)', line)):
                    return f"http://127.0.0.1:{m.group(1)}"
            if self.proc.poll() is not None:
                raise RuntimeError((self.tmp / "log").read_text()[-3000:])
            time.sleep(0.2)
        raise TimeoutError("daemon did not start")

    def call(self, path: str, body: dict | None = None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method="GET" if data is None else "POST",
                                     headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            return json.loads(r.read())

    def stop(self) -> None:
        from benchmarks.common import stop_process  # (the driver's side: this checkout's)

        stop_process(self.proc)


# ------------------------------------------------------------------------ the client (subprocess)


async def client(port: int, streams: int, requests: int, prompt: int, new: int, seed: int) -> None:
    """Keep ``streams`` keep-alive connections busy with streaming completions; print the
    workload's wall time as soon as it ends (the parent reads the daemon's CPU then), then
    the check of every response."""
    prompts = workload(requests, prompt, seed)
    bodies: list[bytes] = [b""] * requests
    nxt = 0

    async def conn():
        nonlocal nxt
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        while nxt < requests:
            i, nxt = nxt, nxt + 1
            body = json.dumps({"prompt": prompts[i], "max_tokens": new, "temperature": 0, "ignore_eos": True,
                               "stream": True}).encode()
            writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                         b"content-length: %d\r\n\r\n%s" % (len(body), body))
            parts = []
            tail = b""
            while not tail.endswith(b"\r\n0\r\n\r\n"):
                data = await reader.read(1 << 16)
                if not data:
                    raise ConnectionError("the daemon closed the connection")
                parts.append(data)
                tail = (tail + data)[-16:]
            bodies[i] = b"".join(parts)
        writer.close()

    t = time.perf_counter()
    await asyncio.gather(*(conn() for _ in range(streams)))
    print(json.dumps({"wall_s": time.perf_counter() - t}), flush=True)
    print(json.dumps(check(bodies, new)), flush=True)


def check(bodies: list[bytes], new: int) -> dict:
    """Every response: 200, ``new`` token events, then ``[DONE]``; the events and the body
    writes (HTTP chunks) counted."""
    events = bad = writes = 0
    for raw in bodies:
        head, _, chunked = raw.partition(b"\r\n\r\n")
        body = bytearray()
        while True:
            size, _, rest = chunked.partition(b"\r\n")
            n = int(size, 16)
            if n == 0:
                break
            writes += 1  # an HTTP chunk per body message the daemon wrote
            body += rest[:n]
            chunked = rest[n + 2:]
        datas = [e[6:] for e in body.decode().replace("\r\n", "\n").split("\n\n") if e.startswith("data: ")]
        tokens = [d for d in datas[:-1] if json.loads(d)["choices"]]
        ok = head.startswith(b"HTTP/1.1 200") and datas[-1:] == ["[DONE]"] and len(tokens) == new
        bad += not ok
        events += len(tokens)
    return {"token_events": events, "bad_responses": bad, "body_writes": writes}


def run_client(srv: Server, streams: int, a: argparse.Namespace) -> dict:
    """One round over HTTP: the daemon's CPU seconds around the client's workload."""
    cmd = [sys.executable, str(HERE), "--client", "--port", str(srv.port), "--streams", str(streams),
           "--requests", str(a.requests_per_stream * streams), "--prompt", str(a.prompt), "--new", str(a.new),
           "--seed", str(a.seed)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    before = srv.call("/bench/cpu")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    first = json.loads(proc.stdout.readline())
    after = srv.call("/bench/cpu")
    verdict = json.loads(proc.stdout.readline())
    proc.wait()
    if verdict["bad_responses"]:
        raise RuntimeError(f"{srv.name}: {verdict['bad_responses']} malformed responses")
    return {"loop_thread_s": after["loop_thread_s"] - before["loop_thread_s"],
            "process_s": after["process_s"] - before["process_s"], "wall_s": first["wall_s"],
            "process_sys_s": after["process_sys_s"] - before["process_sys_s"],
            "tokens": verdict["token_events"], "body_writes": verdict["body_writes"]}


def per_token(r: dict) -> dict:
    n = max(1, r["tokens"])
    return {"loop_us_per_token": round(r["loop_thread_s"] * 1e6 / n, 2),
            "process_us_per_token": round(r["process_s"] * 1e6 / n, 2),
            "tokens_per_s": round(r["tokens"] / r["wall_s"], 1), "tokens": r["tokens"],
            **({"writes_per_token": round(r["body_writes"] / n, 3),
                "process_sys_us_per_token": round(r["process_sys_s"] * 1e6 / n, 2)} if "body_writes" in r else {})}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--requests-per-stream", type=int, default=2, help="requests = this x streams")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--step-ms", type=float, default=0.0, help="simulated device time per step (0: none)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tree", action="append", default=[], help="NAME=DIR: a radixd checkout to measure")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--out", default=None, help="the result JSON file")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--config", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--requests", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.serve:
        return serve(a)
    if a.client:
        asyncio.run(client(a.port, a.streams[0], a.requests, a.prompt, a.new, a.seed))
        return 0

    from benchmarks.common import environment, write_json
    from benchmarks.loop_overhead import checkpoint

    trees = [(t.split("=", 1)[0], Path(t.split("=", 1)[1])) for t in a.tree] or [("this", ROOT)]
    ckpt = checkpoint(True)
    servers = [Server(name, tree, ckpt, a) for name, tree in trees]
    rows: dict[tuple[str, int], dict] = {}
    try:
        for srv in servers:  # warm-up: every code path once
            run_client(srv, min(a.streams), a)
        for rnd in range(a.rounds):
            for streams in a.streams:
                order = servers if rnd % 2 == 0 else servers[::-1]
                for srv in order:
                    http = per_token(run_client(srv, streams, a))
                    w = {"streams": streams, "requests": a.requests_per_stream * streams, "prompt": a.prompt,
                         "new": a.new, "seed": a.seed}
                    eng = per_token(srv.call("/bench/inprocess", w))
                    row = rows.setdefault((srv.name, streams), {"http": [], "engine": []})
                    row["http"].append(http)
                    row["engine"].append(eng)
                    print(f"round {rnd} {srv.name} streams={streams}: http loop {http['loop_us_per_token']} "
                          f"us/token (process {http['process_us_per_token']}, {http['tokens_per_s']} tok/s, "
                          f"{http['writes_per_token']} writes/token, kernel {http['process_sys_us_per_token']} us/token); "
                          f"in-process loop {eng['loop_us_per_token']} us/token", flush=True)
        profiles = {}
        if not a.no_profile:
            for srv in servers:
                for streams in a.streams:
                    srv.call("/bench/profile", {"on": True})
                    run_client(srv, streams, a)
                    profiles[f"{srv.name}/{streams}"] = p = srv.call("/bench/profile", {"on": False})
                    print(f"profile {srv.name} streams={streams}: {p['by_package_s']}", flush=True)
    finally:
        for srv in servers:
            srv.stop()

    results = []
    for (name, streams), row in rows.items():
        med = {k: statistics.median(r[k] for r in row["http"]) for k in row["http"][0]}
        eng = {k: statistics.median(r[k] for r in row["engine"]) for k in row["engine"][0]}
        results.append({"tree": name, "streams": streams, "http_median": med, "engine_median": eng,
                        "serving_path_loop_us_per_token": round(med["loop_us_per_token"] - eng["loop_us_per_token"], 2),
                        "rounds": row})
        print(f"{name} streams={streams}: loop {med['loop_us_per_token']} us/token over HTTP, "
              f"{eng['loop_us_per_token']} in-process (serving path {results[-1]['serving_path_loop_us_per_token']}); "
              f"process {med['process_us_per_token']} us/token; {med['tokens_per_s']} tok/s", flush=True)
    if a.out:
        doc = {"environment": environment(), "config": {k: v for k, v in vars(a).items()
                                                        if k not in ("serve", "client", "config", "port", "requests")},
               "trees": {name: str(tree) for name, tree in trees}, "results": results, "profiles": profiles}
        write_json(a.out, doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
