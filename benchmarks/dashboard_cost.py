"""What an open dashboard costs: one daemon (default model, ``[server] dashboard = true``),
the CPU shared-prefix workload through ``radixd bench``, windows with a dashboard viewer
reading ``/dashboard/events`` and without, in the order open, closed, closed, open (repeated).

    python -m benchmarks.dashboard_cost [--rounds 2] [--out benchmarks/results/dashboard/dashboard_cost.json]

The workload: 4 groups x 8 prompts sharing a 512-token system prompt, 32-token questions,
32 new tokens, concurrency 8, over ``/v1/completions`` (``radixd bench``'s shared-prefix
workload; the cache is flushed before each run). A viewer is what the page does: one SSE
stream, each snapshot parsed as JSON.

On a shared 2-core machine one run's req/s moves by tens of percent with what else runs, so
the figures are paired: each window is compared with the adjacent window of the other kind
(``--rounds`` R gives 2R pairs), and the figure is the median of the pairs' ratios, with
their spread. Beside wall-clock req/s, each window records the daemon's CPU time per request
(``/proc/<pid>/stat`` utime + stime, all its threads), its event loop thread's alone (where
the feed is built, encoded and sent), the viewer's own CPU time and the steal time of the
machine (``/proc/stat``: a virtual machine's CPUs taken by its host). Prints one JSON line
per window, then the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from benchmarks.common import RESULTS, environment, write_json
from benchmarks.http_vs_inprocess import start_daemon

BENCH = ["--target", "http", "--api", "completions", "--workload", "shared-prefix", "--groups", "4",
         "--prompts-per-group", "8", "--system-len", "512", "--question-len", "32", "--output-len", "32",
         "--max-concurrency", "8", "--no-progress"]
REQUESTS = 32  # 4 groups x 8 prompts
TICK = os.sysconf("SC_CLK_TCK")


class Viewer:
    """One dashboard tab: reads the feed until stopped, counting the snapshots it parsed and
    the CPU time its thread spent."""

    def __init__(self, url: str):
        self.url, self.snapshots, self.cpu_s, self._stop = url, 0, 0.0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Viewer:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        t0 = time.thread_time()
        with httpx.stream("GET", self.url + "/dashboard/events", timeout=None) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if line.startswith("data:"):
                    json.loads(line[5:])
                    self.snapshots += 1
                self.cpu_s = time.thread_time() - t0
                if self._stop.is_set():
                    return


def cpu_seconds(pid: int, tid: int | None = None) -> float:
    """utime + stime of a process (or of one of its threads)."""
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    fields = Path(path).read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def thread_seconds(pid: int) -> dict[int, float]:
    """utime + stime of each thread of a process, by thread id."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            out[int(tid)] = cpu_seconds(pid, int(tid))
        except OSError:  # a thread that ended meanwhile
            pass
    return out


def thread_deltas(before: dict[int, float], after: dict[int, float]) -> list[float]:
    """The threads' CPU seconds between two ``thread_seconds``, largest first (those over 0.1 s)."""
    return sorted((d for tid, t in after.items() if (d := round(t - before.get(tid, 0.0), 2)) >= 0.1), reverse=True)


def steal_seconds() -> float:
    return int(Path("/proc/stat").read_text().split("\n", 1)[0].split()[8]) / TICK


def run_bench(url: str, out: Path) -> dict:
    subprocess.run([sys.executable, "-m", "radixd", "bench", "--url", url, *BENCH, "--output", str(out)],
                   check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())["figures"]


def window(url: str, pid: int, out: Path, open_: bool) -> dict:
    """One bench run, with a viewer reading the feed throughout when ``open_``."""
    cpu0, loop0, steal0, threads0 = cpu_seconds(pid), cpu_seconds(pid, pid), steal_seconds(), thread_seconds(pid)
    if open_:
        with Viewer(url) as v:
            fig = run_bench(url, out)
        snapshots, viewer_cpu = v.snapshots, v.cpu_s
    else:
        fig, snapshots, viewer_cpu = run_bench(url, out), 0, 0.0
    done = REQUESTS - fig["failed"]
    return {"dashboard_open": open_, "req_s": fig["request_throughput"], "failed": fig["failed"],
            "snapshots_read": snapshots, "duration_s": fig["duration_s"],
            "daemon_cpu_s_per_req": (cpu_seconds(pid) - cpu0) / done,
            "loop_cpu_s_per_req": (cpu_seconds(pid, pid) - loop0) / done,
            "viewer_cpu_s": viewer_cpu, "steal_s": steal_seconds() - steal0,
            "threads_cpu_s": thread_deltas(threads0, thread_seconds(pid))}


def pair_ratios(runs: list[dict], key: str) -> list[float]:
    """``key`` of each open window over its adjacent closed one (windows 0-1, 2-3, ...: the
    order open, closed, closed, open puts one of each kind in every pair)."""
    out = []
    for a, b in zip(runs[::2], runs[1::2], strict=False):
        o, c = (a, b) if a["dashboard_open"] else (b, a)
        out.append(o[key] / c[key])
    return out


def spread(xs: list[float]) -> dict:
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return {"median": round(statistics.median(xs), 4), "q1": round(q[0], 4), "q3": round(q[2], 4),
            "min": round(min(xs), 4), "max": round(max(xs), 4), "n": len(xs)}


def figures(runs: list[dict]) -> dict:
    """The paired figures; the medians of each kind beside them, as before pairing."""
    def median(key: str, open_: bool) -> float:
        return statistics.median(r[key] for r in runs if r["dashboard_open"] == open_)

    opened, closed = median("req_s", True), median("req_s", False)
    open_loop, closed_loop = median("loop_cpu_s_per_req", True), median("loop_cpu_s_per_req", False)
    closed_cpu = median("daemon_cpu_s_per_req", False)
    return {
        "open_over_closed_pairs": spread(pair_ratios(runs, "req_s")),
        "daemon_cpu_per_req_open_over_closed_pairs": spread(pair_ratios(runs, "daemon_cpu_s_per_req")),
        # the feed's own work, on the loop thread: its CPU time per request, as a share of the daemon's
        "loop_cpu_added_share": round((open_loop - closed_loop) / closed_cpu, 4),
        "viewer_cpu_s_per_window": round(median("viewer_cpu_s", True), 3),
        "open_req_s_median": round(opened, 4), "closed_req_s_median": round(closed, 4),
        "open_over_closed": round(opened / closed, 4),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2, help="repeats of open, closed, closed, open")
    ap.add_argument("--out", default=str(RESULTS / "dashboard" / "dashboard_cost.json"))
    a = ap.parse_args()
    proc, url, tmp = start_daemon(8, server_keys="dashboard = true\n")
    runs: list[dict] = []
    try:
        run_bench(url, Path(tempfile.mkdtemp()) / "warm.json")  # the first run pays for compiles and caches
        for i, open_ in enumerate([True, False, False, True] * a.rounds):
            runs.append(window(url, proc.pid, Path(tmp) / f"run{i}.json", open_))
            print(json.dumps(runs[-1]), flush=True)
    finally:
        proc.terminate()
        proc.wait(60)
    result = {"config": {"rounds": a.rounds}, "bench_args": BENCH, "runs": runs, **figures(runs),
              "environment": environment()}
    write_json(a.out, result)
    print(json.dumps(figures(runs)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
