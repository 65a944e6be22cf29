"""Why radixd's req/s on the CPU moves from run to run: daemons on the default model, one per
variant in turn (a variant is environment settings, e.g. ``OMP_NUM_THREADS=1``), each given
the CPU shared-prefix workload (``benchmarks.dashboard_cost``'s) through ``radixd bench``
several times; with ``--hog`` every second run has a busy loop (one core's worth of other
work) running beside it.

    python -m benchmarks.cpu_spread --variant OMP_NUM_THREADS=2 --variant OMP_NUM_THREADS=1 \\
        [--daemons 2] [--runs 2] [--hog] [--out benchmarks/results/cpu_spread/cpu_spread.json]

Each run records what could move its req/s: the daemon's CPU time per request and each of
its threads' (``/proc/<pid>/task``: the event loop, the worker, OpenMP's), the steal time of
the machine (a virtual machine's CPUs taken by its host), the CPU time of everything else on
the machine, the client's, the scheduler's steps and tokens (the dashboard feed's counters:
the batches it formed) and the garbage collector's pauses. Prints one JSON line per run,
then per variant the median req/s and the spread of its runs (max / min - 1).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

import httpx

from benchmarks.common import RESULTS, environment, write_json
from benchmarks.dashboard_cost import (
    REQUESTS,
    TICK,
    cpu_seconds,
    run_bench,
    steal_seconds,
    thread_deltas,
    thread_seconds,
)
from benchmarks.http_vs_inprocess import start_daemon


def machine_busy_seconds() -> float:
    """CPU time spent by everything on the machine (user, nice, system, irq, softirq)."""
    f = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (f[0] + f[1] + f[2] + f[5] + f[6]) / TICK


def children_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def counters(url: str) -> dict:
    """The engine's counters, from one snapshot of the dashboard feed."""
    with httpx.stream("GET", url + "/dashboard/events", timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                return json.loads(line[5:])["stats"]
    raise RuntimeError("the feed ended before a snapshot")


@contextmanager
def environ(settings: dict[str, str]):
    saved = dict(os.environ)
    os.environ.update(settings)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def one_run(url: str, pid: int, out: Path, hog: bool) -> dict:
    before, threads0 = counters(url), thread_seconds(pid)
    cpu0, steal0, busy0, kids0 = cpu_seconds(pid), steal_seconds(), machine_busy_seconds(), children_seconds()
    loop = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if hog else None
    try:
        fig = run_bench(url, out)
    finally:
        if loop is not None:
            loop.kill()
            loop.wait()
    cpu, steal, busy, kids = (cpu_seconds(pid) - cpu0, steal_seconds() - steal0, machine_busy_seconds() - busy0,
                              children_seconds() - kids0)
    threads1, after = thread_seconds(pid), counters(url)
    return {"hog": hog, "req_s": fig["request_throughput"], "failed": fig["failed"], "duration_s": fig["duration_s"],
            "daemon_cpu_s_per_req": cpu / REQUESTS, "threads_cpu_s": thread_deltas(threads0, threads1),
            "steal_s": steal, "client_and_hog_cpu_s": kids, "others_cpu_s": busy - cpu - kids,
            **{k: after[k] - before[k] for k in ("steps", "prefill_tokens", "decode_tokens")},
            "gc_collections": after["gc"]["collections"] - before["gc"]["collections"],
            "gc_pause_s": after["gc"]["pause_seconds"] - before["gc"]["pause_seconds"]}


def summary(runs: list[dict]) -> dict:
    q = [r["req_s"] for r in runs]
    return {"runs": len(q), "req_s_median": round(statistics.median(q), 4), "min": round(min(q), 4),
            "max": round(max(q), 4), "spread": round(max(q) / min(q) - 1, 4)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", action="append", default=[],
                    help="space-separated NAME=VALUE settings of one variant's daemon (repeat; none: as shipped)")
    ap.add_argument("--daemons", type=int, default=2, help="fresh daemons per variant, variants taking turns")
    ap.add_argument("--runs", type=int, default=3, help="bench runs per daemon (after one warm-up run)")
    ap.add_argument("--hog", action="store_true", help="a busy loop beside every second run")
    ap.add_argument("--out", default=str(RESULTS / "cpu_spread" / "cpu_spread.json"))
    a = ap.parse_args()
    variants = a.variant or [""]
    runs: list[dict] = []
    for d in range(a.daemons):
        for v in variants:
            with environ(dict(kv.split("=", 1) for kv in v.split())):
                proc, url, tmp = start_daemon(8, server_keys="dashboard = true\n")
            try:
                run_bench(url, Path(tempfile.mkdtemp()) / "warm.json")  # compiles and caches
                for i in range(a.runs):
                    r = {"variant": v, "daemon": d, **one_run(url, proc.pid, Path(tmp) / f"run{i}.json",
                                                              a.hog and i % 2 == 1)}
                    runs.append(r)
                    print(json.dumps(r), flush=True)
            finally:
                proc.terminate()
                proc.wait(60)
    figures = {f"{v or 'as shipped'}{', busy loop' if hog else ''}": summary(sel)
               for v in variants for hog in (False, True)
               if (sel := [r for r in runs if r["variant"] == v and r["hog"] == hog])}
    write_json(a.out, {"config": {"variants": variants, "daemons": a.daemons, "runs": a.runs, "hog": a.hog},
                       "runs": runs, "figures": figures, "environment": environment()})
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
