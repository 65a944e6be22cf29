"""Internet scale by simulation: 64 to 1,024 radixd replicas behind a router (cache-aware,
round robin, prefix hash), fed many conversations that share system prompts; per replica the
prefix-cache hit rate, the time to first token (p99) and, for a target request rate, the fewest
replicas that keep TTFT p99 under an SLO. The model is written up in docs/SCALING.md.

Per replica (one H200, costs from BENCHMARKS.md's measured figures): prefill runs at
``--prefill-tps`` tokens/s (40,947: 8 x 2048-token prefill) over a request's uncached tokens,
FIFO; at most ``--max-running`` requests decode at once (admission waits for a slot); decode steps take ``--step-ms-1`` at batch 1 and ``--step-ms-64`` at batch 64 (4.10 and
6.33 ms: 243.7 and 10,116.8 tok/s), linear between, and take their share of the device away
from prefill (prefill work is stretched by 1 / (1 - decode busy share)). The KV cache is an LRU
of prefixes (a system prompt, then a conversation's history behind it) of ``--kv-tokens``.

Workload: ``--system-prompts`` prompts of ``--system-len`` tokens with Zipf(``--zipf``)
popularity; conversations of ``--turns`` turns, each turn ``--question-len`` new tokens and
``--output-len`` generated ones, Poisson arrivals. The router knows what it sent where (as
smg's approximate tree does), not what the replicas evicted.

    python -m benchmarks.scale_sim [--replicas 64 256 1024] [--rate 20000] [--quick]
"""

from __future__ import annotations

import argparse
import bisect
import heapq
import json
import random
import zlib
from collections import OrderedDict
from dataclasses import dataclass, field

POLICIES = ("cache_aware", "round_robin", "prefix_hash")


@dataclass
class Replica:
    kv_tokens: int
    cache: OrderedDict = field(default_factory=OrderedDict)  # prefix key -> tokens, LRU first
    used: int = 0
    free_at: float = 0.0        # when its prefill queue drains
    decode_until: list = field(default_factory=list)  # heap of decode end times

    def cached(self, key) -> int:
        if key in self.cache:
            self.cache.move_to_end(key)
            return self.cache[key]
        return 0

    def insert(self, key, tokens: int) -> None:
        self.used += tokens - self.cache.pop(key, 0)
        self.cache[key] = tokens
        while self.used > self.kv_tokens and len(self.cache) > 1:
            _, t = self.cache.popitem(last=False)
            self.used -= t


@dataclass
class Costs:
    prefill_tps: float
    step_ms_1: float
    step_ms_64: float

    def step_s(self, batch: int) -> float:
        b = max(1, min(batch, 256))
        return (self.step_ms_1 + (b - 1) * (self.step_ms_64 - self.step_ms_1) / 63) / 1000


def workload(args, rate: float, n: int, seed: int):
    """(arrival time, system prompt, conversation, turn) of ``n`` requests."""
    rng = random.Random(seed)
    weights = [1 / (k + 1) ** args.zipf for k in range(args.system_prompts)]
    t, out, live = 0.0, [], []  # live: [conversation id, system prompt, next turn]
    next_conv = 0
    for _ in range(n):
        t += rng.expovariate(rate)
        if not live or rng.random() < 1 / args.turns:
            live.append([next_conv, rng.choices(range(args.system_prompts), weights)[0], 0])
            next_conv += 1
        i = rng.randrange(len(live))
        conv = live[i]
        out.append((t, conv[1], conv[0], conv[2]))
        conv[2] += 1
        if conv[2] == args.turns:
            live[i] = live[-1]
            live.pop()
    return out


def _h(*parts) -> int:
    return zlib.crc32(repr(parts).encode())


class Loads:
    """Requests in flight per replica (routed, not finished: the load smg counts), with the least loaded found in O(log n) (a heap
    whose stale entries are skipped)."""

    def __init__(self, n: int):
        self.value = [0] * n
        self.total = 0
        self._heap = [(0, r) for r in range(n)]

    def add(self, r: int, d: int) -> None:
        self.value[r] += d
        self.total += d
        heapq.heappush(self._heap, (self.value[r], r))

    def least(self) -> int:
        while self._heap[0][0] != self.value[self._heap[0][1]]:
            heapq.heappop(self._heap)
        return self._heap[0][1]


def simulate(args, policy: str, replicas: int, rate: float, seed: int = 0) -> dict:
    costs = Costs(args.prefill_tps, args.step_ms_1, args.step_ms_64)
    reps = [Replica(args.kv_tokens) for _ in range(replicas)]
    loads = Loads(replicas)
    where: dict = {}          # the router's belief: prefix key -> replicas it sent it to
    ring = sorted((_h(seed, r, v), r) for r in range(replicas) for v in range(16))
    points = [p for p, _ in ring]
    rr = 0
    ttfts, hit, queried = [], 0, 0
    ends: list = []           # heap of (last token time, replica): its load drops then
    n = args.requests_per_replica * replicas
    for k, (t, sp, conv, turn) in enumerate(workload(args, rate, n, seed)):
        while ends and ends[0][0] <= t:
            loads.add(heapq.heappop(ends)[1], -1)
        out = loads.value
        if policy == "round_robin":
            r, rr = rr, (rr + 1) % replicas
        elif policy == "prefix_hash":  # consistent hashing of the prefix, bounded load (smg's)
            i = bisect.bisect_left(points, _h(seed, "sp", sp))
            bound = args.load_factor * loads.total / replicas + 1
            for j in range(len(ring)):
                r = ring[(i + j) % len(ring)][1]
                if out[r] <= bound:
                    break
        else:  # cache_aware: the conversation's replica, else the least busy holder of the
            least = loads.least()  # system prompt, unless much busier than the least loaded
            holders = where.get(("c", conv)) or where.get(("s", sp)) or ()
            r = min(holders, key=out.__getitem__, default=least)
            lo = out[least]
            if out[r] > lo + args.balance_abs and out[r] > args.balance_rel * lo:
                r = least
        rep = reps[r]
        measured = k >= n // 3  # the first third warms the caches
        where.setdefault(("s", sp), set()).add(r)
        where[("c", conv)] = {r}
        history = turn * (args.question_len + args.output_len)
        prompt = args.system_len + history + args.question_len
        cached = rep.cached(("s", sp))
        if cached and history:
            cached += rep.cached(("c", conv))
        if measured:
            hit += cached
            queried += prompt
        while rep.decode_until and rep.decode_until[0] <= t:
            heapq.heappop(rep.decode_until)
        batch = len(rep.decode_until)
        # a step prefills a chunk beside the batch's decode: decode's share of the device
        step = costs.step_s(batch)
        busy = min(0.95, step / (step + args.chunk_tokens / costs.prefill_tps)) if batch else 0.0
        start = max(t, rep.free_at)
        if batch >= args.max_running:  # every decode slot taken: admission waits for one
            start = max(start, heapq.heappop(rep.decode_until))
            batch -= 1
        done = start + (prompt - cached) / costs.prefill_tps / (1 - busy)
        rep.free_at = done
        if measured:
            ttfts.append(done - t)
        end = done + args.output_len * costs.step_s(batch + 1)
        heapq.heappush(rep.decode_until, end)
        loads.add(r, 1)
        heapq.heappush(ends, (end, r))
        rep.insert(("s", sp), args.system_len)
        rep.insert(("c", conv), prompt + args.output_len - args.system_len)
    ttfts.sort()
    return {"policy": policy, "replicas": replicas, "rate": rate, "hit_rate": hit / queried,
            "ttft_p50_s": ttfts[len(ttfts) // 2], "ttft_p99_s": ttfts[int(len(ttfts) * 0.99)]}


def replicas_needed(args, policy: str, rate: float) -> int | None:
    """The fewest replicas of ``--search`` whose TTFT p99 meets the SLO (None: none does)."""
    for n in args.search:
        if simulate(args, policy, n, rate)["ttft_p99_s"] <= args.slo_s:
            return n
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--rate", type=float, default=None, help="requests/s (default: 12 per replica)")
    ap.add_argument("--target-rate", type=float, default=8000.0, help="requests/s for the replicas-needed search")
    ap.add_argument("--search", type=int, nargs="+", default=[64, 96, 128, 192, 256, 384, 512, 768, 1024])
    ap.add_argument("--slo-s", type=float, default=1.0, help="TTFT p99 the search must meet")
    ap.add_argument("--requests-per-replica", type=int, default=800, help="the first third warms the caches")
    ap.add_argument("--system-prompts", type=int, default=2000)
    ap.add_argument("--system-len", type=int, default=2000)
    ap.add_argument("--zipf", type=float, default=1.1)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--question-len", type=int, default=200)
    ap.add_argument("--output-len", type=int, default=300)
    ap.add_argument("--kv-tokens", type=int, default=400_000, help="KV pool per replica (8B bf16 on an H200)")
    ap.add_argument("--prefill-tps", type=float, default=40947.0)
    ap.add_argument("--step-ms-1", type=float, default=4.10)
    ap.add_argument("--step-ms-64", type=float, default=6.33)
    ap.add_argument("--max-running", type=int, default=256, help="requests decoding at once per replica")
    ap.add_argument("--chunk-tokens", type=int, default=2048, help="prefill tokens per step beside decode")
    ap.add_argument("--balance-abs", type=int, default=16)
    ap.add_argument("--balance-rel", type=float, default=1.25)
    ap.add_argument("--load-factor", type=float, default=1.25, help="prefix_hash's bound over the mean load")
    ap.add_argument("--quick", action="store_true", help="a few replicas and requests (CI)")
    ap.add_argument("--output", help="write the results as JSON here")
    args = ap.parse_args(argv)
    if args.quick:
        args.replicas, args.requests_per_replica, args.system_prompts, args.search = [4, 8], 300, 40, [2, 4, 8, 16]
        args.target_rate, args.kv_tokens = 100.0, 40_000
    results = {"args": {k: v for k, v in vars(args).items() if k != "output"}, "runs": [], "needed": {}}
    for n in args.replicas:
        rate = args.rate or 12.0 * n
        for policy in POLICIES:
            res = simulate(args, policy, n, rate)
            results["runs"].append(res)
            print(f"{n:5d} replicas {rate:8.0f} req/s {policy:12s} hit {res['hit_rate']:.3f} "
                  f"TTFT p50 {res['ttft_p50_s'] * 1000:8.1f} ms p99 {res['ttft_p99_s'] * 1000:9.1f} ms", flush=True)
    for policy in POLICIES:
        results["needed"][policy] = replicas_needed(args, policy, args.target_rate)
        print(f"replicas for {args.target_rate:.0f} req/s at TTFT p99 <= {args.slo_s} s, {policy}: "
              f"{results['needed'][policy]}", flush=True)
    if args.output:
        with open(args.output, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
