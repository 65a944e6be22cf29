"""Built-in scheduling policies, registered as a plugin like any other.

``fcfs``: arrival order. ``lpm``: longest cached prefix first; a request whose uncached
prefix repeats one already chosen (or still prefilling) waits a step so the group prefills
the shared part once and the rest read it from the cache. Past ``LPM_MAX_QUEUE`` waiting
requests ``lpm`` keeps arrival order (ranking them all each step costs too much) but still
holds back such repeats, comparing block hashes of the prompts. Both orders are read lazily,
only as far as the scheduler reads (it stops when the step is full).
"""

from __future__ import annotations

from radixd.core.config import EngineConfig
from radixd.core.policy import PolicyContext
from radixd.core.request import Request
from radixd.core.router import BLOCK, prefix_hashes
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
        self._blocks: dict[int, tuple[Request, int, list[int]]] = {}  # id -> (request, len(seq), hashes)

    def order(self, waiting: list[Request], ctx: PolicyContext):
        if len(waiting) > LPM_MAX_QUEUE:
            return self._arrival_order(waiting, ctx)
        scored = sorted(((-ctx.cache.peek_prefix_len(r.seq, r.namespace), r.arrival, r) for r in waiting),
                        key=lambda t: (t[0], t[1]))
        return self._without_repeats(scored, ctx)

    def _without_repeats(self, scored: list[tuple[int, float, Request]], ctx: PolicyContext):
        """``scored`` in order, lazily, less the requests whose uncached prefix repeats one
        chosen before (or still prefilling). Only the requests the scheduler reads are
        added to the trie: a step admits a few of up to ``LPM_MAX_QUEUE``, and adding every
        waiting prompt's tokens each step cost more than the step's launch (128 prompts of
        512 tokens: tens of milliseconds of the loop's thread)."""
        pending = _Trie()
        for r in ctx.prefilling:
            pending.add(r.seq, r.namespace)
        for neg_hit, _, r in scored:
            seq = r.seq
            if pending.shared_len(seq, r.namespace) + neg_hit >= self.min_shared:
                continue  # an earlier request computes this prefix; read it from the cache later
            pending.add(seq, r.namespace)
            yield r

    def _arrival_order(self, waiting: list[Request], ctx: PolicyContext):
        """Arrival order without the repeats of a prefix being computed (lazily)."""
        known, self._blocks = self._blocks, {}
        for r in waiting:  # keep the hashes of requests still waiting
            entry = known.get(id(r))
            if entry is not None and entry[0] is r:
                self._blocks[id(r)] = entry
        pending: set[int] = set()
        for r in ctx.prefilling:
            pending.update(self._hashes(r))
        for r in sorted(waiting, key=lambda r: r.arrival):
            hashes = self._hashes(r)
            shared = 0
            for h in hashes:
                if h not in pending:
                    break
                shared += 1
            shared *= BLOCK
            if shared >= self.min_shared and shared - ctx.cache.peek_prefix_len(r.seq, r.namespace) >= self.min_shared:
                continue  # an earlier request computes this prefix; read it from the cache later
            pending.update(hashes)
            yield r

    def _hashes(self, r: Request) -> list[int]:
        seq = r.seq
        entry = self._blocks.get(id(r))
        if entry is None or entry[0] is not r or entry[1] != len(seq):
            entry = self._blocks[id(r)] = (r, len(seq), prefix_hashes(seq, seed=r.namespace))
        return entry[2]


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
