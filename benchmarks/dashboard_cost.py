"""What an open dashboard costs: one daemon (default model, ``[server] dashboard = true``),
the CPU shared-prefix workload through ``radixd bench``, windows with a dashboard viewer
reading ``/dashboard/events`` and without, in the order open, closed, closed, open (repeated).

    python -m benchmarks.dashboard_cost [--rounds 2] [--viewer-nice 19]
                                        [--out benchmarks/results/dashboard/dashboard_cost.json]
    python -m benchmarks.dashboard_cost --in-process [--runs 3] [--baseline OLD_dashboard.py]

The workload: 4 groups x 8 prompts sharing a 512-token system prompt, 32-token questions,
32 new tokens, concurrency 8, over ``/v1/completions`` (``radixd bench``'s shared-prefix
workload, run by ``radixd.bench.main`` in this process: no interpreter start between windows;
the cache is flushed and one warm-up request sent before each run, as ``radixd bench`` does).

The viewer is what a browser tab does: one SSE stream, every snapshot read and parsed as
JSON. It runs as its own process, by default at ``nice 19``: on a 2-core machine a viewer at
the daemon's priority takes its parsing time (about 1% of a core) from the daemon, which a
real viewer, another machine's browser, does not. Each open window records what the viewer
read: snapshots, its CPU time, and the largest gap between the build times of consecutive
snapshots (a viewer that falls behind would see gaps well over the 0.25 s interval, and the
daemon would then build fewer snapshots: the window is flagged ``viewer_lagged``).

On a shared 2-core machine one run's req/s moves by several percent with what else runs, so
the figures are paired: each window is compared with the adjacent window of the other kind
(``--rounds`` R gives 2R pairs, half of them open first). The figure is the median of the
pairs' open/closed ratios with a distribution-free confidence interval (sign test: order
statistics of the ratios whose binomial coverage is at least 95%) and a one-sided 95% lower
bound; ``ci_half_width_pairs_needed`` estimates how many pairs would bring the interval to
+-1% at the spread seen. Beside wall-clock req/s, each window records the daemon's CPU time
per request (``/proc/<pid>/stat`` utime + stime, all its threads), its event loop thread's
alone (where the feed is built, encoded and sent), the steal time of the machine
(``/proc/stat``: a virtual machine's CPUs taken by its host) and the CPU time of everything
else on it (``others_cpu_s``: the machine's busy time less the daemon's, the bench client's
and the viewer's), to tell a quiet run from a disturbed one. Prints one JSON line per
window, then the figures.

``--in-process``: the feed's own work, without HTTP: the engine in this process runs the
same workload (``--runs`` times, the daemon's KV pool and batch size) while a ticker takes
the feed's next SSE event every 0.25 s, timing each (wall and thread CPU), and parses it as
a viewer would (timed apart). ``--baseline FILE``: another version of
``radixd/server/dashboard.py`` (``git show REV:radixd/server/dashboard.py > FILE``) fed the
same steps, its ticks between this one's (each snapshot is the first work after the loop
woke, as a feed's tick is in the daemon: on this VM that first work runs several times
slower than the same work straight after other work).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import io
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import RESULTS, environment, write_json
from benchmarks.http_vs_inprocess import KV_TOKENS, start_daemon

BENCH = ["--target", "http", "--api", "completions", "--workload", "shared-prefix", "--groups", "4",
         "--prompts-per-group", "8", "--system-len", "512", "--question-len", "32", "--output-len", "32",
         "--max-concurrency", "8", "--no-progress"]
REQUESTS = 32  # 4 groups x 8 prompts
STREAMS = 8
TICK = os.sysconf("SC_CLK_TCK")
INTERVAL_S = 0.25  # the feed's (radixd.server.dashboard.INTERVAL_S)
LAG_GAP_S = 2 * INTERVAL_S  # a larger gap between two snapshots read: the viewer fell behind


# ------------------------------------------------------------------ the viewer


def viewer_main(url: str, nice: int) -> int:
    """The viewer process: read and parse every snapshot of the feed; "ready" on stdout after
    the first, then on SIGTERM one JSON line of what it read."""
    import httpx

    os.nice(nice)
    stop = False

    def on_term(*_):
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    n, nbytes, last, max_gap, cpu0 = 0, 0, None, 0.0, 0.0
    with httpx.stream("GET", url + "/dashboard/events", timeout=None) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data:"):
                continue
            snap = json.loads(line[5:])
            if n == 0:
                cpu0 = time.process_time()  # from the first snapshot on: not the start-up
                print("ready", flush=True)
            else:
                max_gap = max(max_gap, snap["time"] - last)
                nbytes += len(line)
            n += 1
            last = snap["time"]
            if stop:
                break
    print(json.dumps({"snapshots": n - 1, "cpu_s": round(time.process_time() - cpu0, 3),
                      "max_gap_s": round(max_gap, 3), "bytes": nbytes}), flush=True)
    return 0


class Viewer:
    """A viewer process for the length of a ``with`` block (its first snapshot read before
    the block starts)."""

    def __init__(self, url: str, nice: int):
        self.url, self.nice, self.result = url, nice, None

    def __enter__(self) -> Viewer:
        self.proc = subprocess.Popen([sys.executable, "-m", "benchmarks.dashboard_cost", "--viewer", self.url,
                                      "--viewer-nice", str(self.nice)], stdout=subprocess.PIPE, text=True)
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError("the viewer read no snapshot")
        return self

    def __exit__(self, *exc) -> None:
        self.proc.send_signal(signal.SIGTERM)
        out, _ = self.proc.communicate(timeout=30)
        self.result = json.loads(out.strip().splitlines()[-1])


# ------------------------------------------------------------------ CPU time from /proc


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


def machine_seconds() -> tuple[float, float]:
    """The machine's busy CPU seconds (user, nice, system, irq, softirq) and steal seconds so far."""
    f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return (f[0] + f[1] + f[2] + f[5] + f[6]) / TICK, f[7] / TICK


# ------------------------------------------------------------------ windows over HTTP


def run_bench(url: str, out: Path) -> dict:
    """One ``radixd bench`` run (in this process); its figures."""
    from radixd.bench import add_arguments
    from radixd.bench import main as bench_main

    p = argparse.ArgumentParser()
    add_arguments(p)
    argv = ["--url", url, *BENCH, "--output", str(out)]
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        rc = bench_main(p.parse_args(argv), argv)
    if rc != 0:
        raise RuntimeError(f"radixd bench exited {rc}")
    return json.loads(out.read_text())["figures"]


def window(url: str, pid: int, out: Path, open_: bool, nice: int) -> dict:
    """One bench run, with a viewer reading the feed throughout when ``open_``."""
    viewer = Viewer(url, nice) if open_ else contextlib.nullcontext()
    with viewer:
        cpu0, loop0, threads0 = cpu_seconds(pid), cpu_seconds(pid, pid), thread_seconds(pid)
        (busy0, steal0), me0, t0 = machine_seconds(), time.process_time(), time.monotonic()
        fig = run_bench(url, out)
        (busy1, steal1), me1, wall = machine_seconds(), time.process_time(), time.monotonic() - t0
        cpu1, loop1, threads1 = cpu_seconds(pid), cpu_seconds(pid, pid), thread_seconds(pid)
    done = REQUESTS - fig["failed"]
    seen = viewer.result if open_ else {"snapshots": 0, "cpu_s": 0.0, "max_gap_s": None, "bytes": 0}
    return {"dashboard_open": open_, "req_s": fig["request_throughput"], "failed": fig["failed"],
            "duration_s": fig["duration_s"], "window_s": round(wall, 2),
            "snapshots_read": seen["snapshots"], "snapshot_max_gap_s": seen["max_gap_s"],
            "viewer_lagged": bool(open_ and seen["max_gap_s"] > LAG_GAP_S), "viewer_cpu_s": seen["cpu_s"],
            "viewer_bytes": seen["bytes"],
            "daemon_cpu_s_per_req": (cpu1 - cpu0) / done, "loop_cpu_s_per_req": (loop1 - loop0) / done,
            "steal_s": round(steal1 - steal0, 2), "bench_client_cpu_s": round(me1 - me0, 2),
            # what else ran on the machine meanwhile (not the daemon, this process or the viewer)
            "others_cpu_s": round((busy1 - busy0) - (cpu1 - cpu0) - (me1 - me0) - seen["cpu_s"], 2),
            "threads_cpu_s": thread_deltas(threads0, threads1)}


def pair_ratios(runs: list[dict], key: str) -> list[float]:
    """``key`` of each open window over its adjacent closed one (windows 0-1, 2-3, ...: the
    order open, closed, closed, open puts one of each kind in every pair)."""
    out = []
    for a, b in zip(runs[::2], runs[1::2], strict=False):
        o, c = (a, b) if a["dashboard_open"] else (b, a)
        out.append(o[key] / c[key])
    return out


def _binom_cdf(k: int, n: int) -> float:
    """P(B <= k) for B ~ Binomial(n, 1/2)."""
    return sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n


def median_ci(xs: list[float], level: float = 0.95) -> dict:
    """The median of ``xs`` with a distribution-free confidence interval (the sign test's: the
    order statistics x(k) and x(n+1-k) for the largest k whose coverage 1 - 2 P(B < k) is at
    least ``level``), and the one-sided lower bound x(k) at ``level`` (P(B < k) <= 1 - level).
    None where ``xs`` has too few values for that level."""
    s, n = sorted(xs), len(xs)
    two = [k for k in range(1, n // 2 + 1) if 1 - 2 * _binom_cdf(k - 1, n) >= level]
    one = [k for k in range(1, n + 1) if _binom_cdf(k - 1, n) <= 1 - level]
    out = {"median": round(statistics.median(s), 4), "n": n, "ci": None, "ci_coverage": None, "lower": None}
    if two:
        k = max(two)
        out["ci"] = [round(s[k - 1], 4), round(s[n - k], 4)]
        out["ci_coverage"] = round(1 - 2 * _binom_cdf(k - 1, n), 4)
    if one:
        out["lower"] = round(s[max(one) - 1], 4)
    return out


def spread(xs: list[float]) -> dict:
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return {**median_ci(xs), "q1": round(q[0], 4), "q3": round(q[2], 4), "min": round(min(xs), 4),
            "max": round(max(xs), 4)}


def pairs_needed(xs: list[float], half_width: float = 0.01) -> int | None:
    """About how many pairs would bring the median's 95% interval to +-``half_width``, at the
    spread of ``xs`` (normal approximation: the median's standard error is 1.2533 sd / sqrt n)."""
    if len(xs) < 3:
        return None
    return math.ceil((1.96 * 1.2533 * statistics.stdev(xs) / half_width) ** 2)


def figures(runs: list[dict]) -> dict:
    """The paired figures; the medians of each kind beside them, as before pairing."""
    def median(key: str, open_: bool) -> float:
        return statistics.median(r[key] for r in runs if r["dashboard_open"] == open_)

    ratios = pair_ratios(runs, "req_s")
    open_loop, closed_loop = median("loop_cpu_s_per_req", True), median("loop_cpu_s_per_req", False)
    closed_cpu = median("daemon_cpu_s_per_req", False)
    opened = [r for r in runs if r["dashboard_open"]]
    return {
        "open_over_closed_pairs": spread(ratios),
        "ci_half_width_pairs_needed": pairs_needed(ratios),
        "daemon_cpu_per_req_open_over_closed_pairs": spread(pair_ratios(runs, "daemon_cpu_s_per_req")),
        # the feed's own work, on the loop thread: its CPU time per request, as a share of the daemon's
        "loop_cpu_added_s_per_req": round(open_loop - closed_loop, 5),
        "loop_cpu_added_share": round((open_loop - closed_loop) / closed_cpu, 4),
        "viewer_cpu_s_per_window": round(median("viewer_cpu_s", True), 3),
        "viewer_snapshots_per_s": round(statistics.median(r["snapshots_read"] / r["window_s"] for r in opened), 2),
        "windows_viewer_lagged": sum(r["viewer_lagged"] for r in opened),
        "steal_s_per_window_median": round(statistics.median(r["steal_s"] for r in runs), 2),
        "others_cpu_s_per_window_median": round(statistics.median(r["others_cpu_s"] for r in runs), 2),
        "open_req_s_median": round(median("req_s", True), 4), "closed_req_s_median": round(median("req_s", False), 4),
    }


def http_main(a: argparse.Namespace) -> int:
    proc, url, tmp = start_daemon(STREAMS, server_keys="dashboard = true\n")
    runs: list[dict] = []
    try:
        run_bench(url, Path(tempfile.mkdtemp()) / "warm.json")  # the first run pays for compiles and caches
        for i, open_ in enumerate([True, False, False, True] * a.rounds):
            runs.append(window(url, proc.pid, Path(tmp) / f"run{i}.json", open_, a.viewer_nice))
            print(json.dumps(runs[-1]), flush=True)
    finally:
        proc.terminate()
        proc.wait(60)
    result = {"config": {"rounds": a.rounds, "viewer_nice": a.viewer_nice}, "bench_args": BENCH, "runs": runs,
              **figures(runs), "environment": environment()}
    write_json(a.out, result)
    print(json.dumps(figures(runs)))
    return 0


# ------------------------------------------------------------------ the feed in process


def load_dashboard(path: str):
    """A ``dashboard.py`` from a file, as its own module (beside radixd.server.dashboard)."""
    spec = importlib.util.spec_from_file_location("dashboard_baseline", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def event_of(feed, engine) -> bytes:
    """The feed's next SSE event, as its ``events`` route sends it."""
    if hasattr(feed, "event"):
        return feed.event(engine)
    return f"data: {feed.snapshot(engine)}\n\n".encode()  # before Feed.event: the route framed each


async def in_process(runs: int, baseline: str | None) -> dict:
    from radixd.bench import _tokenizer, _workload, add_arguments
    from radixd.bench.runner import run_once
    from radixd.bench.targets import EngineTarget
    from radixd.server import dashboard

    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args([*BENCH[:1], "engine", *BENCH[2:]])  # radixd bench's workload, built as it builds it
    workload = _workload(args, _tokenizer(args))
    target = EngineTarget("default", kv_cache_tokens=KV_TOKENS, max_running_requests=STREAMS)
    await target.start()
    engine = target.engine
    feeds = {"current": dashboard.Feed()}
    if baseline:
        feeds["baseline"] = load_dashboard(baseline).Feed()
    engine.stats_hook = lambda s: [f.record(s) for f in feeds.values()]
    samples: dict[str, dict[str, list[float]]] = {k: {"wall": [], "cpu": [], "bytes": []} for k in feeds}
    parse: list[float] = []
    out_runs = []
    try:
        await run_once(target, workload, max_concurrency=STREAMS, progress=False)  # warm
        for i in range(runs):
            engine.flush_cache()
            stop = asyncio.Event()

            async def ticker(i: int, stop: asyncio.Event) -> None:
                # one feed a tick, in turn, each every INTERVAL_S: each snapshot is the first
                # work after the loop woke, as the feed's tick is in the daemon
                names, k = list(feeds), i
                while not stop.is_set():
                    name = names[k % len(names)]
                    w0, c0 = time.perf_counter(), time.thread_time()
                    ev = event_of(feeds[name], engine)
                    c1, w1 = time.thread_time(), time.perf_counter()
                    samples[name]["wall"].append(w1 - w0)
                    samples[name]["cpu"].append(c1 - c0)
                    samples[name]["bytes"].append(len(ev))
                    if name == "current":
                        p0 = time.thread_time()
                        json.loads(ev[6:])
                        parse.append(time.thread_time() - p0)
                    k += 1
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), INTERVAL_S / len(names))

            cpu0 = time.process_time()
            n0 = {name: len(s["cpu"]) for name, s in samples.items()}
            task = asyncio.create_task(ticker(i, stop))
            records, duration = await run_once(target, workload, max_concurrency=STREAMS, progress=False)
            stop.set()
            await task
            process_cpu = time.process_time() - cpu0
            row = {"duration_s": round(duration, 2), "req_s": round(sum(r.ok for r in records) / duration, 4),
                   "process_cpu_s": round(process_cpu, 2), "snapshots": len(samples["current"]["cpu"]) - n0["current"]}
            for name, s in samples.items():
                row[f"{name}_share_of_process_cpu"] = round(sum(s["cpu"][n0[name]:]) / process_cpu, 5)
            out_runs.append(row)
            print(json.dumps(row), flush=True)
    finally:
        await target.close()

    def us(xs: list[float]) -> dict:
        return {"median_us": round(1e6 * statistics.median(xs), 1), "mean_us": round(1e6 * statistics.mean(xs), 1)}

    result: dict = {"runs": out_runs}
    for name, s in samples.items():
        result[name] = {"wall": us(s["wall"]), "cpu": us(s["cpu"]), "bytes_median": statistics.median(s["bytes"]),
                        "share_of_process_cpu": round(statistics.median(r[f"{name}_share_of_process_cpu"]
                                                                        for r in out_runs), 5)}
    result["current"]["tree_builds"] = feeds["current"].tree_builds
    result["current"]["snapshots_built"] = feeds["current"].builds
    result["viewer_parse"] = us(parse)
    if baseline:
        cur, base = (statistics.median(samples[k]["cpu"]) for k in ("current", "baseline"))
        result["current_over_baseline_cpu_median"] = round(cur / base, 4)
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2, help="repeats of open, closed, closed, open")
    ap.add_argument("--viewer-nice", type=int, default=19, help="the viewer process's niceness (default 19)")
    ap.add_argument("--in-process", action="store_true", help="the feed's own cost in process, no HTTP")
    ap.add_argument("--runs", type=int, default=3, help="--in-process: workload runs (default 3)")
    ap.add_argument("--baseline", default=None, metavar="FILE",
                    help="--in-process: another dashboard.py to time beside this one")
    ap.add_argument("--viewer", default=None, metavar="URL", help=argparse.SUPPRESS)  # the viewer process
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.viewer:
        return viewer_main(a.viewer, a.viewer_nice)
    if a.in_process:
        result = asyncio.run(in_process(a.runs, a.baseline))
        result = {"config": {"runs": a.runs, "baseline": a.baseline}, **result, "environment": environment()}
        write_json(a.out or RESULTS / "dashboard" / "dashboard_feed_inprocess.json", result)
        print(json.dumps({k: v for k, v in result.items() if k not in ("runs", "environment")}))
        return 0
    a.out = a.out or str(RESULTS / "dashboard" / "dashboard_cost.json")
    return http_main(a)


if __name__ == "__main__":
    sys.exit(main())
