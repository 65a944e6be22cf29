"""Radix cache: a radix tree over token ids whose nodes own KV pool slots.

Contract
--------
* Only the scheduler (event-loop thread) calls into the cache.
* A node's ``value`` holds one slot per token of its ``key``; those slots belong to the tree
  until the node is evicted, when they go back to the ``SlotAllocator``.
* A running request that uses a cached prefix holds a lock on the deepest node of that prefix
  (``lock``), which pins the whole path to the root. Only unlocked leaves are evicted, least
  recently used first, and only when ``evict`` is asked for room.
* ``match_prefix`` *may split a node* so that the match ends on a node boundary; it changes
  no slot ownership. ``peek_prefix_len`` is the read-only variant used for ranking, and
  ``continuation`` (the cached tokens past a key, for speculative drafting) reads only too.
* Lower tiers (``radixd.core.tiers``): ``backed`` records that the pages ending in a node are
  held by the tiers too; ``hits`` counts admissions that matched through it (for the
  write-through-after-N-hits policy). ``on_evict(leaf)``, if set, runs before a leaf's
  slots go back to the allocator (write-back); it must not change the tree.
* KV-cache events (``radixd.core.kv_events``): ``listener``, if set, hears of namespace 0's
  nodes stored, split and removed and of flushes; it keeps each node's ``blocks`` (the hashes
  of the whole blocks ending in it) and must not change the tree. ``depth`` is a node's
  first token's position in its sequence.
* ``version`` changes whenever what an inspection shows changes: a node added, split or
  removed, a lock taken or dropped, a hit counted, pages marked ``backed`` (``mark_backed``).
  Readers (the dashboard's tree summary) reuse what they built while it stays the same.
* ``namespace`` keeps separate trees: namespace 0 is the shared cache; with the cache disabled
  each request group gets a private namespace (so the ``n`` samples of one request share their
  prompt) and nodes are freed as soon as their last lock goes.

Accounting: ``allocator.available + evictable_size + protected_size + (slots held privately
by requests) == allocator.total`` at every step boundary.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from typing import NamedTuple

import torch

from radixd.core.kv_pool import SlotAllocator

_CHUNK = 64  # tokens of an edge compared at once (as tuples, at C speed)


class TreeNode:
    __slots__ = ("children", "parent", "key", "value", "lock_ref", "last_access", "namespace", "hits", "backed",
                 "depth", "blocks")

    def __init__(self, parent: TreeNode | None, key: tuple[int, ...], value: torch.Tensor, namespace: int,
                 depth: int = 0):
        self.children: dict[int, TreeNode] = {}
        self.parent = parent
        self.key = key
        self.value = value
        self.lock_ref = 0
        self.last_access = 0
        self.namespace = namespace
        self.hits = 0          # admissions whose cached prefix ran through this node
        self.backed = False    # its pages are in the lower tiers too
        self.depth = depth     # tokens before its first one
        self.blocks: tuple[int, ...] = ()  # KV-event hashes of the blocks ending in it (with a listener)

    @property
    def is_root(self) -> bool:
        return self.parent is None

    def __lt__(self, other: TreeNode) -> bool:  # heap order: least recently used first
        return self.last_access < other.last_access


class MatchResult(NamedTuple):
    slots: torch.Tensor  # int64 slots of the matched prefix, in token order
    node: TreeNode       # deepest node of the match (a root when nothing matched)


class RadixCache:
    def __init__(self, allocator: SlotAllocator, *, enabled: bool = True):
        self.allocator = allocator
        self.enabled = enabled
        self._roots: dict[int, TreeNode] = {}
        self._clock = itertools.count(1)
        self._namespaces = itertools.count(1)
        self.evictable_size = 0
        self.protected_size = 0
        self._leaves: set[TreeNode] = set()  # non-root nodes without children
        self.on_evict = None  # callable(leaf) before a leaf's slots are freed (tier write-back)
        self.listener = None  # kv_events.Recorder: stored / split / removed / cleared
        self.version = 0  # bumped by every change an inspection shows (see the contract)
        # Counters: prompt tokens looked up vs served from the cache.
        self.queried_tokens = 0
        self.hit_tokens = 0

    # ------------------------------------------------------------------ namespaces

    def new_namespace(self) -> int:
        """A private namespace (used per request group when the shared cache is disabled)."""
        return next(self._namespaces)

    def default_namespace(self) -> int:
        return 0 if self.enabled else self.new_namespace()

    @property
    def shared_root(self) -> TreeNode:
        """Namespace 0's root (read-only use: inspection such as the dashboard's summary)."""
        return self._root(0)

    def _root(self, namespace: int) -> TreeNode:
        root = self._roots.get(namespace)
        if root is None:
            root = TreeNode(None, (), torch.empty(0, dtype=torch.int64), namespace)
            root.lock_ref = 1  # roots are never evicted
            self._roots[namespace] = root
        return root

    # ------------------------------------------------------------------ lookup

    def peek_prefix_len(self, key: Sequence[int], namespace: int = 0) -> int:
        """Length of the cached prefix of ``key``; changes nothing."""
        node = self._roots.get(namespace)
        n = 0
        while node is not None and n < len(key):
            child = node.children.get(key[n])
            if child is None:
                break
            m = _common_len(child.key, key, n)
            n += m
            if m < len(child.key):
                break
            node = child
        return n

    def continuation(self, key: Sequence[int], namespace: int = 0, limit: int = 8) -> list[int]:
        """Up to ``limit`` cached tokens that follow the whole of ``key`` (where the tree
        forks, the most recently used branch); [] if ``key`` is not cached to its end.
        Changes nothing (speculative drafting reads it every step)."""
        node = self._roots.get(namespace)
        n = 0
        out: list[int] = []
        while node is not None and n < len(key):
            child = node.children.get(key[n])
            if child is None:
                return []
            m = _common_len(child.key, key, n)
            n += m
            if m < len(child.key):
                if n < len(key):
                    return []  # the cached path leaves ``key`` inside this edge
                out = list(child.key[m : m + limit])
            node = child
        while node is not None and len(out) < limit and node.children:
            node = max(node.children.values(), key=lambda c: c.last_access)
            out += node.key[: limit - len(out)]
        return out

    def match_prefix(self, key: Sequence[int], namespace: int = 0) -> MatchResult:
        """Longest cached prefix of ``key``. Splits the last node if the match ends inside it
        and marks the path as used now."""
        node = self._root(namespace)
        now = next(self._clock)
        parts: list[torch.Tensor] = []
        n = 0
        while n < len(key):
            child = node.children.get(key[n])
            if child is None:
                break
            m = _common_len(child.key, key, n)
            if m < len(child.key):
                child = self._split(child, m)
            child.last_access = now
            parts.append(child.value)
            n += m
            node = child
        slots = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)
        return MatchResult(slots, node)

    def match_served(self, key: Sequence[int], namespace: int = 0) -> MatchResult:
        """The cached prefix of ``key`` that admission may use: ``match_prefix``'s here (a
        cache whose KV can be partly gone, ``swa_cache``, serves less)."""
        return self.match_prefix(key, namespace)

    def record_query(self, queried: int, hit: int) -> None:
        self.queried_tokens += queried
        self.hit_tokens += hit

    # ------------------------------------------------------------------ insert

    def insert(self, key: Sequence[int], slots: torch.Tensor, namespace: int = 0) -> int:
        """Insert ``key`` with ``slots`` (one per token). Returns how many leading tokens were
        already cached: the tree keeps its own slots for those, and the caller must free the
        ones it passed for that range that differ. The rest of ``slots`` now belong to the tree.
        """
        if len(key) != slots.numel():
            raise ValueError("insert: key and slots differ in length")
        node = self._root(namespace)
        now = next(self._clock)
        n = 0
        while n < len(key):
            child = node.children.get(key[n])
            if child is None:
                new = TreeNode(node, tuple(key[n:]), slots[n:].clone(), namespace, depth=n)
                new.last_access = now
                node.children[key[n]] = new
                self._leaves.discard(node)
                self._leaves.add(new)
                self.evictable_size += len(new.key)
                self.version += 1
                if self.listener is not None and namespace == 0:
                    self.listener.stored(new)
                return n
            m = _common_len(child.key, key, n)
            if m < len(child.key):
                child = self._split(child, m)
            child.last_access = now
            n += m
            node = child
        return n

    def _split(self, child: TreeNode, m: int) -> TreeNode:
        """Cut ``child`` after its first ``m`` tokens; returns the new upper node."""
        parent = child.parent
        assert parent is not None
        upper = TreeNode(parent, child.key[:m], child.value[:m], child.namespace, depth=child.depth)
        upper.lock_ref = child.lock_ref
        upper.last_access = child.last_access
        upper.hits = child.hits
        upper.backed = child.backed
        upper.children[child.key[m]] = child
        parent.children[child.key[0]] = upper
        child.parent = upper
        child.key = child.key[m:]
        child.value = child.value[m:]
        child.depth += m
        self.version += 1
        if self.listener is not None and child.blocks:
            self.listener.split(upper, child)
        return upper

    # ------------------------------------------------------------------ locks

    def lock(self, node: TreeNode) -> None:
        self.version += 1
        while not node.is_root:
            if node.lock_ref == 0:
                self.evictable_size -= len(node.key)
                self.protected_size += len(node.key)
            node.lock_ref += 1
            node = node.parent  # type: ignore[assignment]

    def unlock(self, node: TreeNode) -> None:
        self.version += 1
        leaf = node
        while not node.is_root:
            if node.lock_ref <= 0:
                raise RuntimeError("radix cache: unlock of an unlocked node")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.evictable_size += len(node.key)
                self.protected_size -= len(node.key)
            node = node.parent  # type: ignore[assignment]
        if not self.enabled:
            self._free_unlocked_path(leaf)

    def _free_unlocked_path(self, node: TreeNode) -> None:
        """Disabled cache: drop a node chain as soon as nothing holds it."""
        while not node.is_root and node.lock_ref == 0 and not node.children:
            parent = node.parent
            self._delete_leaf(node)
            node = parent  # type: ignore[assignment]
        root = self._roots.get(node.namespace)
        if root is not None and not root.children and node.namespace != 0:
            del self._roots[node.namespace]

    def drop_unlocked_path(self, node: TreeNode, stop: TreeNode) -> None:
        """Delete ``node`` and its ancestors below ``stop`` while unlocked and childless
        (KV that a failed step never computed)."""
        while node is not stop and not node.is_root and node.lock_ref == 0 and not node.children:
            parent = node.parent
            self._delete_leaf(node)
            node = parent  # type: ignore[assignment]

    # ------------------------------------------------------------------ eviction

    def evict(self, num_tokens: int, *, write_back: bool = True) -> int:
        """Free at least ``num_tokens`` slots from unlocked leaves, LRU first, if possible
        (each through ``on_evict`` first unless ``write_back`` is False).
        Returns the number of slots freed."""
        if num_tokens <= 0 or self.evictable_size == 0:
            return 0
        on_evict = self.on_evict if write_back else None
        heap = [n for n in self._leaves if n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            leaf = heapq.heappop(heap)
            parent = leaf.parent
            freed += len(leaf.key)
            if on_evict is not None and not leaf.backed and leaf.namespace == 0:
                on_evict(leaf)
            self._delete_leaf(leaf)
            if parent is not None and not parent.is_root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, parent)
        return freed

    def _delete_leaf(self, leaf: TreeNode) -> None:
        parent = leaf.parent
        assert parent is not None and not leaf.children and leaf.lock_ref == 0
        if self.listener is not None and leaf.namespace == 0:
            self.listener.removed(leaf)
        del parent.children[leaf.key[0]]
        self._leaves.discard(leaf)
        if not parent.children and not parent.is_root:
            self._leaves.add(parent)
        self.allocator.free(leaf.value)
        self.evictable_size -= len(leaf.key)
        self.version += 1

    def reset(self) -> bool:
        """Drop every unlocked node (``/flush_cache``). Returns False if something is locked."""
        if self.protected_size:
            return False
        listener, self.listener = self.listener, None  # one AllBlocksCleared, not a removal per leaf
        try:
            self.evict(self.evictable_size, write_back=False)
        finally:
            self.listener = listener
        self._roots = {ns: r for ns, r in self._roots.items() if r.children or ns == 0}
        if listener is not None:
            listener.cleared()
        return True

    # ------------------------------------------------------------------ paths

    @staticmethod
    def path(node: TreeNode) -> list[TreeNode]:
        """The nodes from below the root down to ``node``."""
        out = []
        while not node.is_root:
            out.append(node)
            node = node.parent  # type: ignore[assignment]
        out.reverse()
        return out

    def count_hit(self, node: TreeNode) -> None:
        self.version += 1
        while not node.is_root:
            node.hits += 1
            node = node.parent  # type: ignore[assignment]

    def mark_backed(self, nodes) -> None:
        """The pages ending in each of ``nodes`` are held by the lower tiers too."""
        self.version += 1
        for node in nodes:
            node.backed = True

    # ------------------------------------------------------------------ inspection

    @property
    def total_size(self) -> int:
        return self.evictable_size + self.protected_size

    def all_slots(self) -> torch.Tensor:
        parts = []
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            parts.append(node.value)
            stack.extend(node.children.values())
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)

    def check(self) -> None:
        """Recount sizes from the tree and compare with the running counters."""
        evictable = protected = 0
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            if not node.is_root:
                if len(node.key) != node.value.numel() or not node.key:
                    raise AssertionError("radix node key/value mismatch")
                if node.lock_ref < 0:
                    raise AssertionError("negative lock count")
                if node.lock_ref:
                    protected += len(node.key)
                else:
                    evictable += len(node.key)
                for child in node.children.values():
                    if child.lock_ref > node.lock_ref:
                        raise AssertionError("child locked more than its parent")
                if (not node.children) != (node in self._leaves):
                    raise AssertionError("leaf set out of step with the tree")
            stack.extend(node.children.values())
        if (evictable, protected) != (self.evictable_size, self.protected_size):
            raise AssertionError(
                f"radix counters drifted: counted evictable={evictable} protected={protected}, "
                f"tracked evictable={self.evictable_size} protected={self.protected_size}"
            )


def _common_len(node_key: tuple[int, ...], key: Sequence[int], offset: int) -> int:
    """Tokens ``node_key`` shares with ``key[offset:]``: compared a chunk at a time at C speed
    (edges run to thousands of tokens), then token by token inside the first differing chunk."""
    n = min(len(node_key), len(key) - offset)
    i = 0
    while i + _CHUNK <= n and tuple(key[offset + i : offset + i + _CHUNK]) == node_key[i : i + _CHUNK]:
        i += _CHUNK
    while i < n and node_key[i] == key[offset + i]:
        i += 1
    return i
