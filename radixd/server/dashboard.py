"""The live dashboard: ``GET /dashboard`` (one self-contained page, ``dashboard.html``) and
``GET /dashboard/events`` (an SSE feed of JSON snapshots of the engine's state).

Contract: a snapshot is built on the event loop, between steps, from what the engine already
keeps (``Engine.stats()``, the schedulers' queues, the KV accounting, the grammar compiler's
counters) plus the recent ``StepStats`` the daemon hands to ``Feed.record`` (a bounded deque:
the only per-step work the dashboard adds, and only when ``[server] dashboard`` is on) and the
HTTP requests' trackers, which ``Feed.watch`` holds weakly by engine request id (once per HTTP
request): a request's TTFT is its tracker's, the one the access log and
``radixd_time_to_first_token_seconds`` record. Each replica's entry has its own pool, tree,
queues and worker idle share (``dp_size`` > 1: one entry per replica). The
radix tree's summary has at most ``TREE_NODES`` nodes however large the tree (the largest
subtrees first), and its walk stops after ``TREE_WALK`` nodes. A snapshot is encoded once per
interval for all viewers, and each step's JSON once in all (``Feed._steps_json``). Both routes answer 404 when the
dashboard is off; with API keys set they sit behind the gate, which also takes the key as
``?key=`` on ``/dashboard`` paths (a browser's ``EventSource`` cannot send headers).
"""

from __future__ import annotations

import asyncio
import collections
import heapq
import json
import time
import weakref
from collections.abc import Iterable
from importlib import resources

from starlette.requests import Request
from starlette.responses import HTMLResponse, Response, StreamingResponse

from radixd.core.radix_cache import RadixCache, TreeNode
from radixd.core.replica import StepStats
from radixd.server.errors import ApiError
from radixd.server.state import state_of

TREE_NODES = 200     # nodes in a snapshot's tree summary
TREE_WALK = 20_000   # nodes visited to build it (a larger tree is summarised from its top)
STEPS_KEPT = 256     # recent steps in a snapshot
REQUESTS_SHOWN = 64  # waiting and running requests listed (each queue)
INTERVAL_S = 0.25    # between snapshots


class Feed:
    """The dashboard's own state: recent steps, when each request was first seen, the
    trackers of the HTTP requests in flight."""

    def __init__(self) -> None:
        self.steps: collections.deque[tuple[float, StepStats]] = collections.deque(maxlen=STEPS_KEPT)
        self._recorded = 0  # steps recorded so far
        self._encoded: collections.deque[str] = collections.deque(maxlen=STEPS_KEPT)  # JSON of the newest steps
        self._encoded_upto = 0  # ``_recorded`` when ``_encoded`` was last brought up to date
        self._seen: dict[str, float] = {}
        self._trackers: weakref.WeakValueDictionary[str, object] = weakref.WeakValueDictionary()
        self._last: tuple[float, str] | None = None  # shared by the viewers of one interval

    def snapshot(self, engine) -> str:
        """The current snapshot as JSON: one per interval, however many viewers read it."""
        now = time.monotonic()
        if self._last is None or now - self._last[0] >= INTERVAL_S / 2:
            self._last = (now, self._build(engine, now))
        return self._last[1]

    def record(self, stats: StepStats) -> None:
        self.steps.append((time.time(), stats))
        self._recorded += 1

    def watch(self, tracker) -> None:
        """An HTTP request's ``generation.Tracker``: its calls' rows show its TTFT (``info["ttft"]``)."""
        for sub in tracker.subs:
            self._trackers[sub.rid] = tracker

    def _steps_json(self) -> str:
        """The kept steps as a JSON array; each step is encoded once, at the first snapshot
        after it (a snapshot re-sends the last ``STEPS_KEPT`` steps, nearly all seen before)."""
        new = min(self._recorded - self._encoded_upto, len(self.steps))
        for i in range(len(self.steps) - new, len(self.steps)):
            t, s = self.steps[i]
            self._encoded.append(_dumps({"t": t, **s._asdict()}))
        self._encoded_upto = self._recorded
        return "[" + ",".join(self._encoded) + "]"

    def _build(self, engine, now: float) -> str:
        seen: dict[str, float] = {}
        replicas = []
        steps = [s for _, s in self.steps]
        for rep in engine.replicas:
            sched = rep.scheduler
            queues = {}
            for name, reqs in (("waiting", sched.waiting), ("running", sched.running)):
                rows = []
                for r in reqs[:REQUESTS_SHOWN]:
                    seen[r.rid] = first = self._seen.get(r.rid, now)
                    tracker = self._trackers.get(r.rid)
                    ttft = tracker.info.get("ttft") if tracker is not None and r.num_output else None
                    rows.append({"rid": r.rid, "age_s": round(now - first, 2), "prompt_tokens": len(r.prompt_ids),
                                 "output_tokens": len(r.output_ids), "cached_tokens": r.cached_tokens or 0,
                                 "ttft_ms": None if ttft is None else round(ttft * 1000, 2)})
                queues[name] = rows
            replicas.append({"kv": sched.accounting(), "tree": tree_summary(rep.cache), **queues,
                             "idle_fraction": idle_fraction(s for s in steps if s.replica == rep.index)})
        self._seen = seen
        stats = engine.stats()
        g = engine.grammars
        head = _dumps({
            "time": time.time(),
            "stats": {k: v for k, v in stats.items() if k != "replicas"},
            "replicas": replicas,
            "idle_fraction": idle_fraction(steps),
            "grammar": g.stats() if hasattr(g, "stats") else None,  # a plugin's compiler may keep none
        })
        return head[:-1] + ',"steps":' + self._steps_json() + "}"


def _dumps(obj) -> str:
    return json.dumps(obj, separators=(",", ":"))


def idle_fraction(steps: Iterable[StepStats]) -> float | None:
    """The share of the workers' time over ``steps`` that they sat idle (None: no time)."""
    idle = cycle = 0.0
    for s in steps:
        idle += s.idle_ms
        cycle += s.cycle_ms
    return round(idle / cycle, 4) if cycle else None


def tree_summary(cache: RadixCache, limit: int = TREE_NODES, walk: int = TREE_WALK) -> dict:
    """The shared tree's largest subtrees: at most ``limit`` nodes, each ``[id, parent id,
    own tokens, subtree tokens, hits, locked, backed]`` (parents before children); ``hidden``:
    tokens in nodes left out."""
    root = cache.shared_root
    sizes: dict[int, int] = {}
    order: list[TreeNode] = []
    frontier = collections.deque([root])  # breadth first: a walk cut short still covers the top
    while frontier and len(order) < walk:
        node = frontier.popleft()
        order.append(node)
        frontier.extend(node.children.values())
    for node in reversed(order):  # children after their parent in ``order``: sizes bottom-up
        sizes[id(node)] = len(node.key) + sum(sizes.get(id(c), 0) for c in node.children.values())
    ids = {id(root): 0}
    nodes = [[0, -1, 0, sizes[id(root)], root.hits, False, False]]
    heap = [(-sizes.get(id(c), 0), n, c) for n, c in enumerate(root.children.values())]
    heapq.heapify(heap)
    tie = len(heap)
    while heap and len(nodes) < limit:
        neg, _, node = heapq.heappop(heap)
        if id(node) not in sizes:
            continue
        ids[id(node)] = len(nodes)
        nodes.append([len(nodes), ids[id(node.parent)], len(node.key), -neg, node.hits, node.lock_ref > 0,
                      node.backed])
        for c in node.children.values():
            tie += 1
            heapq.heappush(heap, (-sizes.get(id(c), 0), tie, c))
    shown = sum(n[2] for n in nodes)
    return {"nodes": nodes, "hidden": sizes[id(root)] - shown, "complete": not frontier}


def _enabled(request: Request):
    st = state_of(request)
    if not st.settings.server.dashboard or st.dashboard is None:
        raise ApiError(404, f"no route {request.method} {request.url.path} (set [server] dashboard = true)",
                       code="not_found")
    return st


async def page(request: Request) -> Response:
    _enabled(request)
    return HTMLResponse(resources.files("radixd.server").joinpath("dashboard.html").read_text("utf-8"))


async def events(request: Request) -> Response:
    st = _enabled(request)

    async def stream():
        while not st.draining and not await request.is_disconnected():  # a drain ends the feed
            yield f"data: {st.dashboard.snapshot(st.engine)}\n\n"
            await asyncio.sleep(INTERVAL_S)

    return StreamingResponse(stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
