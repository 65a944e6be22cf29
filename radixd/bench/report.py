"""What ``radixd bench`` prints and writes: the table, the JSON report, ``compare``."""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path

from radixd.bench.metrics import MAIN_FIGURES, lookup


def _f(v, digits: int = 2) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def _stats(s: dict | None, keys: tuple[str, ...]) -> str:
    if s is None:
        return "-"
    return " / ".join(_f(s[k]) for k in keys)


def table(name: str, figs: dict, target: dict) -> str:
    where = target.get("url") or target.get("model") or ""
    api = f" {target['api']}" if target.get("api") else ""
    hit = figs["cache_hit_rate"]
    hit_text = "null (the target reports no cache counters)" if hit is None else \
        f"{hit:.3f} ({figs['cache']['source']}: {figs['cache']['cached_tokens']} of {figs['cache']['prompt_tokens']} prompt tokens)"
    rows = [
        ("Requests: completed / failed", f"{figs['completed']} / {figs['failed']}"),
        ("Duration (s)", _f(figs["duration_s"])),
        ("Input tokens / output tokens", f"{figs['input_tokens']} / {figs['output_tokens']}"),
        ("Request throughput (req/s)", _f(figs["request_throughput"], 3)),
        ("Input token throughput (tok/s)", _f(figs["input_token_throughput"])),
        ("Output token throughput (tok/s)", _f(figs["output_token_throughput"])),
        ("Total token throughput (tok/s)", _f(figs["total_token_throughput"])),
        ("Mean concurrency", _f(figs["concurrency"])),
        ("Cache hit rate", hit_text),
        ("TTFT (ms): mean / median / p99", _stats(figs["ttft_ms"], ("mean", "median", "p99"))),
        ("ITL (ms): mean / median / p95 / p99", _stats(figs["itl_ms"], ("mean", "median", "p95", "p99"))),
        ("TPOT (ms): mean / median / p99", _stats(figs["tpot_ms"], ("mean", "median", "p99"))),
        ("E2E latency (ms): mean / median / p99", _stats(figs["e2e_ms"], ("mean", "median", "p99"))),
        ("Errors", str(figs["errors"]["count"])),
    ]
    if gcp := figs.get("client_gc"):
        rows.append(("Client GC: collections / longest (ms)",
                     f"{gcp['collections']} / {gcp['max_pause_seconds'] * 1e3:.1f}"))
    for msg in figs["errors"]["first"]:
        rows.append(("  error", msg))
    width = max(len(k) for k, _ in rows)
    title = f" radixd bench: {name} ({target.get('kind', '?')}{api} {where}) "
    rule = max(width + 30, len(title) + 6)
    lines = [title.center(rule, "=")]
    lines += [f"{k:<{width}}  {v}" for k, v in rows]
    lines.append("=" * rule)
    return "\n".join(lines)


def sweep_table(runs: list[dict]) -> str:
    head = f"{'concurrency':>11}  {'req/s':>8}  {'out tok/s':>10}  {'total tok/s':>11}  {'TTFT p99 ms':>11}  " \
           f"{'ITL p99 ms':>10}  {'E2E p99 ms':>10}  {'hit rate':>8}  {'failed':>6}"
    lines = [head]
    for run in runs:
        f = run["figures"]
        lines.append(
            f"{run['max_concurrency'] or 'all':>11}  {_f(f['request_throughput'], 3):>8}  "
            f"{_f(f['output_token_throughput']):>10}  {_f(f['total_token_throughput']):>11}  "
            f"{_f(lookup(f, ('ttft_ms', 'p99'))):>11}  {_f(lookup(f, ('itl_ms', 'p99'))):>10}  "
            f"{_f(lookup(f, ('e2e_ms', 'p99'))):>10}  {_f(f['cache_hit_rate'], 3):>8}  {f['failed']:>6}")
    return "\n".join(lines)


def machine() -> dict:
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    from radixd import __version__

    info = {"platform": platform.platform(), "python": platform.python_version(), "cpu": cpu,
            "cpu_count": os.cpu_count(), "radixd": __version__}
    if "torch" in sys.modules:
        import torch

        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
    return info


def write_json(path: str | Path, doc: dict) -> None:
    path = Path(path)
    if path.parent != Path(""):
        path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")


def document(*, argv: list[str], config: dict, target: dict, workload: dict, runs: list[dict],
             extra: dict | None = None) -> dict:
    """The JSON report: the main figures (the last run's: with a sweep, the highest
    concurrency), every run with its records, and the exact configuration."""
    return {
        "tool": "radixd bench",
        "command": "radixd bench " + " ".join(argv),
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine(),
        "config": config,
        "target": target,
        "workload": workload,
        "figures": runs[-1]["figures"] if runs else None,
        "runs": runs,
        **(extra or {}),
    }


def compare(a_path: str, b_path: str) -> str:
    """The main figures of two reports side by side, with B / A."""
    docs = []
    for p in (a_path, b_path):
        with open(p) as fh:
            doc = json.load(fh)
        if not isinstance(doc, dict) or doc.get("figures") is None:
            raise ValueError(f"{p} is not a radixd bench report with figures")
        docs.append(doc)
    fa, fb = docs[0]["figures"], docs[1]["figures"]
    width = max(len(label) for _, label, _ in MAIN_FIGURES)
    lines = [f"A: {a_path}  ({_describe(docs[0])})", f"B: {b_path}  ({_describe(docs[1])})",
             f"{'figure':<{width}}  {'A':>12}  {'B':>12}  {'B / A':>8}"]
    for path, label, higher in MAIN_FIGURES:
        va, vb = lookup(fa, path), lookup(fb, path)
        ratio = "-" if va is None or vb is None or va == 0 else f"{vb / va:.3f}"
        better = ""
        if va is not None and vb is not None and va != vb:
            better = "  B better" if (vb > va) == higher else "  A better"
        lines.append(f"{label:<{width}}  {_f(va, 3):>12}  {_f(vb, 3):>12}  {ratio:>8}{better}")
    return "\n".join(lines)


def _describe(doc: dict) -> str:
    t = doc.get("target") or {}
    w = doc.get("workload") or {}
    api = f"/{t['api']}" if t.get("api") else ""
    return f"{t.get('kind', '?')}{api}, {w.get('name', '?')}, {w.get('requests', '?')} requests"
