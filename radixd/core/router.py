"""Which data-parallel replica serves a request.

``cache_aware``: each replica has an approximate index of the prompts sent to it (hashes of
their block-aligned prefixes, least recently used dropped beyond the replica's KV capacity).
A request goes to the replica whose index holds the longest prefix of its prompt, unless that
replica is much busier than the least-loaded one: its load (requests waiting or running)
exceeds the least-loaded replica's both by more than ``balance_threshold`` requests and by
more than ``balance_ratio`` times; then it goes to the least-loaded replica. A prompt no
replica holds a prefix of goes to the replica whose index is smallest (the most room for a
new prefix; the least-loaded on a tie). Counting new prefixes rather than requests keeps
the groups of a burst whole: when a prefix first arrives, how many of each earlier prefix's
requests have arrived yet says little about the load they will bring. The index is updated
as requests are routed, so a burst of requests sharing a prefix follows the first one
before its KV exists.

``round_robin``: replicas in turn, whatever they hold (the baseline to compare against).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

BLOCK = 16  # tokens per indexed prefix block


def prefix_hashes(ids: Sequence[int], block: int = BLOCK, seed: int = 0) -> list[int]:
    """One hash per whole block of ``ids``; hash ``k`` covers ``ids[: (k + 1) * block]``
    (and ``seed``: a namespace)."""
    out = []
    h = seed
    for start in range(0, len(ids) - block + 1, block):
        h = hash((h, tuple(ids[start : start + block])))
        out.append(h)
    return out


class PrefixIndex:
    """Block-prefix hashes of the prompts routed to one replica, least recently used first."""

    def __init__(self, capacity_blocks: int):
        self.capacity = max(1, capacity_blocks)
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, hashes: list[int]) -> int:
        """How many leading blocks of the prompt the index holds."""
        n = 0
        for h in hashes:
            if h not in self._blocks:
                break
            n += 1
        return n

    def insert(self, hashes: list[int]) -> None:
        # deepest first: a prompt's first blocks are the most recent, so they go last
        for h in reversed(hashes):
            self._blocks[h] = None
            self._blocks.move_to_end(h)
        while len(self._blocks) > self.capacity:
            self._blocks.popitem(last=False)

    def clear(self) -> None:
        self._blocks.clear()


class Router:
    def __init__(self, num_replicas: int, *, policy: str, balance_threshold: int, capacity_tokens: int,
                 loads: Callable[[], list[int]], balance_ratio: float = 1.0):
        self.policy = policy
        self.balance_threshold = balance_threshold
        self.balance_ratio = balance_ratio
        self.loads = loads
        self.indexes = [PrefixIndex(capacity_tokens // BLOCK) for _ in range(num_replicas)]
        self.routed = [0] * num_replicas
        self.by_prefix = 0    # requests sent where their prefix was
        self.by_load = 0      # requests sent to the least-loaded replica, away from their prefix
        self.by_room = 0      # requests with no prefix anywhere, sent to the smallest index
        self._next = 0

    def pick(self, ids: Sequence[int]) -> int:
        """The replica for a prompt (and records that it went there)."""
        if self.policy == "round_robin":
            i = self._next
            self._next = (i + 1) % len(self.indexes)
        else:
            i = self._cache_aware(ids)
        self.routed[i] += 1
        return i

    def _cache_aware(self, ids: Sequence[int]) -> int:
        hashes = prefix_hashes(ids)
        loads = self.loads()
        indexes = self.indexes
        matched = [index.match(hashes) for index in indexes]
        best = max(range(len(matched)), key=lambda i: (matched[i], -loads[i]))
        if matched[best] == 0:
            choice = min(range(len(loads)), key=lambda i: (len(indexes[i]), loads[i], i))
            self.by_room += 1
        else:
            least = min(range(len(loads)), key=lambda i: (loads[i], len(indexes[i]), i))
            if (loads[best] - loads[least] > self.balance_threshold
                    and loads[best] > self.balance_ratio * loads[least]):
                choice = least
                self.by_load += 1
            else:
                choice = best
                self.by_prefix += 1
        indexes[choice].insert(hashes)
        return choice

    def clear(self) -> None:
        for index in self.indexes:
            index.clear()

    def stats(self) -> dict:
        return {"policy": self.policy, "routed": list(self.routed), "by_prefix": self.by_prefix,
                "by_load": self.by_load, "by_room": self.by_room}
