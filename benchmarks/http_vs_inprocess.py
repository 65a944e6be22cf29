"""The HTTP/SSE front end's cost: one workload through the in-process ``Engine`` and through a
radixd daemon over HTTP (streaming ``/v1/completions``), at a fixed number of concurrent streams.

    python -m benchmarks.http_vs_inprocess [--streams 32] [--requests 64] [--prompt 64] [--new 64]
                                      [--rounds 2] [--out benchmarks/results/http_vs_inprocess/http_vs_inprocess.json]

Both sides use the default model with the same engine settings; rounds alternate
(engine, http, engine, http, ...) so background load hits both alike. Prints JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.common import RESULTS, environment, write_json
from radixd import Engine, SamplingParams
from radixd.bench.runner import quiet_collector

KV_TOKENS = 16384


def workload(n: int, prompt: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000, 40000) for _ in range(prompt)] for _ in range(n)]


async def run_engine(prompts, new, streams) -> dict:
    eng = Engine(model="default", kv_cache_tokens=KV_TOKENS, max_running_requests=streams)
    sem = asyncio.Semaphore(streams)
    tokens = 0

    async def one(p):
        nonlocal tokens
        async with sem:
            async for out in eng.generate(input_ids=p, params=SamplingParams(max_new_tokens=new, temperature=0, ignore_eos=True)):
                tokens += len(out.token_ids)

    try:
        await one(prompts[0][:8])  # warm-up
        tokens = 0
        t = time.perf_counter()
        await asyncio.gather(*(one(p) for p in prompts))
        return {"seconds": time.perf_counter() - t, "tokens": tokens}
    finally:
        await eng.stop()


async def run_http(url, prompts, new, streams) -> dict:
    sem = asyncio.Semaphore(streams)
    tokens = 0
    limits = httpx.Limits(max_connections=streams + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        async def one(p):
            nonlocal tokens
            body = {"prompt": p, "max_tokens": new, "temperature": 0, "ignore_eos": True, "stream": True}
            async with sem, client.stream("POST", "/v1/completions", json=body) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        tokens += 1 if json.loads(line[6:])["choices"][0]["text"] is not None else 0

        await one(prompts[0][:8])
        tokens = 0
        with quiet_collector() as pauses:  # (as the engine half's engine freezes this heap)
            t = time.perf_counter()
            await asyncio.gather(*(one(p) for p in prompts))
            seconds = time.perf_counter() - t
        return {"seconds": seconds, "events": tokens, "client_gc": pauses.as_dict()}


def start_daemon(streams: int, server_keys: str = "") -> tuple[subprocess.Popen, str, Path]:
    """A daemon on the default model; ``server_keys``: more lines of its ``[server]`` table."""
    tmp = Path(tempfile.mkdtemp())
    cfg = tmp / "radixd.toml"
    cfg.write_text(f"[server]\nport = 0\n{server_keys}[memory]\nkv_cache_tokens = {KV_TOKENS}\n"
                   f"[scheduler]\nmax_running_requests = {streams}\n[logging]\naccess_log = false\n")
    log = open(tmp / "log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "radixd", "--config", str(cfg)], stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ})
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        for line in (tmp / "log").read_text().splitlines():
            if '"listening"' in line:
                return proc, f"http://127.0.0.1:{json.loads(line)['port']}", tmp
        if proc.poll() is not None:
            raise RuntimeError((tmp / "log").read_text()[-2000:])
        time.sleep(0.2)
    raise TimeoutError("daemon did not start")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(RESULTS / "http_vs_inprocess" / "http_vs_inprocess.json"))
    a = ap.parse_args()
    prompts = workload(a.requests, a.prompt, a.seed)
    proc, url, _ = start_daemon(a.streams)
    rounds = []
    try:
        for _ in range(a.rounds):
            e = asyncio.run(run_engine(prompts, a.new, a.streams))
            h = asyncio.run(run_http(url, prompts, a.new, a.streams))
            rounds.append({"engine_tok_s": e["tokens"] / e["seconds"], "http_tok_s": a.requests * a.new / h["seconds"],
                           "engine_s": e["seconds"], "http_s": h["seconds"], "engine_tokens": e["tokens"],
                           "http_client_gc": h["client_gc"]})
            print(json.dumps(rounds[-1]), flush=True)
    finally:
        proc.terminate()
        proc.wait(60)
    eng = statistics.median(r["engine_tok_s"] for r in rounds)
    http = statistics.median(r["http_tok_s"] for r in rounds)
    result = {"config": vars(a), "kv_cache_tokens": KV_TOKENS, "rounds": rounds,
              "engine_tok_s_median": round(eng, 1), "http_tok_s_median": round(http, 1),
              "http_over_engine": round(http / eng, 3),
              "http_over_engine_per_round": [round(r["http_tok_s"] / r["engine_tok_s"], 3) for r in rounds]}
    result["environment"] = environment()
    write_json(a.out, result)
    print(json.dumps({k: result[k] for k in ("engine_tok_s_median", "http_tok_s_median", "http_over_engine",
                                             "http_over_engine_per_round")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
