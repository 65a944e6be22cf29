"""radixd on two GPUs in one process: data-parallel replicas and tensor parallel, timed in one run.

    python3 -m benchmarks.multi_gpu_bench --out DIR [--sections dp,tp] [--device cuda|cpu] [--quick]

Random weights in Llama-3-8B's shape (built from a config, no model hub), bf16, CUDA graphs.
Writes DIR/multi_gpu.json (updated after every measurement) and DIR/log.txt.

Sections:
  dp   the same engine settings on one GPU (dp_size=1) and on two (dp_size=2), in process:
       * shared_prefix: 16 system prompts x 32 questions (1024 + 64 tokens, 128 new), all
         submitted at once; the KV pool holds every prefix. One GPU vs dp=2 cache_aware vs
         dp=2 round_robin: output tokens/s and cache hit rate (engine.stats() deltas).
       * prefix_pressure: 48 system prompts of 3072 tokens, in 5 rounds (each round one
         question per system prompt, shuffled); all prefixes (147k tokens) do not fit one
         replica's pool (80k tokens), half of them do: cache_aware vs round_robin (and one GPU).
       * bench_shared_prefix (only with --dp-workloads naming it): `radixd bench`'s
         shared-prefix workload at its defaults, 64 system prompts of 2048 tokens x 16
         questions of 128 tokens, 256 new, all at once.
       Every engine's pool holds 80k tokens at full size (--kv-tokens changes it; 0 sizes it
       from free memory). The round-robin runs reuse the dp=2 engine with its router
       switched to round_robin (caches flushed between runs); every run starts from empty
       caches.
  tp   decode at batch 1 (512-token prompt, 256 new tokens, greedy): tp_size=1 vs tp_size=2
       (peer-to-peer all-reduce for decode) vs tp_size=2 with NCCL only, all with CUDA graphs
       (whether the tp=2 graphs were captured is reported); greedy tokens and logprobs of
       each tp=2 run against tp=1 on the same weights.
  allreduce  microseconds per all-reduce of a decode partial (batch 1 and 64): the peer-to-
       peer kernel vs NCCL, inside CUDA graphs on both GPUs.
       --profile-window START,SECONDS adds one more dp=2 run per router with torch.profiler on
       for that window: each GPU's kernel time per step by family against the wall time.
  tpprofile  a tp=2 batch-1 decode under torch.profiler: kernel time per step by family on
       each GPU against the wall time per step.
  replicas  (one GPU) the shared-prefix workloads named in --dp-workloads, cascade attention
       off and on: the whole workload, and the share one dp=2 replica serves under cache-aware
       routing (half the groups) and under round robin (every other request).

--device cpu runs the same logic with tiny shapes on CPU workers (a smoke test of the script).
"""

from __future__ import annotations

import os

# NVLink multicast stays off (it can take a shared host's GPUs out of service).
os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
os.environ["NVSHMEM_DISABLE_NVLS"] = "1"

import argparse  # noqa: E402
import asyncio  # noqa: E402
import faulthandler  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from benchmarks import common  # noqa: E402
from benchmarks.common import (  # noqa: E402
    CPU_ENGINE,
    CUDA_ENGINE,
    Log,
    builtin_plugins,
    checkpoint_dir,
    environment,
    free,
    write_json,
)
from radixd import Engine, SamplingParams  # noqa: E402

SHAPES = {
    "llama3-8b": common.SHAPES["llama3-8b"],
    "tiny": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=256, vocab_size=512, max_position_embeddings=8192,
                 rope_theta=10000.0, tie_word_embeddings=False),
}

# workload sizes: full (the GPU run), medium (the routing logic at scale on CPU workers),
# quick (--quick, and the CPU default: a smoke run)
SHARED = {"full": dict(groups=16, per_group=32, system=1024, question=64, new=128),
          "medium": dict(groups=8, per_group=8, system=256, question=16, new=8),
          "quick": dict(groups=4, per_group=4, system=64, question=8, new=8)}
# `radixd bench`'s shared-prefix workload at its defaults (radixd/bench/workloads.py `build`:
# 64 groups x 16 prompts, 2048-token system prompts, 128-token questions, 256 new tokens)
BENCH_SHARED = {"full": dict(groups=64, per_group=16, system=2048, question=128, new=256),
                "medium": dict(groups=16, per_group=8, system=256, question=16, new=16),
                "quick": dict(groups=4, per_group=4, system=64, question=8, new=8)}
PRESSURE = {"full": dict(groups=48, system=3072, question=32, new=32, rounds=5, kv_tokens=80_000),
            "medium": dict(groups=24, system=512, question=16, new=4, rounds=4, kv_tokens=8000),
            "quick": dict(groups=6, system=96, question=8, new=4, rounds=3, kv_tokens=400)}
DECODE = {"full": dict(prompt=512, new=256, reps=3, check_prompts=3, check_new=32),
          "medium": dict(prompt=128, new=32, reps=3, check_prompts=3, check_new=16),
          "quick": dict(prompt=32, new=16, reps=2, check_prompts=2, check_new=8)}


class Run:
    """Settings, the log and the results file of this run."""

    def __init__(self, args):
        self.args = args
        self.cpu = args.device == "cpu"
        self.size = args.size or ("quick" if (args.quick or self.cpu) else "full")
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.log = Log(self.out / "log.txt")
        self.results: dict = {"args": vars(args), "env": env_info(), "sections": {}}
        model = "tiny" if self.cpu else args.model
        self.path = checkpoint_dir(SHAPES[model], prefix=f"radixd-{model}-")
        self.results["model"] = model
        self.vocab_hi = min(40000, SHAPES[model]["vocab_size"] - 1)

    def save(self) -> None:
        write_json(self.out / "multi_gpu.json", self.results)

    def engine(self, **kw) -> Engine:
        kw = {"max_running_requests": 32, **kw, **CPU_ENGINE} if self.cpu else {**CUDA_ENGINE, **kw}
        kv = self.args.kv_tokens if self.args.kv_tokens is not None else PRESSURE[self.size]["kv_tokens"]
        if kv:  # (0: the engine sizes the pool from free memory)
            kw.setdefault("kv_cache_tokens", kv)
        kw.setdefault("stream_interval", self.args.stream_interval)
        kw.setdefault("cascade_attention", self.args.cascade == "on")
        if self.args.gc == "off":  # Python's collector as it is (the engine's default tunes it)
            kw.setdefault("gc_freeze", False)
            kw.setdefault("gc_threshold", 0)
        t = time.perf_counter()
        eng = Engine(model=self.path, tokenizer="none", load_format="dummy", plugin_manager=builtin_plugins(), **kw)
        self.log(f"-- engine {kw} built in {time.perf_counter() - t:.1f}s")
        return eng

    def with_engine(self, loop, fn, **kw):
        """``fn(engine)`` on an engine built with ``kw``, stopped and its memory released
        afterwards (before the next one is built)."""
        eng = self.engine(**kw)
        try:
            return fn(eng)
        finally:
            loop.run_until_complete(eng.stop())
            del eng
            free()


def env_info() -> dict:
    """``environment()`` and what the multi-GPU figures also depend on: NCCL and its switches."""
    info = environment()
    info["nccl_env"] = {k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                                                      "NVSHMEM_DISABLE_NVLS")}
    if torch.cuda.is_available():
        try:
            info["nccl"] = ".".join(str(v) for v in torch.cuda.nccl.version())
        except Exception as exc:  # reported, not fatal: the dp section needs no NCCL
            info["nccl"] = repr(exc)
    return info


async def run_batch(eng: Engine, prompts: list[list[int]], new: int, logprobs: bool = False) -> dict:
    """All prompts at once; wall time, each request's first-token time, tokens (+logprobs)."""
    t0 = time.perf_counter()
    firsts, ends = [0.0] * len(prompts), [0.0] * len(prompts)
    toks: list[list[int]] = [[] for _ in prompts]
    lps: list[list[float]] = [[] for _ in prompts]

    async def one(i, p):
        params = SamplingParams(max_new_tokens=new, temperature=0, ignore_eos=True, logprobs=logprobs)
        async for out in eng.generate(input_ids=p, params=params):
            if not firsts[i] and out.token_ids:
                firsts[i] = time.perf_counter()
            toks[i] += out.token_ids
            lps[i] += [lp.logprob for lp in out.logprobs or []]
        ends[i] = time.perf_counter()

    await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    return {"t0": t0, "end": max(ends), "firsts": firsts, "ends": ends, "tokens": toks, "logprobs": lps}


def cache_counts(eng: Engine) -> tuple[int, int, int]:
    st = eng.stats()
    return st["cache_queried_tokens"], st["cache_hit_tokens"], st["steps"]


class Timeline:
    """Each replica's steps: a wrapper around its worker's ``launch`` and ``resolve`` records
    when the host launched a step and when its picks were back (resolves come in launch
    order), its tokens and requests, and on CUDA an event on the worker's stream before and
    after the launch. The device's time on step i runs from the first event to the second
    (host gaps inside the launch included); the time from step i-1's second event to step i's
    first is time the stream had nothing to run: the device waiting for the host."""

    def __init__(self, eng: Engine):
        self.steps: list[list[list]] = [[] for _ in eng.replicas]
        self._saved = []
        for rep, steps in zip(eng.replicas, self.steps, strict=True):
            w = rep.worker
            dev = getattr(w, "device", None)
            cuda = dev is not None and torch.device(dev).type == "cuda"
            self._saved.append((w, w.launch, w.resolve))
            w.launch = self._launch(w.launch, steps, torch.device(dev) if cuda else None)
            w.resolve = self._resolve(w.resolve, steps)

    @staticmethod
    def _launch(fn, steps, dev):
        def event():
            if dev is None:
                return None
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(torch.cuda.current_stream(dev))
            return ev

        def launch(batch, prev=None):
            t, ev0 = time.perf_counter(), event()
            out = fn(batch, prev)
            steps.append([t, None, batch.num_tokens, batch.batch_size, ev0, event(), time.perf_counter()])
            return out
        return launch

    @staticmethod
    def _resolve(fn, steps):
        pending = iter(steps)  # (a list iterator sees items appended later)

        def resolve(picks):
            out = fn(picks)
            next(pending)[1] = time.perf_counter()
            return out
        return resolve

    def close(self) -> None:
        for w, launch, resolve in self._saved:
            w.launch, w.resolve = launch, resolve

    def summary(self, t0: float) -> list[dict]:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        out = []
        for steps in self.steps:
            done = [s for s in steps if s[1] is not None]
            if not done:
                out.append({})
                continue
            dec, mix = [0, 0.0], [0, 0.0, 0]
            launch_s = 0.0
            idle, prev_end = 0.0, None
            for launched, _, tokens, reqs, ev0, ev1, returned in done:
                launch_s += returned - launched
                acc = dec if tokens == reqs else mix
                acc[0] += 1
                if ev0 is not None:
                    acc[1] += ev0.elapsed_time(ev1) / 1e3
                    if prev_end is not None:
                        idle += prev_end.elapsed_time(ev0) / 1e3
                    prev_end = ev1
                if acc is mix:
                    mix[2] += tokens
            row = {"end_s": round(done[-1][1] - t0, 3), "first_launch_s": round(done[0][0] - t0, 3),
                   "decode_steps": dec[0], "prefill_steps": mix[0], "prefill_tokens": mix[2],
                   "host_launch_ms_per_step": round(1e3 * launch_s / len(done), 3)}
            if done[0][4] is not None:  # the device's side (CUDA events)
                row |= {"device_decode_s": round(dec[1], 3),
                        "device_decode_ms_per_step": round(1e3 * dec[1] / max(1, dec[0]), 2),
                        "device_prefill_s": round(mix[1], 3), "device_idle_s": round(idle, 3)}
            out.append(row)
        return out


def measure(loop, eng: Engine, rounds: list[list[list[int]]], new: int, timeline: bool = False,
            on_start=None) -> dict:
    """Run the rounds one after the other from empty caches: output tokens/s and hit rate.
    ``on_start(loop, timeline)``, if given, is called as the clock starts."""
    for _ in range(500):  # a request may be released a step after its last output
        if eng.flush_cache():
            break
        loop.run_until_complete(asyncio.sleep(0.01))
    else:
        raise RuntimeError("the cache is still in use 5 s after the previous run")
    if eng.router is not None:
        eng.router.clear()
    q0, h0, s0 = cache_counts(eng)
    routed0 = list(eng.router.routed) if eng.router is not None else None
    gc0 = eng.stats()["gc"]
    tl = Timeline(eng) if timeline else None
    t, cpu = time.perf_counter(), time.thread_time()  # (this thread runs the event loop)
    if on_start is not None:
        on_start(loop, tl)
    n = 0
    try:
        for prompts in rounds:
            loop.run_until_complete(run_batch(eng, prompts, new))
            n += len(prompts)
    finally:
        if tl is not None:
            tl.close()
    secs, cpu = time.perf_counter() - t, time.thread_time() - cpu
    gc1 = eng.stats()["gc"]
    q1, h1, s1 = cache_counts(eng)
    eng.check_accounting()
    res = {"seconds": round(secs, 3), "requests": n, "out_tok_s": round(n * new / secs, 1),
           "hit_rate": round((h1 - h0) / (q1 - q0), 4) if q1 > q0 else 0.0, "steps": s1 - s0,
           "ms_per_step": round(1e3 * secs / max(1, s1 - s0), 2),
           # how busy the one event loop was, and what the garbage collector took of it
           "loop_cpu_share": round(cpu / secs, 3),
           "gc_full_collections": gc1["full_collections"] - gc0["full_collections"],
           "gc_pause_s": round(gc1["pause_seconds"] - gc0["pause_seconds"], 3),
           "gc_max_pause_s": gc1["max_pause_seconds"]}
    if routed0 is not None:
        res["routed"] = [a - b for a, b in zip(eng.router.routed, routed0, strict=True)]
    if tl is not None:
        res["timeline"] = tl.summary(t)
    return res


def _family(name: str) -> str:
    low = name.lower()
    if any(x in low for x in ("gemm", "cutlass", "sm90", "nvjet", "cublas")):
        return "cublas gemm"
    if low.startswith("memcpy") or low.startswith("memset"):
        return name.split(" (")[0]
    return name[:48]  # (radixd's Triton kernels by name: _gemv_kernel, ...)


def _kernel_families(prof) -> dict[int, dict[str, list[float]]]:
    """A profile's CUDA activity: per device index, per family, [microseconds, launches]."""
    per_dev: dict[int, dict[str, list[float]]] = {}
    for ev in prof.events():
        if str(getattr(ev, "device_type", "")).split(".")[-1] != "CUDA":
            continue
        fam = per_dev.setdefault(ev.device_index, {}).setdefault(_family(ev.name), [0.0, 0])
        fam[0] += ev.device_time
        fam[1] += 1
    return per_dev


def _per_step(fams: dict[str, list[float]], steps: int, top: int) -> dict:
    """One device's families over ``steps`` steps: all kernels' time per step, the ``top``
    families' time and launches per step."""
    rows = sorted(fams.items(), key=lambda kv: -kv[1][0])
    return {"kernel_us_per_step": round(sum(v[0] for v in fams.values()) / steps, 1),
            "families": [{"name": k, "us_per_step": round(v[0] / steps, 1),
                          "launches_per_step": round(v[1] / steps, 1)} for k, v in rows[:top]]}


def profiled(loop, eng: Engine, rounds, new: int, start_s: float, window_s: float) -> dict:
    """One more run of ``rounds`` with ``torch.profiler`` (CUDA activity) on from ``start_s``
    into the run for ``window_s``: per device, its kernels' time per step of the window by
    family, against the wall time per step (steps launched in the window, from a Timeline;
    how many of them computed prompt tokens is reported with them)."""
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CUDA])
    with profile(activities=[ProfilerActivity.CUDA]):  # (the profiler's own start-up, outside the run)
        torch.zeros(1, device="cuda").add_(1)
        torch.cuda.synchronize()
    marks: list[float] = []
    tls = []

    def start():
        prof.start()
        marks.append(time.perf_counter())

    def stop():
        if len(marks) == 1:
            marks.append(time.perf_counter())
            prof.stop()

    def on_start(lp, tl):
        tls.append(tl)
        lp.call_later(start_s, start)
        lp.call_later(start_s + window_s, stop)

    res = measure(loop, eng, rounds, new, True, on_start)
    if len(marks) < 1:
        return {"error": f"the run ended ({res['seconds']} s) before the window"}
    stop()
    t0, t1 = marks
    out = {"run": {k: res[k] for k in ("seconds", "out_tok_s", "steps")}, "window_s": round(t1 - t0, 3)}
    per_dev = _kernel_families(prof)
    devices = [torch.device(rep.worker.device).index for rep in eng.replicas]
    for r, steps in enumerate(tls[0].steps):
        inside = [s for s in steps if t0 <= s[0] <= t1]
        n = max(1, len(inside))
        out[f"replica{r}"] = {
            "steps": len(inside), "prefill_steps": sum(1 for s in inside if s[2] != s[3]),
            "batch": round(statistics.mean(s[3] for s in inside), 1) if inside else 0,
            "wall_us_per_step": round(1e6 * (t1 - t0) / n, 1),
            **_per_step(per_dev.get(devices[r], {}), n, 18)}
    return out


def best_of(loop, eng, rounds, new, reps: int, timeline: bool = False) -> dict:
    runs = [measure(loop, eng, rounds, new, timeline) for _ in range(reps)]
    best = max(runs, key=lambda r: r["out_tok_s"])
    return {**best, "runs_out_tok_s": [r["out_tok_s"] for r in runs]}


# ----------------------------------------------------------------------------- sections


def _shared(rng: random.Random, run: Run, w: dict, groups: list[int] | None = None) -> list[list[int]]:
    """Every group's prompts (system prompt + a question), all at once, groups interleaved;
    ``groups`` (if given) receives each prompt's group."""
    systems = [[rng.randrange(100, run.vocab_hi) for _ in range(w["system"])] for _ in range(w["groups"])]
    shared = [(g, s + [rng.randrange(100, run.vocab_hi) for _ in range(w["question"])])
              for g, s in enumerate(systems) for _ in range(w["per_group"])]
    rng.shuffle(shared)
    if groups is not None:
        groups[:] = [g for g, _ in shared]
    return [p for _, p in shared]


def _pressure(rng: random.Random, run: Run, p: dict) -> list[list[list[int]]]:
    """Rounds of one question per system prompt, each round shuffled."""
    psys = [[rng.randrange(100, run.vocab_hi) for _ in range(p["system"])] for _ in range(p["groups"])]
    rounds = []
    for _ in range(p["rounds"]):
        rnd = [s + [rng.randrange(100, run.vocab_hi) for _ in range(p["question"])] for s in psys]
        rng.shuffle(rnd)
        rounds.append(rnd)
    return rounds


def workloads(run: Run) -> dict:
    """name -> (rounds of prompts, new tokens, spec), for the names --dp-workloads asks."""
    w, p, b = SHARED[run.size], PRESSURE[run.size], BENCH_SHARED[run.size]

    def pressure():  # (drawn after shared_prefix's prompts from one generator, as always)
        rng = random.Random(3)
        _shared(rng, run, w)
        return _pressure(rng, run, p)

    build = {"shared_prefix": lambda: ([_shared(random.Random(3), run, w)], w["new"], w),
             "prefix_pressure": lambda: (pressure(), p["new"], p),
             "bench_shared_prefix": lambda: ([_shared(random.Random(4), run, b)], b["new"], b)}
    return {name: build[name]() for name in run.args.dp_workloads.split(",")}


def replicas_section(run: Run, res: dict) -> None:
    """One GPU: the share of a dp=2 run that one replica serves under each router, cascade
    attention off and on. Cache-aware routing keeps a group's requests together (replica 0:
    the even groups), round robin deals every other request. Each share runs alone from
    empty caches (a dp=2 replica runs alone on its GPU, but the two replicas share one
    process's host loop, which this does not)."""
    names = [n for n in run.args.dp_workloads.split(",") if n in ("shared_prefix", "bench_shared_prefix")]
    specs = {"shared_prefix": (SHARED[run.size], 3), "bench_shared_prefix": (BENCH_SHARED[run.size], 4)}
    loop = asyncio.new_event_loop()
    warm = [[5, 6, 7, 8, 9] * 4] * 2

    def shares(eng, cascade: bool):
        loop.run_until_complete(run_batch(eng, warm, 4))
        for name in names:
            w, seed = specs[name]
            groups: list[int] = []
            prompts = _shared(random.Random(seed), run, w, groups)
            parts = {"whole": prompts,
                     "cache_aware_share": [p for p, g in zip(prompts, groups, strict=True) if g % 2 == 0],
                     "round_robin_share": prompts[0::2]}
            out = res.setdefault(name, {"workload": w}).setdefault("cascade" if cascade else "plain", {})
            for part, ps in parts.items():
                out[part] = best_of(loop, eng, [ps], w["new"], 1, run.args.timeline)
                run.log(f"replicas {name} cascade={cascade} {part}: {json.dumps(out[part])}")
                run.save()
            out["cache_aware_over_round_robin"] = round(
                out["round_robin_share"]["seconds"] / out["cache_aware_share"]["seconds"], 3)
            run.log(f"replicas {name} cascade={cascade}: cache_aware/round_robin (share time) "
                    f"{out['cache_aware_over_round_robin']}x")

    try:
        for cascade in (False, True):
            run.with_engine(loop, lambda eng, c=cascade: shares(eng, c), cascade_attention=cascade)
    finally:
        loop.close()
    for name in names:
        r = res[name]
        r["cascade_over_plain_whole"] = round(r["plain"]["whole"]["seconds"] / r["cascade"]["whole"]["seconds"], 3)
        run.log(f"replicas {name}: cascade/plain on the whole workload {r['cascade_over_plain_whole']}x")


def dp_section(run: Run, res: dict) -> None:
    loads = workloads(run)
    reps = 2 if run.size == "full" else 1
    res["workloads"] = {name: spec for name, (_, _, spec) in loads.items()}
    loop = asyncio.new_event_loop()
    warm = [[5, 6, 7, 8, 9] * 4] * 2

    def one_gpu(eng):
        loop.run_until_complete(run_batch(eng, warm, 4))
        for name, (rounds, new, _) in loads.items():
            # one GPU under prefix_pressure recomputes most prefixes (about 40 s on an
            # H200): one run keeps the whole call under 4 minutes
            r = best_of(loop, eng, rounds, new, 1 if name == "prefix_pressure" else reps, run.args.timeline)
            res.setdefault(name, {})["one_gpu"] = r
            run.log(f"dp {name} one_gpu: {json.dumps(r)}")
            run.save()

    def dp2(eng):
        loop.run_until_complete(run_batch(eng, warm * 2, 4))
        for name, (rounds, new, _) in loads.items():
            for policy in ("cache_aware", "round_robin"):
                eng.router.policy = policy
                r = best_of(loop, eng, rounds, new, reps, run.args.timeline)
                res[name][f"dp2_{policy}"] = r
                run.log(f"dp {name} dp2 {policy}: {json.dumps(r)}")
                run.save()
            if run.args.profile_window and not run.cpu:
                start_s, window_s = run.args.profile_window
                for policy in ("cache_aware", "round_robin"):
                    eng.router.policy = policy
                    try:
                        r = profiled(loop, eng, rounds, new, start_s, window_s)
                    except Exception as exc:  # (the throughput figures above stand)
                        run.log(traceback.format_exc())
                        r = {"error": repr(exc)}
                    res[name][f"dp2_{policy}_profile"] = r
                    run.log(f"dp {name} dp2 {policy} profile: {json.dumps(r)}")
                    run.save()

    try:
        run.with_engine(loop, one_gpu)
        run.with_engine(loop, dp2, dp_size=2, routing="cache_aware")
    finally:
        loop.close()
    for name in loads:
        c = res[name]
        one, ca, rr = c["one_gpu"], c["dp2_cache_aware"], c["dp2_round_robin"]
        c["dp2_over_one_gpu"] = round(ca["out_tok_s"] / one["out_tok_s"], 3)
        c["cache_aware_over_round_robin"] = round(ca["out_tok_s"] / rr["out_tok_s"], 3)
        c["hit_rate_points_vs_one_gpu"] = round(100 * (ca["hit_rate"] - one["hit_rate"]), 2)
        run.log(f"dp {name}: dp2/one {c['dp2_over_one_gpu']}x, cache_aware/round_robin "
                f"{c['cache_aware_over_round_robin']}x, hit rate {ca['hit_rate']} vs one GPU {one['hit_rate']}")


def decode_batch1(loop, eng: Engine, run: Run) -> dict:
    d = DECODE[run.size]
    rng = random.Random(11)
    prompt = [rng.randrange(100, run.vocab_hi) for _ in range(d["prompt"])]
    rates = []
    for _ in range(d["reps"]):
        r = loop.run_until_complete(run_batch(eng, [prompt], d["new"]))
        rates.append((d["new"] - 1) / (r["ends"][0] - r["firsts"][0]))
    checks = [[rng.randrange(100, run.vocab_hi) for _ in range(64 + 37 * i)] for i in range(d["check_prompts"])]
    ref = loop.run_until_complete(run_batch(eng, checks, d["check_new"], logprobs=True))
    return {"decode_tok_s": round(statistics.median(rates), 1), "reps_tok_s": [round(x, 1) for x in rates],
            "tokens": ref["tokens"], "logprobs": ref["logprobs"]}


def tp_section(run: Run, res: dict) -> None:
    loop = asyncio.new_event_loop()
    kw = {} if run.cpu else dict(max_running_requests=16)
    runs = [("tp1", dict(tp_size=1)), ("tp2", dict(tp_size=2))]
    if not run.cpu:  # the same tp=2 with NCCL for every all-reduce (no peer-to-peer kernel)
        runs.append(("tp2_nccl", dict(tp_size=2, peer_all_reduce=False)))
    out = {}

    def measure_decode(eng):
        loop.run_until_complete(run_batch(eng, [[5, 6, 7, 8, 9] * 4], 4))
        r = decode_batch1(loop, eng, run)
        r["cuda_graphs"] = bool(eng.worker.graphs)
        peer = getattr(eng.worker, "peer", None)
        if peer is not None:
            r["peer_all_reduce"] = True
            r["peer_wait_timeouts"] = peer.check()
        return r

    try:
        for name, cfg in runs:
            out[name] = run.with_engine(loop, measure_decode, **cfg, **kw)
            res[name] = {k: v for k, v in out[name].items() if k not in ("tokens", "logprobs")}
            run.log(f"{name}: {json.dumps(res[name])}")
            run.save()
    finally:
        loop.close()
    for name in out:
        if name != "tp1":
            res[f"{name}_over_tp1"] = round(out[name]["decode_tok_s"] / out["tp1"]["decode_tok_s"], 3)
            cases = []
            for t1, t2, l1, l2 in zip(out["tp1"]["tokens"], out[name]["tokens"], out["tp1"]["logprobs"],
                                      out[name]["logprobs"], strict=True):
                same = next((i for i, (a, b) in enumerate(zip(t1, t2, strict=True)) if a != b), len(t1))
                diffs = [abs(a - b) for a, b in zip(l1[:same], l2[:same], strict=True)]
                cases.append({"steps": len(t1), "equal_prefix": same,
                              "max_logprob_diff": round(max(diffs, default=0.0), 4)})
            res[f"greedy_{name}_vs_tp1"] = cases
            run.log(f"tp: {name}/tp1 {res[f'{name}_over_tp1']}x; greedy {name} vs tp1 {json.dumps(cases)}")


def allreduce_section(run: Run, res: dict) -> None:
    """Time per all-reduce of a decode step's partial (batch 1 and 64, hidden 4096, bf16):
    the peer-to-peer kernel vs NCCL, 64 calls per CUDA graph replay on each GPU (as a step
    of the 8B model makes), both GPUs replaying together."""
    if run.cpu:
        res["skipped"] = "CUDA only"
        return
    import concurrent.futures

    from radixd.core.nccl import Nccl
    from radixd.core.peer_allreduce import PeerAllReduce, enable_peer_access

    devices = [torch.device("cuda", 0), torch.device("cuda", 1)]
    if not enable_peer_access(devices):
        res["skipped"] = "no peer access between the GPUs"
        return
    peer = PeerAllReduce(devices, torch.bfloat16)
    nccl = Nccl()
    uid = nccl.unique_id()
    pool = concurrent.futures.ThreadPoolExecutor(2)
    comms = list(pool.map(lambda r: (torch.cuda.set_device(r), nccl.init_rank(2, uid, r))[1], range(2)))
    calls, replays = 64, 50

    def timed(r: int, n: int, kind: str) -> float:
        torch.cuda.set_device(r)
        x = torch.ones(n, dtype=torch.bfloat16, device=f"cuda:{r}")
        reduce = (lambda t: peer.all_reduce(r, t)) if kind == "peer" else comms[r].all_reduce
        reduce(x)
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=stream, capture_error_mode="thread_local"):
                for _ in range(calls):
                    x.mul_(0.5)
                    reduce(x)
            g.replay()
            stream.synchronize()
            t0 = time.perf_counter()
            for _ in range(replays):
                g.replay()
            stream.synchronize()
        return (time.perf_counter() - t0) / (replays * calls) * 1e6

    for rows in (1, 64):
        n = rows * 4096
        for kind in ("peer", "nccl"):
            us = max(pool.map(timed, range(2), [n] * 2, [kind] * 2))
            res[f"{kind}_us_batch{rows}"] = round(us, 2)
            run.log(f"allreduce {kind} batch {rows} ({n * 2} bytes): {us:.2f} us per call (incl. a scale kernel)")
    res["peer_wait_timeouts"] = peer.check()
    for c in comms:
        c.close()
    pool.shutdown()


def tpprofile_section(run: Run, res: dict) -> None:
    """Where a tp=2 batch-1 decode step's time goes: 64 steps through the engine (CUDA
    graphs) under ``torch.profiler``; per GPU, kernel time per step by family against the
    wall time per step (what is left is time no kernel runs on that GPU)."""
    if run.cpu:
        res["skipped"] = "CUDA only"
        return
    from torch.profiler import ProfilerActivity, profile

    loop = asyncio.new_event_loop()
    try:
        for tp in (1, 2):
            def one(eng, tp=tp):
                return profile_decode(loop, eng, run, tp, ProfilerActivity, profile)

            res[f"tp{tp}"] = run.with_engine(loop, one, tp_size=tp, max_running_requests=16)
    finally:
        loop.close()


def profile_decode(loop, eng, run: Run, tp: int, ProfilerActivity, profile) -> dict:
    rng = random.Random(5)
    prompt = [rng.randrange(100, run.vocab_hi) for _ in range(512)]
    loop.run_until_complete(run_batch(eng, [prompt], 32))
    steps = 64
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        r = loop.run_until_complete(run_batch(eng, [prompt], steps + 1))
        for d in range(tp):
            torch.cuda.synchronize(d)
    wall = (r["ends"][0] - r["firsts"][0]) / steps
    out = {"wall_us_per_step": round(wall * 1e6, 1),
           "note": "kernel times per step include one 512-token prefill spread over the 65 steps"}
    for dev, fams in sorted(_kernel_families(prof).items()):
        out[f"gpu{dev}"] = _per_step(fams, steps + 1, 14)
    run.log(f"tpprofile tp{tp}: {json.dumps(out)}")
    return out


SECTIONS = {"dp": dp_section, "tp": tp_section, "allreduce": allreduce_section, "tpprofile": tpprofile_section,
            "replicas": replicas_section}
ONE_GPU_SECTIONS = {"replicas"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="llama3-8b", choices=["llama3-8b"])
    ap.add_argument("--sections", default="dp,tp")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a smoke run with tiny shapes")
    ap.add_argument("--quick", action="store_true", help="small workloads (a smoke run on GPUs)")
    ap.add_argument("--size", choices=["full", "medium", "quick"], default=None,
                    help="workload sizes (default: full on cuda, quick on cpu or with --quick)")
    ap.add_argument("--stream-interval", type=int, default=1,
                    help="the engines' stream_interval (tokens per update each consumer task is woken for)")
    ap.add_argument("--dp-workloads", default="shared_prefix,prefix_pressure",
                    help="dp section: some of shared_prefix, prefix_pressure, bench_shared_prefix (radixd "
                         "bench's shared-prefix workload at its defaults)")
    ap.add_argument("--timeline", action="store_true",
                    help="dp/replicas runs: each replica's steps from the host (decode vs prefill time, idle)")
    ap.add_argument("--profile-window", type=lambda v: tuple(float(x) for x in v.split(",")), default=None,
                    metavar="START,SECONDS",
                    help="dp section (CUDA): one more dp=2 run per router with torch.profiler on for SECONDS "
                         "from START seconds in: kernel time per step by family on each GPU")
    ap.add_argument("--switch-interval", type=float, default=None,
                    help="sys.setswitchinterval (seconds) for the run (Python's default 0.005)")
    ap.add_argument("--gc", choices=["on", "off"], default="on",
                    help="off: leave Python's garbage collector untuned (engine gc_freeze/gc_threshold)")
    ap.add_argument("--cascade", choices=["on", "off"], default="on",
                    help="cascade attention in the dp and tp sections' engines (the config's default: on)")
    ap.add_argument("--kv-tokens", type=int, default=None,
                    help="KV pool tokens per engine (replica) in every section (default: prefix_pressure's, "
                         "80k at full size; 0: sized from free memory)")
    ap.add_argument("--max-seconds", type=int, default=540,
                    help="dump every thread's stack to OUT/stacks.txt and exit after this long (a hang, "
                         "e.g. in NCCL, still leaves the results so far)")
    args = ap.parse_args()
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    run = Run(args)
    stacks = open(run.out / "stacks.txt", "w")
    faulthandler.dump_traceback_later(args.max_seconds, exit=True, file=stacks)
    run.log(f"== multi_gpu_bench {time.strftime('%Y-%m-%d %H:%M:%S')} {json.dumps(run.results['env'])}")
    run.save()
    if not run.cpu and torch.cuda.device_count() < 2 and not set(args.sections.split(",")) <= ONE_GPU_SECTIONS:
        run.results["error"] = f"needs 2 CUDA devices, sees {torch.cuda.device_count()}"
        run.log(run.results["error"])
        run.save()
        return 2
    status = 0
    for name in args.sections.split(","):
        t = time.perf_counter()
        res = run.results["sections"].setdefault(name, {})
        try:
            SECTIONS[name](run, res)
        except Exception as exc:
            run.log(traceback.format_exc())
            res["error"] = repr(exc)
            status = 1
        res["section_s"] = round(time.perf_counter() - t, 1)
        run.log(f"== {name} done in {res['section_s']}s")
        run.save()
    faulthandler.cancel_dump_traceback_later()
    return status


if __name__ == "__main__":
    sys.exit(main())
