"""Inter-token latency while prompts arrive, and where each kind of step's device time goes.

An in-process ``Engine`` on random weights in a real shape serves ``radixd bench``'s random
workload (closed loop: ``--prompts`` prompts of ``--input-len`` tokens, ``--output-len`` new
tokens each, ``--concurrency`` at once), once per setting. The scheduler's keys and
``[model] mixed_cuda_graphs`` / ``mixed_graph_tokens`` default to the shipped
``radixd.toml``'s; a setting overrides some of them (``mixed_prefill_tokens=4096``: no budget
of its own; several keys joined by commas: ``mixed_prefill_tokens=256,mixed_cuda_graphs=0``;
``mixed_decode_rows=N`` sets the triton backend's ``MIXED_DECODE_ROWS`` for that run). The
report gives the budget and graph tokens as the engine settled them (0 asks for its default).

Per setting: throughput, TTFT, inter-token latency (p50 / p90 / p99 and p99 over p50, the
figure issue-style goals name), and the steps by kind: decode only, prefill only, and
mixed, each mixed or prefill kind by its prompt tokens (up to 256, 512, 1024, 2048, 4096,
more). For each kind: steps, how many replayed a mixed graph, device time per step (median,
p90; CUDA events around the launch, so overlap stays as it is), decodes per step. The device's idle share is 1 minus the
summed device time over the run's wall time; each kind's host time of the launch call (the
worker thread queueing the step's kernels) shows where the host, not the device, sets the pace. ``--profile K``: a torch profiler window of
``--profile-steps`` steps in the K-th setting (0-based), after a quarter of its prompts have
been admitted; the kernels by device time go to the JSON and the log.

    python -m benchmarks.mixed_load --out OUT [--model llama3-8b]
        [--settings "mixed_prefill_tokens=4096,mixed_cuda_graphs=0;mixed_prefill_tokens=0"] [--profile 1]
    python -m benchmarks.mixed_load --out OUT --device cpu   # the script's logic, tiny shape
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
import tomllib
from pathlib import Path

import torch

from benchmarks.common import (
    CPU_ENGINE,
    ROOT,
    SHAPES,
    checkpoint_dir,
    environment,
    free,
    write_json,
)
from radixd.bench.targets import EngineTarget
from radixd.bench.workloads import RequestSpec
from radixd.core.attention import triton_backend

SCHEDULER_KEYS = ("max_running_requests", "max_prefill_tokens", "chunked_prefill_size", "mixed_prefill_tokens")
# engine keys a setting may also give (default: the shipped radixd.toml's)
ENGINE_KEYS = ("mixed_cuda_graphs", "mixed_graph_tokens")
# not an engine option: the triton backend's MIXED_DECODE_ROWS for the run (a benchmark knob)
BACKEND_KEYS = ("mixed_decode_rows",)
BUCKETS = (256, 512, 1024, 2048, 4096)
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, vocab_size=512, max_position_embeddings=4096, rope_theta=10000.0,
            tie_word_embeddings=False)


def shipped_scheduler() -> dict:
    """The shipped radixd.toml's values of ``SCHEDULER_KEYS`` and ``ENGINE_KEYS``."""
    with open(ROOT / "radixd.toml", "rb") as f:
        toml = tomllib.load(f)
    return {k: toml["scheduler"][k] for k in SCHEDULER_KEYS} | {k: toml["model"][k] for k in ENGINE_KEYS}


def parse_setting(text: str) -> dict:
    out = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, _, value = item.partition("=")
        if not _ or key not in SCHEDULER_KEYS + ENGINE_KEYS + BACKEND_KEYS:
            raise SystemExit(f"--settings {text!r}: expected KEY=VALUE with KEY one of "
                             f"{', '.join(SCHEDULER_KEYS + ENGINE_KEYS + BACKEND_KEYS)}")
        out[key] = value.strip().lower() in ("1", "true") if key == "mixed_cuda_graphs" else int(value)
    return out


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def kind_of(prefill: int, decodes: int) -> tuple[str, int]:
    """(decode / mixed / prefill, the prompt-token bucket: the least of ``BUCKETS`` it fits,
    0 for none; past the last, one more than it)."""
    if not prefill:
        return "decode", 0
    bucket = next((b for b in BUCKETS if prefill <= b), BUCKETS[-1] + 1)
    return ("mixed" if decodes else "prefill"), bucket


def kind_name(kind: tuple[str, int]) -> str:
    name, bucket = kind
    return name if not bucket else f"{name}<={bucket}" if bucket <= BUCKETS[-1] else f"{name}>{BUCKETS[-1]}"


class StepClock:
    """Each launched step's composition, device time (CUDA events around ``launch``; on the
    CPU its wall time) and whether it replayed a mixed graph (``MixedGraphs``)."""

    def __init__(self, worker, cuda: bool):
        self.worker, self.cuda = worker, cuda
        # [prompt tokens, decodes, event pair or seconds, host seconds of the launch, replayed]
        self.rows: list[list] = []
        self.orig = worker.launch
        worker.launch = self.launch

    def launch(self, batch, prev=None, **kw):
        prefill = sum(n for n in batch.extend_lens if n > 1)
        decodes = sum(1 for n in batch.extend_lens if n == 1)
        mixed = self.worker.mixed_graphs
        replayed = bool(prefill) and mixed is not None and mixed.can_run(batch)
        t = time.perf_counter()
        if not self.cuda:
            res = self.orig(batch, prev, **kw)
            host = time.perf_counter() - t
            self.rows.append([prefill, decodes, host, host, replayed])
            return res
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        res = self.orig(batch, prev, **kw)
        b.record()
        self.rows.append([prefill, decodes, (a, b), time.perf_counter() - t, replayed])
        return res

    def finish(self) -> list[tuple[int, int, float, float, bool]]:
        self.worker.launch = self.orig
        if self.cuda:
            torch.cuda.synchronize()
            return [(p, d, a.elapsed_time(b) / 1000, h, g) for p, d, (a, b), h, g in self.rows]
        return [tuple(r) for r in self.rows]


def step_kinds(rows: list[tuple[int, int, float, float, bool]]) -> dict:
    kinds: dict[tuple[str, int], list[tuple[int, float, float, bool]]] = {}
    most: dict[tuple[str, int], int] = {}
    for p, d, s, h, g in rows:
        kinds.setdefault(kind_of(p, d), []).append((d, s, h, g))
        most[kind_of(p, d)] = max(most.get(kind_of(p, d), 0), p)
    out = {}
    for k in sorted(kinds):
        v = kinds[k]
        ms = [s * 1e3 for _, s, _, _ in v]
        host = [h * 1e3 for _, _, h, _ in v]
        out[kind_name(k)] = {"steps": len(v), "replayed": sum(g for *_, g in v),
                             "device_ms_p50": round(statistics.median(ms), 3),
                             "device_ms_p90": round(pct(ms, 0.9), 3), "device_ms_total": round(sum(ms), 1),
                             "launch_host_ms_p50": round(statistics.median(host), 3),
                             "decodes_mean": round(sum(d for d, *_ in v) / len(v), 1),
                             "prompt_tokens_max": most[k]}
    return out


class ProfileWindow:
    """A torch profiler over ``steps`` launched steps, from the step after ``after`` steps
    with prompt tokens (the stats hook runs on the loop's thread)."""

    def __init__(self, clock: StepClock, cuda: bool, *, after: int, steps: int):
        self.clock, self.cuda, self.after, self.steps = clock, cuda, after, steps
        self.prefill_steps = 0
        self.span: list[int] = []  # launched steps at start, at stop
        self.prof = None

    def on_step(self, stats) -> None:
        self.prefill_steps += bool(stats.prefill_tokens)
        if not self.span and self.prefill_steps >= self.after:
            acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if self.cuda else [])
            self.prof = torch.profiler.profile(activities=acts)
            self.prof.start()
            self.span.append(len(self.clock.rows))
        elif len(self.span) == 1 and len(self.clock.rows) - self.span[0] >= self.steps:
            self.prof.stop()
            self.span.append(len(self.clock.rows))

    def report(self, rows: list[tuple[int, int, float, float]]) -> dict | None:
        if not self.span:
            return None
        if len(self.span) == 1:  # the run ended inside the window
            self.prof.stop()
            self.span.append(len(rows))
        device = "self_device_time_total" if self.cuda else "self_cpu_time_total"
        top = sorted(self.prof.key_averages(), key=lambda e: getattr(e, device), reverse=True)[:25]
        steps = rows[self.span[0]: self.span[1]]
        return {"steps": len(steps), "kinds": step_kinds(steps),
                "ops": [{"name": e.key[:120], "calls": e.count, "self_device_us": round(getattr(e, device)),
                         "self_cpu_us": round(e.self_cpu_time_total)} for e in top]}


async def run_setting(path: str, engine_kw: dict, specs: list[RequestSpec], concurrency: int, cuda: bool,
                      profile_steps: int) -> tuple[dict, dict | None]:
    target = EngineTarget(path, **engine_kw)
    await target.start()
    eng = target.engine
    # warm-up: a few prompts of the workload's length, so first-call costs stay out
    warm = [RequestSpec(s.input_ids[::-1], [], 4) for s in specs[: min(8, len(specs))]]
    await asyncio.gather(*(target.request(s) for s in warm))
    eng.flush_cache()
    clock = StepClock(eng.worker, cuda)
    window = ProfileWindow(clock, cuda, after=len(specs) // 8, steps=profile_steps) if profile_steps else None
    if window is not None:
        eng.stats_hook = window.on_step
    sem = asyncio.Semaphore(concurrency)
    t0 = time.perf_counter()

    async def one(spec):
        async with sem:
            return await target.request(spec)

    records = await asyncio.gather(*(one(s) for s in specs))
    wall = time.perf_counter() - t0
    rows = clock.finish()
    eng.stats_hook = None
    prof_out = window.report(rows) if window is not None else None
    await target.close()
    itl = [x for r in records if r.ok for x in r.itl_ms]
    device_s = sum(r[2] for r in rows)
    p50, p99 = pct(itl, 0.5), pct(itl, 0.99)
    res = {"engine": {k: engine_kw[k] for k in SCHEDULER_KEYS + ENGINE_KEYS},
           # as the engine settled them (assembly.mixed_steps: 0 is "auto")
           "mixed_budget": eng.config.mixed_prefill_tokens, "mixed_graph_tokens": eng.config.mixed_graph_tokens,
           "mixed_decode_rows": triton_backend.MIXED_DECODE_ROWS, "wall_s": round(wall, 3),
           "completed": sum(r.ok for r in records),
           "request_throughput": round(len(specs) / wall, 3),
           "output_token_throughput": round(sum(r.output_tokens for r in records) / wall, 1),
           "ttft_ms_p50": round(pct([r.ttft_ms for r in records if r.ttft_ms is not None], 0.5), 1),
           "itl_ms": {"p50": round(p50, 2), "p90": round(pct(itl, 0.9), 2), "p99": round(p99, 2),
                      "mean": round(sum(itl) / len(itl), 2)},
           "itl_p99_over_p50": round(p99 / p50, 2),
           "steps": len(rows), "device_busy_share": round(device_s / wall, 3), "kinds": step_kinds(rows)}
    return res, prof_out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="llama3-8b", choices=sorted(SHAPES))
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--settings", default="mixed_prefill_tokens=4096,mixed_cuda_graphs=0;mixed_prefill_tokens=0",
                    help="';'-separated settings, each KEY=VALUE[,KEY=VALUE] over the shipped keys (see above)")
    ap.add_argument("--prompts", type=int, default=512)
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--profile", type=int, default=-1, help="profile a window of this setting (0-based)")
    ap.add_argument("--profile-steps", type=int, default=40)
    a = ap.parse_args()
    cuda = a.device == "cuda"
    shape = SHAPES[a.model] if cuda else TINY
    path = checkpoint_dir(shape, prefix=f"radixd-{a.model if cuda else 'tiny'}-")
    rng = random.Random(0)
    hi = min(shape["vocab_size"], 40000)
    specs = [RequestSpec([rng.randrange(100 if cuda else 3, hi) for _ in range(a.input_len)], [], a.output_len, i)
             for i in range(a.prompts)]
    base = dict(tokenizer="none", load_format="dummy")
    base |= (dict(device="cuda", dtype="bfloat16") if cuda else dict(CPU_ENGINE, kv_cache_tokens=200_000))
    out = {"what": "in-process engine, closed loop, random prompts; step kinds' device time",
           "environment": environment(), "model": a.model if cuda else "tiny", "prompts": a.prompts,
           "concurrency": a.concurrency, "input_len": a.input_len, "output_len": a.output_len,
           "argv": sys.argv[1:], "runs": []}
    default_rows = triton_backend.MIXED_DECODE_ROWS
    for i, text in enumerate(a.settings.split(";")):
        kw = base | shipped_scheduler() | parse_setting(text)
        triton_backend.MIXED_DECODE_ROWS = kw.pop("mixed_decode_rows", default_rows)
        res, prof = asyncio.run(run_setting(path, kw, specs, a.concurrency, cuda,
                                            a.profile_steps if i == a.profile else 0))
        res["setting"] = text
        print(f"== {text}: {json.dumps({k: v for k, v in res.items() if k != 'kinds'})}", flush=True)
        for k, v in res["kinds"].items():
            print(f"   {k:14s} {json.dumps(v)}", flush=True)
        if prof is not None:
            res["profile"] = prof
            print(f"   profile of {prof['steps']} steps: {json.dumps(prof['kinds'])}", flush=True)
            for k in prof["ops"][:18]:
                print(f"     {k['self_device_us']:>10} us {k['calls']:>6}x {k['name'][:100]}", flush=True)
        out["runs"].append(res)
        write_json(Path(a.out, "mixed_load.json"), out)
        free()
    print("setting | req/s | ITL p50 / p99 ms | p99/p50 | busy")
    for r in out["runs"]:
        print(f"{r['setting']} | {r['request_throughput']} | {r['itl_ms']['p50']} / {r['itl_ms']['p99']} | "
              f"{r['itl_p99_over_p50']} | {r['device_busy_share']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
