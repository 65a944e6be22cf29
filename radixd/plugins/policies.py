"""Built-in scheduling policies, registered as a plugin like any other.

``fcfs``: arrival order. ``lpm``: longest cached prefix first; a request whose uncached
prefix repeats one already chosen (or still prefilling) waits a step so the group prefills
the shared part once and the rest read it from the cache.
"""

from __future__ import annotations

from radixd.core.config import EngineConfig
from radixd.core.policy import PolicyContext
from radixd.core.request import Request
from radixd.plugins import hookimpl

LPM_MAX_QUEUE = 128  # beyond this, ranking every waiting request each step costs too much


class FCFS:
    name = "fcfs"

    def __init__(self, config: EngineConfig):
        self.config = config

    def order(self, waiting: list[Request], ctx: PolicyContext) -> list[Request]:
        return sorted(waiting, key=lambda r: r.arrival)


class LongestPrefixMatch:
    name = "lpm"

    def __init__(self, config: EngineConfig):
        self.config = config
        self.min_shared = config.lpm_dedup_min_tokens

    def order(self, waiting: list[Request], ctx: PolicyContext) -> list[Request]:
        if len(waiting) > LPM_MAX_QUEUE:
            return sorted(waiting, key=lambda r: r.arrival)
        scored = []
        for r in waiting:
            seq = r.seq
            hit = ctx.cache.peek_prefix_len(seq, r.namespace)
            scored.append((-hit, r.arrival, r, hit))
        scored.sort(key=lambda t: (t[0], t[1]))
        chosen: list[Request] = []
        pending = _Trie()
        for r in ctx.prefilling:
            pending.add(r.seq, r.namespace)
        for _, _, r, hit in scored:
            seq = r.seq
            if pending.shared_len(seq, r.namespace) - hit >= self.min_shared:
                continue  # an earlier request computes this prefix; read it from the cache later
            pending.add(seq, r.namespace)
            chosen.append(r)
        return chosen


class _Trie:
    """Token trie of the prefixes about to be computed this step (for in-batch de-duplication)."""

    def __init__(self) -> None:
        self.roots: dict[int, dict] = {}

    def add(self, seq: list[int], ns: int) -> None:
        node = self.roots.setdefault(ns, {})
        for t in seq:
            node = node.setdefault(t, {})

    def shared_len(self, seq: list[int], ns: int) -> int:
        node = self.roots.get(ns)
        n = 0
        while node is not None and n < len(seq):
            node = node.get(seq[n])
            if node is None:
                break
            n += 1
        return n


@hookimpl
def radixd_schedule_policies():
    return {"fcfs": FCFS, "lpm": LongestPrefixMatch}
