"""Does the HTTP serving path add to the inter-token latency's tail? The same streams through
a real daemon over HTTP + SSE and through its in-process engine, on a simulated device.

The daemon is ``benchmarks.sse_cost``'s (a tiny Llama shape with random weights and a small
byte-level BPE tokenizer, each replica's worker replaced by ``sim_device.SimDevice``: a step
takes ``--step-ms`` and nothing else), in a subprocess on loopback. The HTTP half is
``radixd bench --target http`` in a process of its own (aiohttp, its heap frozen while it
times, as a user would measure a server); the in-process half is the same workload through
the daemon's engine (``POST /bench/inprocess``: consumers iterating ``generate``, no HTTP).
Rounds alternate the two halves. Reported per round and as medians over the rounds:
inter-token latency p50 / p99 / max and p99 / p50 of each half.

On one machine the client's CPU competes with the daemon's: keep streams x tokens per second
x (the daemon's ~60 µs + the client's ~60 µs per event, on a 2-core VM) well under the cores.

    python -m benchmarks.http_itl --streams 64 --requests 256 --step-ms 8 --rounds 3 --out DIR
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def http_round(url: str, ckpt: str, a: argparse.Namespace, seed: int) -> dict:
    """One ``radixd bench --target http`` run; its figures."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run.json"
        cmd = [sys.executable, "-m", "radixd", "bench", "--target", "http", "--url", url, "--api", "completions",
               "--tokenizer", ckpt, "--workload", "random", "--num-prompts", str(a.requests),
               "--input-len", str(a.prompt), "--output-len", str(a.new), "--max-concurrency", str(a.streams),
               "--seed", str(seed), "--output", str(out)]
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=900)
        if r.returncode != 0 or not out.exists():
            raise RuntimeError(f"radixd bench failed ({r.returncode}):\n{r.stderr[-3000:]}")
        if "warm-up request failed" in r.stderr:
            raise RuntimeError(r.stderr[-3000:])
        figs = json.loads(out.read_text())["figures"]
    if figs["failed"]:
        raise RuntimeError(f"{figs['failed']} requests failed: {figs['errors']}")
    return {"itl_ms": figs["itl_ms"], "output_tok_s": figs["output_token_throughput"], "client_gc": figs.get("client_gc")}


def tail(itl: dict) -> dict:
    return {"p50_ms": round(itl["median"], 3), "p99_ms": round(itl["p99"], 3), "max_ms": round(itl["max"], 3),
            "p99_over_p50": round(itl["p99"] / itl["median"], 3), "gaps": itl["count"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=64, help="concurrent streams")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--step-ms", type=float, default=8.0, help="simulated device time per step")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None, help="a folder for http_itl.json")
    a = ap.parse_args()

    from benchmarks.common import environment, write_json
    from benchmarks.loop_overhead import checkpoint
    from benchmarks.sse_cost import Server

    ckpt = checkpoint(True)
    srv = Server("this", ROOT, ckpt, argparse.Namespace(streams=[a.streams], prompt=a.prompt, new=a.new,
                                                        step_ms=a.step_ms))
    rounds = []
    try:
        for rnd in range(a.rounds):
            w = {"streams": a.streams, "requests": a.requests, "prompt": a.prompt, "new": a.new, "seed": rnd,
                 "itl": True}
            halves = {}
            for half in (("http", "engine") if rnd % 2 == 0 else ("engine", "http")):
                if half == "http":
                    halves[half] = http_round(srv.url, ckpt, a, rnd)
                else:
                    res = srv.call("/bench/inprocess", w)
                    halves[half] = {"itl_ms": res["itl_ms"], "output_tok_s": res["tokens"] / res["wall_s"]}
            row = {half: {**tail(h["itl_ms"]), "output_tok_s": round(h["output_tok_s"], 1)}
                   for half, h in halves.items()}
            row["client_gc"] = halves["http"]["client_gc"]
            rounds.append(row)
            print(f"round {rnd}: http ITL p50 / p99 {row['http']['p50_ms']} / {row['http']['p99_ms']} ms "
                  f"({row['http']['p99_over_p50']}x), in-process {row['engine']['p50_ms']} / "
                  f"{row['engine']['p99_ms']} ms ({row['engine']['p99_over_p50']}x)", flush=True)
    finally:
        srv.stop()
    medians = {half: {k: statistics.median(r[half][k] for r in rounds) for k in rounds[0][half]}
               for half in ("http", "engine")}
    print(f"medians: http {medians['http']}, in-process {medians['engine']}")
    if a.out:
        doc = {"environment": environment(), "config": vars(a), "rounds": rounds, "medians": medians}
        print("wrote", write_json(Path(a.out) / "http_itl.json", doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
