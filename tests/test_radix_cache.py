"""RadixCache against a naive reference model.

The reference keeps, per namespace, a dict ``prefix tuple -> slot`` holding every cached
prefix of every inserted (and not evicted) key, plus the time each prefix was last touched by
``insert``/``match_prefix`` and the list of locks held. A hypothesis state machine drives the
cache with short keys over a tiny alphabet (so prefixes collide and nodes split) and after
every step compares the whole tree with the reference, recounts locks and sizes, and checks
that every slot of the pool is either free or owned by exactly one node.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from radixd.core.kv_pool import SlotAllocator
from radixd.core.radix_cache import RadixCache, TreeNode

ALPHABET = (0, 1, 2)
MAX_KEY = 10  # no key (inserted or extended) is longer, so no node is either
POOL_SLOTS = 31  # slot 0 is padding: 30 usable slots, few enough that eviction is frequent

keys = st.lists(st.sampled_from(ALPHABET), min_size=0, max_size=6).map(tuple)
extensions = st.lists(st.sampled_from(ALPHABET), min_size=1, max_size=4).map(tuple)


# ---------------------------------------------------------------------------- tree helpers


def iter_nodes(cache: RadixCache):
    """Yield ``(namespace, node, path)`` for every non-root node; ``path`` is the full key
    from the root to the end of the node. Also checks the parent/child links."""
    for ns, root in cache._roots.items():
        assert root.is_root and root.namespace == ns and root.lock_ref == 1
        stack: list[tuple[TreeNode, tuple[int, ...]]] = [(root, ())]
        while stack:
            node, path = stack.pop()
            for tok, child in node.children.items():
                assert child.parent is node, "child does not point back at its parent"
                assert child.key and child.key[0] == tok, "child filed under the wrong token"
                assert child.namespace == ns
                full = path + child.key
                yield ns, child, full
                stack.append((child, full))


def tree_contents(cache: RadixCache) -> dict[tuple[int, tuple[int, ...]], int]:
    """``(namespace, prefix) -> slot`` for every token position stored in the tree."""
    out = {}
    for ns, node, full in iter_nodes(cache):
        start = len(full) - len(node.key)
        for i, slot in enumerate(node.value.tolist()):
            out[(ns, full[: start + i + 1])] = slot
    return out


def snapshot(cache: RadixCache):
    """Everything observable about the tree (structure, slots, locks, times, counters)."""
    nodes = sorted(
        (ns, full, id(node), id(node.parent), tuple(node.value.tolist()), node.lock_ref, node.last_access)
        for ns, node, full in iter_nodes(cache)
    )
    return (
        nodes,
        sorted(cache._roots),
        sorted(id(n) for n in cache._leaves),
        cache.evictable_size,
        cache.protected_size,
        cache.allocator.available,
        cache.allocator.free_slots().tolist(),
    )


def path_of(node: TreeNode) -> tuple[tuple[int, ...], TreeNode]:
    """Key spelled from the root down to ``node``, and the root reached."""
    parts = []
    while not node.is_root:
        parts.append(node.key)
        node = node.parent  # type: ignore[assignment]
    return tuple(t for part in reversed(parts) for t in part), node


# ---------------------------------------------------------------------------- reference model


@dataclass
class Handle:
    node: TreeNode
    ns: int
    key: tuple[int, ...]  # the cached key the lock was taken on (ends on a node boundary)


class Reference:
    def __init__(self) -> None:
        self.slot: dict[tuple[int, tuple[int, ...]], int] = {}  # (ns, prefix) -> slot
        self.time: dict[tuple[int, tuple[int, ...]], int] = {}  # (ns, prefix) -> last touch
        self.handles: list[Handle] = []
        self.clock = 0

    def tick(self) -> int:
        self.clock += 1
        return self.clock

    def longest(self, ns: int, key) -> int:
        n = 0
        while n < len(key) and (ns, tuple(key[: n + 1])) in self.slot:
            n += 1
        return n

    def slots_of(self, ns: int, key, n: int) -> list[int]:
        return [self.slot[(ns, tuple(key[: i + 1]))] for i in range(n)]

    def touch(self, ns: int, key, n: int, now: int) -> None:
        for i in range(n):
            self.time[(ns, tuple(key[: i + 1]))] = now

    def locked(self) -> set[tuple[int, tuple[int, ...]]]:
        return {(h.ns, h.key[: i + 1]) for h in self.handles for i in range(len(h.key))}

    def has_child(self, ns: int, prefix: tuple[int, ...]) -> bool:
        return any((ns, prefix + (t,)) in self.slot for t in ALPHABET)

    def remove(self, entry) -> None:
        del self.slot[entry]
        del self.time[entry]

    def free_unlocked_path(self, ns: int, key: tuple[int, ...]) -> None:
        """Disabled cache: after an unlock, drop the key's tail that nothing holds."""
        locked = self.locked()
        i = len(key)
        while i > 0 and (ns, key[:i]) not in locked and not self.has_child(ns, key[:i]):
            self.remove((ns, key[:i]))
            i -= 1


# ---------------------------------------------------------------------------- state machine


class RadixCacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.allocator = SlotAllocator(POOL_SLOTS)
        self.ref = Reference()

    @initialize(enabled=st.booleans())
    def setup(self, enabled: bool) -> None:
        self.enabled = enabled
        self.cache = RadixCache(self.allocator, enabled=enabled)
        if enabled:
            assert self.cache.default_namespace() == 0
            self.namespaces = [0, self.cache.new_namespace()]
        else:
            self.namespaces = [self.cache.default_namespace(), self.cache.default_namespace()]
            assert 0 not in self.namespaces
        assert len(set(self.namespaces)) == len(self.namespaces)

    # -------------------------------------------------------------- helpers

    def _evict(self, n: int) -> int:
        before = dict(self.ref.slot)
        locked = self.ref.locked()
        evictable_before = self.cache.evictable_size
        assert evictable_before == len(before) - len(locked)
        freed = self.cache.evict(n)
        after = tree_contents(self.cache)
        assert after.items() <= before.items(), "evict changed or added cached entries"
        gone = set(before) - set(after)
        assert freed == len(gone), "evict reported a different count than it removed"
        assert not gone & locked, "evict removed a locked prefix"
        if n <= 0:
            assert freed == 0
        else:
            # Enough room unless everything unlocked is gone; at most one node too much.
            assert freed >= min(n, evictable_before)
            assert freed < n + MAX_KEY
        # LRU: nothing evicted was used more recently than an unlocked leaf that stays.
        stay = [
            e for e in after
            if e not in locked and not any((e[0], e[1] + (t,)) in after for t in ALPHABET)
        ]
        if gone and stay:
            assert max(self.ref.time[e] for e in gone) <= min(self.ref.time[e] for e in stay), (
                "evict removed a leaf that was used more recently than one it kept"
            )
        for e in gone:
            self.ref.remove(e)
        return freed

    def _take(self, n: int) -> torch.Tensor | None:
        """Fresh slots, evicting as the scheduler does when the free list is short."""
        if self.allocator.available < n:
            self._evict(n - self.allocator.available)
        return self.allocator.alloc(n)

    def _match(self, ns: int, key: tuple[int, ...]):
        expected = self.ref.longest(ns, key)
        assert self.cache.peek_prefix_len(list(key), ns) == expected
        res = self.cache.match_prefix(list(key), ns)
        now = self.ref.tick()
        assert res.slots.dtype == torch.int64
        assert res.slots.tolist() == self.ref.slots_of(ns, key, expected), (
            "match_prefix returned the wrong length or not the slots first stored"
        )
        spelled, root = path_of(res.node)
        assert spelled == key[:expected], "match node does not end where the match ends"
        assert root is self.cache._roots[ns] and res.node.namespace == ns
        self.ref.touch(ns, key, expected, now)
        return res, expected

    def _unlock(self, h: Handle) -> None:
        self.cache.unlock(h.node)
        self.ref.handles.remove(h)
        if not self.enabled:
            self.ref.free_unlocked_path(h.ns, h.key)

    # -------------------------------------------------------------- rules

    @rule(ns_i=st.integers(0, 1), key=keys)
    def insert(self, ns_i: int, key: tuple[int, ...]) -> None:
        ns = self.namespaces[ns_i]
        slots = self._take(len(key))
        if slots is None:
            return  # everything is locked: the scheduler would wait
        expected = self.ref.longest(ns, key)
        existing = self.cache.insert(list(key), slots, ns)
        now = self.ref.tick()
        assert existing == expected, "insert misreported how much was already cached"
        self.allocator.free(slots[:existing])  # the tree keeps its own copies of those
        for i in range(existing, len(key)):
            self.ref.slot[(ns, key[: i + 1])] = int(slots[i])
        self.ref.touch(ns, key, len(key), now)

    @rule(ns_i=st.integers(0, 1), key=keys)
    def match(self, ns_i: int, key: tuple[int, ...]) -> None:
        self._match(self.namespaces[ns_i], key)

    @rule(ns_i=st.integers(0, 1), key=keys)
    def match_and_lock(self, ns_i: int, key: tuple[int, ...]) -> None:
        ns = self.namespaces[ns_i]
        res, n = self._match(ns, key)
        self.cache.lock(res.node)
        self.ref.handles.append(Handle(res.node, ns, key[:n]))

    @precondition(lambda self: self.ref.handles)
    @rule(data=st.data())
    def unlock(self, data) -> None:
        self._unlock(data.draw(st.sampled_from(self.ref.handles)))

    @precondition(lambda self: self.ref.handles)
    @rule(data=st.data(), ext=extensions)
    def extend(self, data, ext: tuple[int, ...]) -> None:
        """The scheduler's hand-over: a request holding ``key`` computed ``ext`` more tokens
        into its own slots; insert all of it, drop duplicated slots, move its lock down."""
        h = data.draw(st.sampled_from(self.ref.handles))
        key = h.key + ext
        if len(key) > MAX_KEY:
            return
        own = self._take(len(ext))
        if own is None:
            return
        cached = torch.tensor(self.ref.slots_of(h.ns, h.key, len(h.key)), dtype=torch.int64)
        expected = self.ref.longest(h.ns, key)
        assert expected >= len(h.key), "a locked prefix went missing"
        existing = self.cache.insert(list(key), torch.cat((cached, own)), h.ns)
        now = self.ref.tick()
        assert existing == expected
        self.allocator.free(own[: existing - len(h.key)])
        for i in range(existing, len(key)):
            self.ref.slot[(h.ns, key[: i + 1])] = int(own[i - len(h.key)])
        self.ref.touch(h.ns, key, len(key), now)
        res, n = self._match(h.ns, key)
        assert n == len(key)
        self.cache.lock(res.node)
        self.ref.handles.append(Handle(res.node, h.ns, key))
        self._unlock(h)

    @rule(ns_i=st.integers(0, 2), key=keys)
    def peek(self, ns_i: int, key: tuple[int, ...]) -> None:
        ns = self.namespaces[ns_i] if ns_i < 2 else 10_000  # 2: a namespace never used
        before = snapshot(self.cache)
        n = self.cache.peek_prefix_len(list(key), ns)
        assert n == self.ref.longest(ns, key)
        assert snapshot(self.cache) == before, "peek_prefix_len changed the cache"

    @rule(n=st.one_of(st.integers(-1, 6), st.integers(7, POOL_SLOTS + 2)))
    def evict(self, n: int) -> None:
        self._evict(n)

    @rule(now=st.integers(0, 3))
    def reset(self, now: int) -> None:
        if now:  # flushing the cache is rare: most of the time, keep the tree growing
            return
        something_locked = bool(self.ref.locked())
        before = snapshot(self.cache)
        ok = self.cache.reset()
        assert ok == (not something_locked)
        if not ok:
            assert snapshot(self.cache) == before, "a refused reset changed the cache"
            return
        self.ref.slot.clear()
        self.ref.time.clear()
        assert self.allocator.available == self.allocator.total
        assert self.cache.all_slots().numel() == 0
        assert set(self.cache._roots) <= {0}, "reset kept an empty private namespace"

    # -------------------------------------------------------------- invariants

    @invariant()
    def consistent(self) -> None:
        """Checked after every step, the tree itself first."""
        if not hasattr(self, "cache"):  # before ``setup``
            return
        self.tree_matches_reference()
        self.accounting()
        self.locks_match_handles()
        self.access_times_follow_reference()

    def tree_matches_reference(self) -> None:
        self.cache.check()
        assert tree_contents(self.cache) == self.ref.slot

    def accounting(self) -> None:
        cache, alloc = self.cache, self.allocator
        locked = self.ref.locked()
        assert cache.protected_size == len(locked)
        assert cache.evictable_size == len(self.ref.slot) - len(locked)
        assert alloc.available + cache.evictable_size + cache.protected_size == alloc.total
        every = torch.cat((alloc.free_slots(), cache.all_slots()))
        assert sorted(every.tolist()) == list(range(1, alloc.total + 1)), "a slot was lost or doubled"

    def locks_match_handles(self) -> None:
        for ns, node, full in iter_nodes(self.cache):
            holders = sum(1 for h in self.ref.handles if h.ns == ns and h.key[: len(full)] == full)
            assert node.lock_ref == holders, f"lock_ref {node.lock_ref} != {holders} holders"
        for h in self.ref.handles:
            if h.key:
                spelled, root = path_of(h.node)
                assert spelled == h.key, "a locked node moved"
                assert root is self.cache._roots[h.ns], "a locked node fell out of the tree"

    def access_times_follow_reference(self) -> None:
        """Each node's ``last_access`` orders nodes exactly as the reference's touch times."""
        pairs = set()
        for ns, node, full in iter_nodes(self.cache):
            start = len(full) - len(node.key)
            times = {self.ref.time[(ns, full[:i])] for i in range(start + 1, len(full) + 1)}
            assert len(times) == 1, "one node holds prefixes touched at different times"
            pairs.add((node.last_access, times.pop()))
        ordered = sorted(pairs)
        assert len({a for a, _ in ordered}) == len({t for _, t in ordered}) == len(ordered)
        assert [t for _, t in ordered] == sorted(t for _, t in ordered)


RadixCacheMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestRadixCacheMachine = RadixCacheMachine.TestCase


# ---------------------------------------------------------------------------- unit tests


def _slots(alloc: SlotAllocator, n: int) -> torch.Tensor:
    s = alloc.alloc(n)
    assert s is not None
    return s


def test_match_splits_without_moving_slots_and_peek_does_not_split():
    alloc = SlotAllocator(17)
    cache = RadixCache(alloc)
    s = _slots(alloc, 4)
    assert cache.insert([1, 2, 3, 4], s) == 0
    assert cache.peek_prefix_len([1, 2, 9]) == 2
    assert len(list(iter_nodes(cache))) == 1  # peek did not split
    res = cache.match_prefix([1, 2, 9])
    assert res.slots.tolist() == s[:2].tolist()
    assert res.node.key == (1, 2) and len(res.node.children) == 1
    assert len(list(iter_nodes(cache))) == 2
    assert cache.match_prefix([1, 2, 3, 4, 5]).slots.tolist() == s.tolist()
    cache.check()


def test_prefix_lookup_stops_where_the_key_leaves_a_node():
    alloc = SlotAllocator(17)
    cache = RadixCache(alloc)
    cache.insert([0, 1, 2], _slots(alloc, 3))
    cache.insert([0, 1, 0], _slots(alloc, 3))  # node [0, 1] with children [2] and [0]
    # [0, 2] leaves node [0, 1] after one token; its next token must not be read against
    # the children of [0, 1].
    assert cache.peek_prefix_len([0, 2]) == 1
    assert cache.match_prefix([0, 2]).slots.numel() == 1
    assert cache.peek_prefix_len([0, 1, 2, 2]) == 3
    assert cache.peek_prefix_len([]) == 0 and cache.peek_prefix_len([1]) == 0


def test_insert_reports_cached_prefix_and_rejects_length_mismatch():
    alloc = SlotAllocator(17)
    cache = RadixCache(alloc)
    a = _slots(alloc, 3)
    assert cache.insert([5, 6, 7], a) == 0
    b = _slots(alloc, 5)
    assert cache.insert([5, 6, 7, 8, 9], b) == 3
    alloc.free(b[:3])
    assert cache.match_prefix([5, 6, 7, 8, 9]).slots.tolist() == a.tolist() + b[3:].tolist()
    with pytest.raises(ValueError):
        cache.insert([1, 2], torch.tensor([1], dtype=torch.int64))
    assert alloc.available + cache.total_size == alloc.total


def test_evict_is_lru_and_spares_locked_paths():
    alloc = SlotAllocator(17)
    cache = RadixCache(alloc)
    cache.insert([1, 1], _slots(alloc, 2))
    cache.insert([2, 2], _slots(alloc, 2))
    cache.insert([3, 3], _slots(alloc, 2))
    cache.match_prefix([1, 1])  # [2, 2] is now the least recently used
    assert cache.evict(1) == 2
    assert cache.peek_prefix_len([2, 2]) == 0
    assert cache.peek_prefix_len([1, 1]) == cache.peek_prefix_len([3, 3]) == 2
    node = cache.match_prefix([3, 3]).node
    cache.lock(node)
    assert cache.evict(100) == 2  # only [1, 1] can go
    assert cache.peek_prefix_len([3, 3]) == 2 and cache.peek_prefix_len([1, 1]) == 0
    assert cache.protected_size == 2 and cache.evictable_size == 0
    cache.unlock(node)
    with pytest.raises(RuntimeError):
        cache.unlock(node)


def test_evict_takes_unlocked_leaves_below_a_locked_node():
    alloc = SlotAllocator(17)
    cache = RadixCache(alloc)
    cache.insert([1, 2, 3, 4], _slots(alloc, 4))
    node = cache.match_prefix([1, 2]).node
    cache.lock(node)
    assert cache.evict(1) == 2  # the [3, 4] tail is unlocked
    assert cache.peek_prefix_len([1, 2, 3, 4]) == 2
    assert cache.evict(1) == 0
    cache.check()


def test_namespaces_are_isolated():
    alloc = SlotAllocator(17)
    cache = RadixCache(alloc)
    private = cache.new_namespace()
    a = _slots(alloc, 3)
    cache.insert([1, 2, 3], a)
    assert cache.peek_prefix_len([1, 2, 3], private) == 0
    assert cache.match_prefix([1, 2, 3], private).slots.numel() == 0
    b = _slots(alloc, 3)
    assert cache.insert([1, 2, 3], b, private) == 0  # not the shared entry
    assert cache.match_prefix([1, 2, 3], private).slots.tolist() == b.tolist()
    assert cache.match_prefix([1, 2, 3]).slots.tolist() == a.tolist()
    assert cache.total_size == 6


def test_disabled_cache_frees_private_nodes_on_last_unlock():
    alloc = SlotAllocator(17)
    cache = RadixCache(alloc, enabled=False)
    ns, other = cache.default_namespace(), cache.default_namespace()
    assert 0 not in (ns, other) and ns != other
    s = _slots(alloc, 4)
    assert cache.insert([1, 2, 3, 4], s, ns) == 0
    full = cache.match_prefix([1, 2, 3, 4], ns).node
    cache.lock(full)
    prompt = cache.match_prefix([1, 2], ns).node  # a sibling sample holds the shared prompt
    cache.lock(prompt)
    assert cache.peek_prefix_len([1, 2, 3, 4], other) == 0
    assert cache.peek_prefix_len([1, 2, 3, 4], 0) == 0
    assert cache.match_prefix([1, 2, 3, 4], other).slots.numel() == 0

    cache.unlock(full)  # the [3, 4] tail has no holder left: freed at once
    assert cache.peek_prefix_len([1, 2, 3, 4], ns) == 2
    assert alloc.available == alloc.total - 2
    free = set(alloc.free_slots().tolist())
    assert set(s[2:].tolist()) <= free and not set(s[:2].tolist()) & free  # the tail freed, the prompt held
    cache.check()

    cache.unlock(prompt)
    assert cache.peek_prefix_len([1, 2], ns) == 0
    assert alloc.available == alloc.total
    assert cache.total_size == 0
    assert ns not in cache._roots
    cache.check()


def test_enabled_cache_keeps_nodes_after_unlock():
    alloc = SlotAllocator(17)
    cache = RadixCache(alloc)
    cache.insert([1, 2, 3], _slots(alloc, 3))
    node = cache.match_prefix([1, 2, 3]).node
    cache.lock(node)
    cache.unlock(node)
    assert cache.peek_prefix_len([1, 2, 3]) == 3
    assert cache.evictable_size == 3 and cache.protected_size == 0


def test_reset_refuses_while_locked_then_frees_everything():
    alloc = SlotAllocator(17)
    cache = RadixCache(alloc)
    private = cache.new_namespace()
    cache.insert([1, 2, 3], _slots(alloc, 3))
    cache.insert([4, 5], _slots(alloc, 2), private)
    node = cache.match_prefix([1, 2]).node
    cache.lock(node)
    assert cache.reset() is False
    assert cache.total_size == 5 and alloc.available == alloc.total - 5
    cache.unlock(node)
    assert cache.reset() is True
    assert alloc.available == alloc.total
    assert cache.total_size == 0 and cache.all_slots().numel() == 0
    assert set(cache._roots) <= {0}
    assert sorted(alloc.free_slots().tolist()) == list(range(1, alloc.total + 1))
    cache.check()


def test_common_len_matches_token_by_token_comparison():
    """Edges are compared a chunk at a time; the result is the plain token-by-token one for
    mismatches inside a chunk, on its boundaries, past the key's end, and lists or tuples."""
    import random

    from radixd.core.radix_cache import _CHUNK, _common_len

    def plain(edge, key, off):
        n = 0
        while n < min(len(edge), len(key) - off) and edge[n] == key[off + n]:
            n += 1
        return n

    rng = random.Random(0)
    edge = tuple(rng.randrange(50) for _ in range(3 * _CHUNK + 5))
    for cut in (0, 1, _CHUNK - 1, _CHUNK, _CHUNK + 1, 2 * _CHUNK, len(edge) - 1, len(edge), None):
        for off in (0, 7):
            key = [9999] * off + list(edge)
            if cut is not None and cut < len(edge):
                key[off + cut] = -1  # the first difference at ``cut``
            for k in (key, tuple(key), key[: off + len(edge) // 2]):  # and a key ending early
                assert _common_len(edge, k, off) == plain(edge, k, off), (cut, off, len(k))
