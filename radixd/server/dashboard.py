"""The live dashboard: ``GET /dashboard`` (one self-contained page, ``dashboard.html``) and
``GET /dashboard/events`` (an SSE feed of JSON snapshots of the engine's state).

Contract: a snapshot is built on the event loop, between steps, from what the engine already
keeps (``Engine.stats()``, the schedulers' queues, the KV accounting, the grammar compiler's
counters) plus the recent ``StepStats`` the daemon hands to ``Feed.record`` (a bounded deque:
the only per-step work the dashboard adds, and only when ``[server] dashboard`` is on) and the
HTTP requests' trackers, which ``Feed.watch`` holds weakly by engine request id (once per HTTP
request): a request's TTFT is its tracker's, the one the access log and
``radixd_time_to_first_token_seconds`` record. Each replica's entry has its own pool, tree,
queues and worker idle share (``dp_size`` > 1: one entry per replica).

What a snapshot costs, and when it is paid: nothing is built while no viewer is connected.
The viewers share one schedule (each sleeps until the last build's time + ``INTERVAL_S``), so
one snapshot is built, encoded and framed as an SSE event once per interval however many
read it (a viewer that connects mid-interval gets one built for it unless the last is under
half an interval old). The radix tree's summary has at most ``TREE_NODES`` nodes however
large the tree (the largest subtrees first), its walk stops after ``TREE_WALK`` nodes, and it
is kept encoded while the cache's ``version`` is unchanged. Each step is encoded once, at the
first snapshot after it (its milliseconds to the microsecond, its time to the millisecond),
and the snapshot's JSON is spliced from the kept parts; the workers' idle shares are running
sums (integer microseconds) over the kept steps. Each snapshot says how many viewers read
the feed (``viewers``). A feed ends when its viewer goes (Starlette cancels the stream: no
polling for the disconnect) or the daemon drains. Both routes answer
404 when the dashboard is off; with API keys set they sit behind the gate, which also takes
the key as ``?key=`` on ``/dashboard`` paths (a browser's ``EventSource`` cannot send headers).
"""

from __future__ import annotations

import asyncio
import collections
import json
import math
import time
import weakref
from collections.abc import AsyncIterator, Callable
from importlib import resources

from starlette.requests import Request
from starlette.responses import HTMLResponse, Response, StreamingResponse

from radixd.core.radix_cache import RadixCache
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
    trackers of the HTTP requests in flight, the last snapshot and its viewers."""

    def __init__(self) -> None:
        self.steps: collections.deque[tuple[float, StepStats]] = collections.deque(maxlen=STEPS_KEPT)
        self._recorded = 0  # steps recorded so far
        self._encoded_upto = 0  # ``_recorded`` when ``_kept`` was last brought up to date
        # the newest steps as (JSON, replica, idle us, cycle us), and their sums by replica
        self._kept: collections.deque[tuple[str, int, int, int]] = collections.deque()
        self._idle: collections.Counter[int] = collections.Counter()
        self._cycle: collections.Counter[int] = collections.Counter()
        self._steps_json: str | None = None  # ``_kept``'s JSON, joined
        self._seen: dict[str, float] = {}
        self._trackers: weakref.WeakValueDictionary[str, object] = weakref.WeakValueDictionary()
        self._trees: dict[int, tuple[int | None, str]] = {}  # replica -> (its cache's version, summary JSON)
        self.built_at = -math.inf  # time.monotonic() of the last snapshot
        self._json = ""
        self._event: bytes | None = None  # the last snapshot as an SSE event
        self.viewers = 0  # feeds being read now
        self.builds = 0   # snapshots built so far
        self.tree_builds = 0  # tree summaries built so far

    def snapshot(self, engine) -> str:
        """The current snapshot as JSON: built at most once per half interval, however many
        viewers read it."""
        now = time.monotonic()
        if now - self.built_at >= INTERVAL_S / 2:
            self._json = self._build(engine, now)
            self._event = None
            self.built_at = now
            self.builds += 1
        return self._json

    def event(self, engine) -> bytes:
        """The current snapshot framed as one SSE event (framed once per snapshot)."""
        snap = self.snapshot(engine)
        if self._event is None:
            self._event = b"data: " + snap.encode() + b"\n\n"
        return self._event

    async def stream(self, engine, stop: Callable[[], bool] = lambda: False) -> AsyncIterator[bytes]:
        """One viewer's events until ``stop()`` (or until its consumer is cancelled): the first
        at once, then one at each of the shared schedule's ticks."""
        self.viewers += 1
        try:
            while not stop():
                yield self.event(engine)
                await asyncio.sleep(max(0.0, self.built_at + INTERVAL_S - time.monotonic()))
        finally:
            self.viewers -= 1

    def record(self, stats: StepStats) -> None:
        self.steps.append((time.time(), stats))
        self._recorded += 1

    def watch(self, tracker) -> None:
        """An HTTP request's ``generation.Tracker``: its calls' rows show its TTFT (``info["ttft"]``)."""
        for sub in tracker.subs:
            self._trackers[sub.rid] = tracker

    def _update_steps(self) -> bool:
        """Bring ``_kept`` and the idle sums up to the kept steps (True: they changed): each
        step is encoded once, at the first snapshot after it (a snapshot re-sends the last
        ``STEPS_KEPT`` steps, nearly all seen before)."""
        new = min(self._recorded - self._encoded_upto, len(self.steps))
        for i in range(len(self.steps) - new, len(self.steps)):
            t, s = self.steps[i]
            idle, cycle = round(s.idle_ms * 1000), round(s.cycle_ms * 1000)
            row = s._asdict()
            row["kv_usage"] = round(s.kv_usage, 4)
            row["step_ms"], row["idle_ms"], row["cycle_ms"] = round(s.step_ms, 3), idle / 1000, cycle / 1000
            self._kept.append((_dumps({"t": round(t, 3), **row}), s.replica, idle, cycle))
            self._idle[s.replica] += idle
            self._cycle[s.replica] += cycle
        self._encoded_upto = self._recorded
        while len(self._kept) > len(self.steps):
            _, rep, idle, cycle = self._kept.popleft()
            self._idle[rep] -= idle
            self._cycle[rep] -= cycle
        return new > 0

    def _idle_fraction(self, replica: int | None = None) -> float | None:
        """The workers' idle share over the kept steps (of one replica, or of all)."""
        if replica is None:
            idle, cycle = self._idle.total(), self._cycle.total()
        else:
            idle, cycle = self._idle[replica], self._cycle[replica]
        return round(idle / cycle, 4) if cycle else None

    def _tree(self, rep) -> str:
        """The replica's tree summary as JSON, rebuilt only when its cache has changed since."""
        version = getattr(rep.cache, "version", None)
        kept = self._trees.get(rep.index)
        if version is None or kept is None or kept[0] != version:
            kept = (version, _dumps(tree_summary(rep.cache)))
            self.tree_builds += 1
            self._trees[rep.index] = kept
        return kept[1]

    def _build(self, engine, now: float) -> str:
        """The snapshot's JSON, spliced from parts: the tree summaries and the steps are kept
        encoded between snapshots."""
        if self._update_steps() or self._steps_json is None:
            self._steps_json = ",".join(s[0] for s in self._kept)
        stats = engine.stats()
        stats.pop("replicas", None)  # dp_size > 1: each replica's own counters (its entry has them)
        seen: dict[str, float] = {}
        replicas = []
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
            rest = _dumps({**queues, "idle_fraction": self._idle_fraction(rep.index)})
            replicas.append(f'{{"kv":{_dumps(sched.accounting())},"tree":{self._tree(rep)},{rest[1:]}')
        self._seen = seen
        g = engine.grammars
        head = _dumps({
            "time": time.time(),
            "stats": stats,
            "idle_fraction": self._idle_fraction(),
            "grammar": g.stats() if hasattr(g, "stats") else None,  # a plugin's compiler may keep none
            "viewers": self.viewers,
        })
        return f'{head[:-1]},"replicas":[{",".join(replicas)}],"steps":[{self._steps_json}]}}'


def _dumps(obj) -> str:
    return json.dumps(obj, separators=(",", ":"))


def tree_summary(cache: RadixCache, limit: int = TREE_NODES, walk: int = TREE_WALK) -> dict:
    """The shared tree's largest subtrees: at most ``limit`` nodes, each ``[id, parent id,
    own tokens, subtree tokens, hits, locked, backed]``, largest subtree first (so parents
    before children: a node's own tokens are never none, its subtree is larger than any
    child's); ``hidden``: tokens in nodes left out; ``complete``: the walk saw the whole tree."""
    root = cache.shared_root
    order, up = [root], [-1]  # breadth first over at most ``walk`` nodes: a walk cut short covers the top
    i = 0
    while i < len(order) and len(order) < walk:
        children = order[i].children
        if children:
            order.extend(children.values())
            up.extend([i] * len(children))
        i += 1
    complete = i == len(order) <= walk
    del order[walk:], up[walk:]
    sizes = [len(n.key) for n in order]
    for j in range(len(order) - 1, 0, -1):  # children after their parent: sizes bottom-up
        sizes[up[j]] += sizes[j]
    # the largest subtrees: a node's parent is larger, so it comes first (ties: breadth-first order)
    top = sorted(range(1, len(order)), key=sizes.__getitem__, reverse=True)[: max(0, limit - 1)]
    ids = {0: 0}
    nodes = [[0, -1, 0, sizes[0], root.hits, False, False]]
    own = 0
    for j in top:
        node = order[j]
        ids[j] = len(nodes)
        nodes.append([len(nodes), ids[up[j]], len(node.key), sizes[j], node.hits, node.lock_ref > 0, node.backed])
        own += len(node.key)
    return {"nodes": nodes, "hidden": sizes[0] - own, "complete": complete}


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
    # (no is_disconnected() polling: Starlette cancels the stream when the client goes)
    return StreamingResponse(st.dashboard.stream(st.engine, lambda: st.draining), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})
