"""How long the host loop leaves a device idle, without a device: the engine on CPU with each
replica's worker replaced by a simulated device.

The simulated device takes ``--step-ms`` per step plus ``--token-us`` per token of the batch,
one step after another, like a GPU stream: ``launch`` spends ``--launch-us`` of Python (the
GIL held, as the real launch's batch staging does) and returns at once; ``resolve`` sleeps
until the step's simulated end (the GIL released, as a CUDA wait does). A launch that comes
after the device finished the previous step leaves it idle for the difference. Everything
else is the real engine: validation, routing, scheduling, cascade planning, streaming to one
consumer task per request, the garbage collector.

Workload: ``radixd bench``'s shared-prefix burst (groups x per-group requests, a system
prompt + a question each, greedy, ``ignore_eos``), all submitted at once.

    python3 -m benchmarks.sim_device --dp 2 --routing cache_aware --gc on --out DIR

``--submit-only`` times only the submission of the burst (validation, routing, queueing).

Reported per run: wall seconds, device busy seconds (the most loaded replica), when each
replica's first step was launched, the tokens of each replica's steps that computed prompt
tokens, device idle seconds and the longest idle gap (summed over replicas), the event loop thread's CPU time
(per step, all replicas' steps), garbage collections and their pauses.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from pathlib import Path

import torch

from benchmarks.common import CPU_ENGINE, builtin_plugins, environment
from benchmarks.dp_bound import add_workload_args
from benchmarks.loop_overhead import checkpoint
from radixd import Engine, SamplingParams
from radixd.core.forward_batch import StepOutput


class SimDevice:
    """One replica's device: steps run back to back, each ``step_s + token_s * tokens`` long."""

    def __init__(self, vocab: int, step_s: float, token_s: float, launch_s: float):
        self.vocab, self.step_s, self.token_s, self.launch_s = vocab, step_s, token_s, launch_s
        self.free_at = 0.0   # when the device finishes what it was given
        self.busy = 0.0
        self.idle: list[float] = []
        self.calls = 0
        self.first: float | None = None   # when the first step was launched
        self.prefill_tokens = 0           # tokens of steps that computed prompt tokens

    def reset(self) -> None:
        self.free_at, self.busy, self.idle, self.first, self.prefill_tokens = 0.0, 0.0, [], None, 0

    def launch(self, batch, prev=None):
        t = time.perf_counter()
        while time.perf_counter() - t < self.launch_s:  # Python work, GIL held
            pass
        self.calls += 1
        now = time.perf_counter()
        if self.first is None:
            self.first = t
        n = len(batch.sample_indices)
        if batch.num_tokens > n:
            self.prefill_tokens += batch.num_tokens
        if self.free_at and now > self.free_at:
            self.idle.append(now - self.free_at)
        dur = self.step_s + self.token_s * batch.num_tokens
        self.free_at = max(now, self.free_at) + dur
        self.busy += dur
        return [2 + (self.calls * 7 + 13 * i) % (self.vocab - 2) for i in range(n)], self.free_at

    @staticmethod
    def resolve(launched):
        if launched is None:
            return StepOutput(next_tokens=[])
        picks, end = launched
        wait = end - time.perf_counter()
        if wait > 0:
            time.sleep(wait)  # (releases the GIL, as a CUDA wait does)
        return StepOutput(next_tokens=picks)


def prompts(a) -> list[list[int]]:
    rng = random.Random(4)
    systems = [[rng.randrange(100, 500) for _ in range(a.system)] for _ in range(a.groups)]
    out = [s + [rng.randrange(100, 500) for _ in range(a.question)] for s in systems for _ in range(a.per_group)]
    rng.shuffle(out)
    return out


async def run(path: str, a) -> dict:
    kw = dict(dp_size=a.dp, routing=a.routing) if a.dp > 1 else {}
    if a.gc == "off":
        kw.update(gc_freeze=False, gc_threshold=0)
    eng = Engine(model=path, tokenizer="none", load_format="dummy", **CPU_ENGINE, plugin_manager=builtin_plugins(),
                 max_running_requests=a.max_running, max_prefill_tokens=16384, chunked_prefill_size=8192,
                 kv_cache_tokens=400_000, stream_interval=a.stream_interval, **kw)
    devs = []
    for rep in eng.replicas:
        d = SimDevice(eng.model_cfg.vocab_size, a.step_ms / 1e3, a.token_us / 1e6, a.launch_us / 1e6)
        rep.worker.launch, rep.worker.resolve = d.launch, d.resolve
        # plan cascade items each decode step, as with a triton backend (the simulated device
        # ignores them)
        rep.scheduler.cascade_members = a.cascade_members
        devs.append(d)
    params = SamplingParams(max_new_tokens=a.new, temperature=0.0, ignore_eos=True)

    async def consume(ids):
        async for _ in eng.generate(input_ids=ids, params=params):
            pass

    work = prompts(a)
    if a.submit_only:  # the host cost of admitting the burst: validation, routing, queueing
        t = time.perf_counter()
        for p in work:
            eng.submit(input_ids=p, params=params)
        secs = time.perf_counter() - t
        eng.abort_all()
        return {"dp": a.dp, "routing": a.routing if a.dp > 1 else None, "requests": len(work),
                "submit_s": round(secs, 3), "us_per_request": round(1e6 * secs / len(work), 1)}
    async with eng:
        for d in devs:
            d.reset()
        gc0, steps0 = eng.stats()["gc"], eng.stats()["steps"]
        t, cpu = time.perf_counter(), time.thread_time()  # (this thread runs the event loop)
        await asyncio.gather(*(consume(p) for p in work))
        wall, cpu = time.perf_counter() - t, time.thread_time() - cpu
        gc1, steps = eng.stats()["gc"], eng.stats()["steps"] - steps0
    idle = [g for d in devs for g in d.idle]
    return {"dp": a.dp, "routing": a.routing if a.dp > 1 else None, "gc": a.gc, "wall_s": round(wall, 3),
            "device_busy_s": round(max(d.busy for d in devs), 3), "device_idle_s": round(sum(idle), 3),
            "first_launch_s": [round(d.first - t, 3) for d in devs],
            "prefill_tokens": [d.prefill_tokens for d in devs], "idle_gaps": len(idle), "longest_gap_ms": round(1e3 * max(idle, default=0.0), 1),
            "steps": steps, "loop_cpu_s": round(cpu, 3), "loop_cpu_ms_per_step": round(1e3 * cpu / max(1, steps), 3),
            "gc_full_collections": gc1["full_collections"] - gc0["full_collections"],
            "gc_pause_s": round(gc1["pause_seconds"] - gc0["pause_seconds"], 3)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--routing", choices=["cache_aware", "round_robin"], default="cache_aware")
    ap.add_argument("--gc", choices=["on", "off"], default="on", help="the engine's gc_freeze/gc_threshold, or none")
    add_workload_args(ap)
    ap.add_argument("--stream-interval", type=int, default=8)
    ap.add_argument("--step-ms", type=float, default=16.0, help="simulated device time per step")
    ap.add_argument("--token-us", type=float, default=25.0, help="simulated device time per batch token")
    ap.add_argument("--launch-us", type=float, default=1000.0, help="Python time of a launch (GIL held)")
    ap.add_argument("--cascade-members", type=int, default=16,
                    help="plan cascade items of up to N requests each decode step (Llama-3-8B: 16; 0: none)")
    ap.add_argument("--submit-only", action="store_true", help="time submitting the burst, nothing else")
    ap.add_argument("--out", default=None, help="append the result as a JSON line to DIR/sim_device.jsonl")
    a = ap.parse_args()
    torch.set_num_threads(1)
    res = asyncio.run(run(checkpoint(False), a))
    res["args"] = vars(a)
    res["environment"] = environment()
    print(json.dumps(res), flush=True)
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        with open(Path(a.out) / "sim_device.jsonl", "a") as f:
            f.write(json.dumps(res) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
