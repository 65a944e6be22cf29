"""The radix cache of a model with sliding-window layers: which cached window KV is kept,
pinned, evicted, and how much of a matched prefix a window layer can be served.

Contract (on top of ``radix_cache``'s)
--------------------------------------
* A node's tokens own their slots as in ``RadixCache``; each may also own a window slot
  (``HybridSlotAllocator.to_window``). A token that lost it is a tombstone: its global layers'
  KV is still cached, its window layers' is not.
* A lock on a node also pins the window KV of the last ``window - 1`` tokens of its path, the
  keys a window layer reads from there (the locking request's window, a group prompt's
  followers'); so a node is locked only where that KV is there (a match ``match_served``
  gave, a request's own computed tokens). A request whose window has moved past its node
  unpins early (``unpin``, then ``unlock(node, pinned=False)``). Pinned window KV is never
  freed; all other window KV of the tree is evictable from the window region alone
  (``evict_window``, least recently used nodes first, leaves before their parents), which
  keeps the tokens' slots and their global layers' KV.
* ``match_served``: admission is served a matched prefix only up to where the window KV of the
  ``window - 1`` tokens before its end is all there; the rest is recomputed (and, on insertion,
  the recomputed window KV replaces the tombstones: ``insert``).
* Accounting of the window region, recounted from the parts by ``window_accounting``:
  free + evictable + locked + private == total, where locked is pinned and private is held by
  running requests outside the tree.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import torch

from radixd.core.kv_pool import KVPool, SlotAllocator
from radixd.core.radix_cache import MatchResult, RadixCache, TreeNode
from radixd.core.swa_pool import HybridSlotAllocator


def slots_and_cache(pool: KVPool, *, enabled: bool) -> tuple[SlotAllocator, RadixCache]:
    """A replica's slot allocator and radix cache over ``pool``: with a window region, the
    hybrid ones."""
    if not pool.window_slots:
        allocator = SlotAllocator(pool.num_slots)
        return allocator, RadixCache(allocator, enabled=enabled)
    hybrid = HybridSlotAllocator(pool.num_slots, pool.window_slots, pool.window)
    return hybrid, WindowRadixCache(hybrid, enabled=enabled)


class WindowRadixCache(RadixCache):
    """A ``RadixCache`` over a ``HybridSlotAllocator`` (the module docstring is the contract)."""

    def __init__(self, allocator: HybridSlotAllocator, *, enabled: bool = True):
        super().__init__(allocator, enabled=enabled)
        self.hybrid = allocator
        self.keep = allocator.window - 1  # keys before a query's position that a window layer reads
        self._pins = torch.zeros(allocator.total + 1, dtype=torch.int32)

    # ------------------------------------------------------------------ locks pin a window

    def _tail(self, node: TreeNode) -> torch.Tensor:
        """The slots of the last ``keep`` tokens of the path to ``node``."""
        parts, n = [], 0
        while not node.is_root and n < self.keep:
            parts.append(node.value)
            n += node.value.numel()
            node = node.parent  # type: ignore[assignment]
        if not parts:  # (the root, or a window of one key)
            return torch.empty(0, dtype=torch.int64)
        parts.reverse()
        return torch.cat(parts)[-self.keep :]

    def lock(self, node: TreeNode) -> None:
        super().lock(node)
        self._pins[self._tail(node)] += 1

    def unlock(self, node: TreeNode, *, pinned: bool = True) -> None:
        """``pinned`` False: a lock whose window was unpinned already (``unpin``)."""
        if pinned:
            self._pins[self._tail(node)] -= 1  # (before the base may drop the path: cache disabled)
        super().unlock(node)

    def unpin(self, node: TreeNode) -> None:
        """A lock's holder reads no more of the window KV its lock pinned (its window lies past
        the node); it unlocks with ``pinned=False``."""
        self._pins[self._tail(node)] -= 1

    # ------------------------------------------------------------------ serving and inserting

    def match_served(self, key: Sequence[int], namespace: int = 0) -> MatchResult:
        match = self.match_prefix(key, namespace)
        n = self.servable_len(match.slots)
        return match if n == match.slots.numel() else self.match_prefix(key[:n], namespace)

    def servable_len(self, slots: torch.Tensor) -> int:
        """The longest prefix of ``slots`` whose last ``keep`` tokens (or all, when fewer) have
        their window KV."""
        m = slots.numel()
        dead = ~self.hybrid.has_window(slots)
        if not dead[max(0, m - self.keep) :].any():
            return m
        idx = torch.arange(m)
        last_dead = torch.cummax(torch.where(dead, idx, -1), 0).values
        ok = (idx - last_dead) >= torch.clamp(idx + 1, max=self.keep)  # prefix of length idx + 1
        ends = ok.nonzero()
        return int(ends[-1]) + 1 if ends.numel() else 0

    def insert(self, key: Sequence[int], slots: torch.Tensor, namespace: int = 0) -> int:
        """``RadixCache.insert``; the tokens already cached whose window KV is gone take over
        the window KV that ``slots`` has for them (the caller frees the rest of ``slots``'s
        copies as before)."""
        existing = super().insert(key, slots, namespace)
        if existing:
            tree = self._cached_slots(key, existing, namespace)
            ours = slots[:existing]
            revive = ~self.hybrid.has_window(tree) & self.hybrid.has_window(ours)
            if revive.any():
                self.hybrid.move_window(ours[revive], tree[revive])
        return existing

    def _cached_slots(self, key: Sequence[int], n: int, namespace: int) -> torch.Tensor:
        """The tree's slots of ``key[:n]`` (cached), read without splitting or touching."""
        node, parts, got = self._root(namespace), [], 0
        while got < n:
            node = node.children[key[got]]
            parts.append(node.value[: n - got])
            got += parts[-1].numel()
        return torch.cat(parts)

    # ------------------------------------------------------------------ the window region

    def make_window_room(self, n: int) -> bool:
        """True if ``n`` window slots are free, evicting the tree's unpinned window KV if
        needed. (Evicting whole leaves would give no more: pins lie on locked paths only, so
        an unlocked node's window KV is all evictable here.)"""
        short = n - self.hybrid.window_available
        if short > 0:
            self.evict_window(short)
        return self.hybrid.window_available >= n

    def evict_window(self, n: int) -> int:
        """Free at least ``n`` window slots of the tree's unpinned tokens if there are as many,
        least recently used nodes first and each node before its parent; the tokens stay
        cached as tombstones. Returns how many were freed."""
        heap = list(self._leaves)
        heapq.heapify(heap)
        seen = set(heap)
        freed = 0
        while freed < n and heap:
            node = heapq.heappop(heap)
            v = node.value
            loose = v[self.hybrid.has_window(v) & (self._pins[v] == 0)]
            freed += self.hybrid.free_window(loose)
            parent = node.parent
            if parent is not None and not parent.is_root and parent not in seen:
                seen.add(parent)
                heapq.heappush(heap, parent)
        return freed

    # ------------------------------------------------------------------ accounting

    def window_accounting(self, private: list[torch.Tensor]) -> dict[str, int]:
        """The window region's free + evictable + locked + private == total, recounted;
        ``private``: the running requests' slots outside the tree."""
        tree = self.all_slots()
        alive = tree[self.hybrid.has_window(tree)]
        locked = int((self._pins[alive] > 0).sum())
        mine = torch.cat(private) if private else torch.empty(0, dtype=torch.int64)
        return {
            "window_total": self.hybrid.window_total,
            "window_free": self.hybrid.window_available,
            "window_evictable": int(alive.numel()) - locked,
            "window_locked": locked,
            "window_private": int(self.hybrid.has_window(mine).sum()),
        }

    def check_window(self, private: list[torch.Tensor]) -> None:
        """The window region's accounting, and each window slot owned once (by the free list
        or one slot); pinned tokens have their window KV; free slots have none."""
        a = self.window_accounting(private)
        if a["window_free"] + a["window_evictable"] + a["window_locked"] + a["window_private"] != a["window_total"]:
            raise AssertionError(f"window KV accounting broken: {a}")
        m = self.hybrid.to_window
        held = m[m != 0]
        every = torch.cat((self.hybrid.windows.free_slots(), held))
        if every.numel() != a["window_total"] or torch.unique(every).numel() != a["window_total"]:
            raise AssertionError("window KV slots are lost or owned twice")
        if (m[self.hybrid.free_slots()] != 0).any():
            raise AssertionError("a free slot holds window KV")
        if ((self._pins > 0) & (m == 0)).any() or (self._pins < 0).any():
            raise AssertionError("pinned window KV is gone (or a pin count is negative)")
