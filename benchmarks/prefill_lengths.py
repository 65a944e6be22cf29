"""Time to first token for prompts of lengths an engine has not seen before, with the engine
option ``dense_prefill`` on and off (8B shape, random weights, one CUDA GPU): whether the fused
prefill path pays for new shapes in serving.

A first engine (off) serves prompts of its own lengths, untimed, so that what a process does
once (kernels compiled and loaded) is done. Then, for each of ``--settings`` in turn, a fresh
engine (its build time recorded, and for "on" the plans ``dense_prefill`` builds at start)
serves a 100-token prompt, then ``--lengths`` prompts of distinct lengths no engine of the
process has seen, one at a time (batch 1, one output token), then the same lengths again (now
seen), then ``--burst`` prompts of other new lengths at once. Engine limits: ``--chunk`` and
``--budget`` (radixd.toml's defaults 2048 and 4096).

    python -m benchmarks.prefill_lengths --out OUT [--lengths 12] [--settings on,off,on,off]
        [--chunk 2048 --budget 4096 --max-length 4000]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time

from benchmarks import gpu_bench
from benchmarks.common import SHAPES, checkpoint_dir, environment, free, write_json
from radixd.core.attention import dense_prefill


def summary(xs: list[float]) -> dict:
    s = sorted(xs)
    return {"median_s": round(statistics.median(s), 4), "p90_s": round(s[int(0.9 * (len(s) - 1))], 4),
            "max_s": round(s[-1], 4), "mean_s": round(sum(s) / len(s), 4)}


def run_setting(path: str, on: bool, args, lengths: list[int], burst: list[int], rng: random.Random) -> dict:
    t0 = time.perf_counter()
    eng = gpu_bench.engine(path, chunked_prefill_size=args.chunk, max_prefill_tokens=args.budget,
                           kv_cache_tokens=200_000, max_running_requests=64, dense_prefill=on)
    built = time.perf_counter() - t0
    plans = eng.worker.attn.plans
    loop = asyncio.new_event_loop()

    def ttfts(ns: list[int]) -> list[float]:
        prompts = [[rng.randrange(100, gpu_bench.VOCAB_HI) for _ in range(n)] for n in ns]
        return loop.run_until_complete(gpu_bench._run_batch(eng, prompts, 1))["ttft"]

    try:
        ttfts([100])
        first = [ttfts([n])[0] for n in lengths]
        again = [ttfts([n])[0] for n in lengths]
        together = ttfts(burst) if burst else [0.0]
    finally:
        loop.run_until_complete(eng.stop())
        loop.close()
        eng = None
        free()
    return {"engine_build_s": round(built, 2), "plans": plans.warm._asdict() if plans is not None else None,
            "new_lengths": summary(first), "seen_lengths": summary(again), "burst_all_first_s": round(max(together), 4),
            "ttft_by_length_s": {n: round(x, 4) for n, x in zip(lengths, first, strict=True)}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--lengths", type=int, default=12)
    ap.add_argument("--burst", type=int, default=8)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--budget", type=int, default=4096)
    ap.add_argument("--max-length", type=int, default=4000, help="prompt lengths from 257 to this")
    ap.add_argument("--settings", default="on,off,on,off", help="dense_prefill settings in turn")
    args = ap.parse_args()
    dense_prefill.enable_buckets()
    rng = random.Random(11)
    settings = args.settings.split(",")
    pool = rng.sample(range(257, args.max_length), (len(settings) + 1) * (args.lengths + args.burst))
    sets = [pool[i * (args.lengths + args.burst):(i + 1) * (args.lengths + args.burst)] for i in range(len(settings) + 1)]
    cfg = {**SHAPES["llama3-8b"], "max_position_embeddings": max(8192, 2 * args.max_length)}
    path = checkpoint_dir(cfg, prefix="radixd-lengths-")
    res = {"env": environment(), "chunk": args.chunk, "budget": args.budget, "max_length": args.max_length, "runs": []}
    run_setting(path, False, args, sets[0][:6], [], rng)  # (once a process: kernels compiled and loaded)
    for setting, ns in zip(settings, sets[1:], strict=True):
        row = run_setting(path, setting == "on", args, ns[:args.lengths], ns[args.lengths:], rng)
        res["runs"].append({"dense_prefill": setting, **row})
        print(f"== {setting}: build {row['engine_build_s']} s, plans {row['plans']}; new lengths {row['new_lengths']}; "
              f"seen {row['seen_lengths']}; burst of {args.burst} {row['burst_all_first_s']} s", flush=True)
    write_json(f"{args.out}/prefill_lengths_{args.chunk}.json", res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
