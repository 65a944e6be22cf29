"""What an open dashboard costs: one daemon (default model, ``[server] dashboard = true``),
the CPU shared-prefix workload through ``radixd bench``, with a dashboard viewer reading
``/dashboard/events`` and without, rounds in the order open, closed, closed, open (repeated)
so that drift on a shared machine falls on both alike.

    python -m benchmarks.dashboard_cost [--rounds 2] [--out benchmarks/results/dashboard/dashboard_cost.json]

The workload: 4 groups x 8 prompts sharing a 512-token system prompt, 32-token questions,
32 new tokens, concurrency 8, over ``/v1/completions`` (``radixd bench``'s shared-prefix
workload; the cache is flushed before each run). A viewer is what the page does: one SSE
stream, each snapshot parsed as JSON. Prints JSON; the figure is the median req/s open over
the median closed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import httpx

from benchmarks.common import RESULTS, environment, write_json
from benchmarks.http_vs_inprocess import start_daemon

BENCH = ["--target", "http", "--api", "completions", "--workload", "shared-prefix", "--groups", "4",
         "--prompts-per-group", "8", "--system-len", "512", "--question-len", "32", "--output-len", "32",
         "--max-concurrency", "8", "--no-progress"]


class Viewer:
    """One dashboard tab: reads the feed until stopped, counting the snapshots it parsed."""

    def __init__(self, url: str):
        self.url, self.snapshots, self._stop = url, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Viewer:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        with httpx.stream("GET", self.url + "/dashboard/events", timeout=None) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if self._stop.is_set():
                    return
                if line.startswith("data:"):
                    json.loads(line[5:])
                    self.snapshots += 1


def run_bench(url: str, out: Path) -> dict:
    subprocess.run([sys.executable, "-m", "radixd", "bench", "--url", url, *BENCH, "--output", str(out)],
                   check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())["figures"]


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
            out = Path(tmp) / f"run{i}.json"
            if open_:
                with Viewer(url) as v:
                    fig = run_bench(url, out)
                snapshots = v.snapshots
            else:
                fig, snapshots = run_bench(url, out), 0
            runs.append({"dashboard_open": open_, "req_s": fig["request_throughput"], "failed": fig["failed"],
                         "snapshots_read": snapshots, "duration_s": fig["duration_s"]})
            print(json.dumps(runs[-1]), flush=True)
    finally:
        proc.terminate()
        proc.wait(60)
    opened = statistics.median(r["req_s"] for r in runs if r["dashboard_open"])
    closed = statistics.median(r["req_s"] for r in runs if not r["dashboard_open"])
    result = {"config": vars(a), "bench_args": BENCH, "runs": runs, "open_req_s_median": round(opened, 4),
              "closed_req_s_median": round(closed, 4), "open_over_closed": round(opened / closed, 4),
              "environment": environment()}
    write_json(a.out, result)
    print(json.dumps({k: result[k] for k in ("open_req_s_median", "closed_req_s_median", "open_over_closed")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
