"""``radixd top``: the dashboard's feed (``GET /dashboard/events``) in a terminal, for SSH.

A client of a running daemon, nothing more: it reads the snapshots that
``radixd.server.dashboard`` builds and renders each with ``rich`` (per replica: the KV pool,
its worker's idle share, the largest cached prefixes, the running and waiting requests with
their TTFT; then the recent steps). ``--once`` prints one snapshot and exits.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator

import httpx

PREFIXES_SHOWN = 10
REQUESTS_SHOWN = 10


def snapshots(url: str, key: str | None) -> Iterator[dict]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    with httpx.stream("GET", url.rstrip("/") + "/dashboard/events", headers=headers, timeout=30) as r:
        if r.status_code != 200:
            r.read()
            raise SystemExit(f"radixd top: {url} answered {r.status_code}: {r.text[:300]}"
                             + (" (is [server] dashboard = true?)" if r.status_code == 404 else ""))
        for line in r.iter_lines():
            if line.startswith("data: "):
                yield json.loads(line[6:])


def render(snap: dict):
    from rich.console import Group
    from rich.table import Table

    s = snap["stats"]
    head = Table.grid(padding=(0, 2))
    head.add_row(f"running {s['running']}", f"waiting {s['waiting']}", f"steps {s['steps']}",
                 f"cache hit rate {100 * s['cache_hit_rate']:.1f}%", f"preemptions {s['preemptions']}")
    parts = [head]
    for i, rep in enumerate(snap["replicas"]):
        kv = rep["kv"]
        parts.append(f"[bold]replica {i}[/] KV: free {kv['free']} · evictable {kv['evictable']} · "
                     f"locked {kv['locked']} · private {kv['private']} of {kv['total']} · "
                     f"worker idle {_percent(rep['idle_fraction'])}")
        nodes = rep["tree"]["nodes"]
        tree = Table(title=f"radix cache: {nodes[0][3]} tokens, largest prefixes", title_justify="left")
        for col in ("node", "depth", "tokens", "subtree", "hits", "state"):
            tree.add_column(col, justify="right")
        depth = {0: 0}
        for n in nodes[1:]:
            depth[n[0]] = depth[n[1]] + 1
        for n in sorted(nodes[1:], key=lambda n: -n[3])[:PREFIXES_SHOWN]:
            tree.add_row(str(n[0]), str(depth[n[0]]), str(n[2]), str(n[3]), str(n[4]),
                         "locked" if n[5] else "evictable" + (" (tier)" if n[6] else ""))
        parts.append(tree)
        for name in ("running", "waiting"):
            t = Table(title=f"{name} ({len(rep[name])})", title_justify="left")
            for col in ("request", "age s", "TTFT ms", "prompt", "cached", "output"):
                t.add_column(col, justify="left" if col == "request" else "right")
            for r in rep[name][:REQUESTS_SHOWN]:
                ttft = r["ttft_ms"]
                t.add_row(r["rid"][:24], f"{r['age_s']:.1f}", "-" if ttft is None else f"{ttft:.1f}",
                          str(r["prompt_tokens"]), str(r["cached_tokens"]), str(r["output_tokens"]))
            parts.append(t)
    steps = snap["steps"]
    if steps:
        ms = [x["step_ms"] for x in steps]
        parts.append(f"last {len(steps)} steps: prefill {sum(x['prefill_tokens'] for x in steps)} tokens · "
                     f"decode {sum(x['decode_tokens'] for x in steps)} tokens · step ms mean {sum(ms) / len(ms):.1f}"
                     f" max {max(ms):.1f} · worker idle {_percent(snap['idle_fraction'])}"
                     f" (mean {sum(x['idle_ms'] for x in steps) / len(steps):.2f} ms before a step)")
    return Group(*parts)


def _percent(share: float | None) -> str:
    return "-" if share is None else f"{100 * share:.1f}%"


def main(url: str, key: str | None, once: bool) -> int:
    try:
        from rich.console import Console
        from rich.live import Live
    except ImportError:
        print("radixd top needs rich (pip install 'radixd[top]')", file=sys.stderr)
        return 2
    feed = snapshots(url, key)
    console = Console()
    if once:
        console.print(render(next(feed)))
        return 0
    try:
        with Live(console=console, screen=console.is_terminal, auto_refresh=False) as live:
            for snap in feed:
                live.update(render(snap), refresh=True)
    except KeyboardInterrupt:
        pass
    return 0
