"""KV memory of one replica: room, admission's cache hit, caching progress, release, rollback,
lower-tier traffic and accounting.

Contract
--------
* The only user of the replica's ``SlotAllocator``, ``RowAllocator``, ``RadixCache`` and
  ``KVHierarchy`` once the engine built them, and the only writer of a request's ``KVHandle``
  (but for the slots and table writes of a step the batch builder lays out). Called by the
  scheduler on the event-loop thread, between steps.
* Room is checked before a step is built (``make_room``, ``room_for``: eviction of unlocked
  cached KV when the free list is short) and taken as the step is built (``alloc``).
* Each running request holds exactly one lock in the tree, on ``kv.last_node``; a group's
  ``prompt_node`` holds one more on the followers' behalf until the last follower is admitted
  or leaves. ``commit`` moves a prefill chunk's KV into the tree as soon as the step is built
  (a later request may read it: the device runs steps in order); ``rollback`` undoes that.
* Lower tiers: a prefix match that continues past the pool loads those pages back into fresh
  slots at admission; pages are stored on eviction (write-back) or when a request leaves
  (write-through, or once its prefix was hit N times), per the tiers' write policy.
* Accounting: free + evictable + locked + private + reserved == total between steps, and every
  slot has exactly one owner (``check_accounting``). ``reserved``: slots held for KV that
  another instance writes (prefill/decode disaggregation: ``reserve``, ``received``,
  ``unreserve``).
* Sliding windows (a ``HybridSlotAllocator`` and ``WindowRadixCache``, see ``swa_pool``):
  room is also made in the window region, and before each step a running request's window
  KV behind its window is freed (``free_behind_windows``: what it holds privately; the
  tree's, once no lock pins it, goes when the window region is short, and a request whose
  window has moved past its cached part unpins it); both regions are accounted.
"""

from __future__ import annotations

import itertools
import math

import torch

from radixd.core.config import EngineConfig
from radixd.core.kv_handle import KVHandle
from radixd.core.kv_pool import RowAllocator, SlotAllocator
from radixd.core.radix_cache import RadixCache
from radixd.core.request import Group, Request
from radixd.core.scheduler_interface import ScheduledStep, SchedulerStats
from radixd.core.swa_cache import WindowRadixCache
from radixd.core.tiers.hierarchy import KVHierarchy

FREE_EVERY = 64  # tokens behind a request's window freed at once (fewer tensor operations per step)


class KVManager:
    def __init__(self, config: EngineConfig, *, allocator: SlotAllocator, rows: RowAllocator, cache: RadixCache,
                 tiers: KVHierarchy | None, stats: SchedulerStats):
        self.allocator = allocator
        self.rows = rows
        self.cache = cache
        self.tiers = tiers
        self.stats = stats
        self.reserve_ratio = config.schedule_conservativeness
        self.chunk = config.chunked_prefill_size
        self._load_events: list = []  # CUDA events of tier loads the next step must wait for
        # sliding windows: the window region's cache (None: no window region)
        self.window = cache if isinstance(cache, WindowRadixCache) else None
        self.reserved: dict[int, torch.Tensor] = {}  # key -> slots another instance writes into
        self._reservations = itertools.count()
        if tiers is not None and tiers.write_policy == "write_back":
            cache.on_evict = self._store_path

    # ------------------------------------------------------------------ room

    def make_room(self, n: int, keep: int = 0) -> bool:
        """True if ``n`` slots (plus ``keep`` spare) are free, evicting cached KV if needed.
        Slots are taken later, by ``alloc``."""
        want = n + keep
        if self.allocator.available < want:
            self.cache.evict(want - self.allocator.available)
        # (the window region needs only this step's tokens: requests free their own as they go)
        if self.window is not None and not self.window.make_window_room(n):
            return False
        return self.allocator.available >= want

    def room_for(self, want: int, planned: int) -> int:
        """How many of ``want`` slots can be had on top of ``planned`` (evicting if needed)."""
        if self.make_room(planned + want):
            return want
        free = self.allocator.available
        if self.window is not None:
            free = min(free, self.allocator.window_available)
        return max(0, min(want, free - planned))

    def _reserve(self, running: list[Request]) -> int:
        """KV to keep free for the running requests' remaining tokens (an estimate)."""
        total = 0
        for r in running:
            total += (r.seq_len - 1 - r.kv.length) + math.ceil(r.remaining_new_tokens * self.reserve_ratio)
        return total

    def alloc(self, n: int) -> torch.Tensor:
        """The ``n`` slots of the step being built (room was made for them)."""
        slots = self.allocator.alloc(n)
        assert slots is not None, "scheduler: room was checked before building"
        return slots

    # ------------------------------------------------------------------ a request's KV

    def prefetch(self, r: Request) -> None:
        """A new request arrived: start bringing its prefix up from the lower tiers."""
        if self.tiers is not None and r.namespace == 0 and r.preemptions == 0:
            self.tiers.prefetch(r.seq, self.cache.peek_prefix_len(r.seq, 0))

    def admit(self, r: Request, budget: int, planned: int, running: list[Request]) -> int | None:
        """Give ``r`` a table row, its cached prefix (locked) and room for its first chunk,
        keeping KV for the running requests' remaining tokens; the chunk's size, or None
        (nothing changed) if there is no room."""
        if self.rows.available == 0:
            return None
        seq = r.seq
        limit = len(seq) - 1
        missing = r.prompt_lp_missing
        if missing is not None:  # the logits before each wanted prompt token must be computed
            limit = min(limit, missing - 1)
        if r.pool is not None and r.pool.missing is not None:  # hidden states are not cached
            limit = min(limit, r.pool.missing)
        match = self.cache.match_served(seq[:limit], r.namespace)
        self.cache.lock(match.node)
        if self.tiers is not None and r.namespace == 0:
            match = self._load_from_tiers(seq, match, planned, limit)
        hit = match.slots.numel()
        n = min(len(seq) - hit, budget, self.chunk)
        reserve = self._reserve(running) + math.ceil(r.remaining_new_tokens * self.reserve_ratio)
        if not self.make_room(planned + n, keep=reserve + (len(seq) - hit - n)):
            self.cache.unlock(match.node)
            return None
        kv = r.kv
        kv.row = self.rows.alloc()
        kv.slots = match.slots
        kv.length = kv.cached_len = hit
        kv.last_node = match.node
        kv.table_writes.append((0, match.slots))
        if r.cached_tokens is None:
            r.cached_tokens = min(hit, len(r.prompt_ids))
            self.cache.record_query(len(r.prompt_ids), r.cached_tokens)
            self.cache.count_hit(match.node)
        if r.is_follower and r.group is not None:
            self.follower_gone(r.group)
        return n

    def free_behind_windows(self, running: list[Request]) -> None:
        """Sliding windows: free the window KV each running request holds privately that lies
        behind its window (a query at position p reads keys from p - window + 1; the next
        query of a request is at ``kv.length``), a few tokens at a time."""
        if self.window is None:
            return
        keep = self.window.keep
        every = min(FREE_EVERY, keep + 1)
        for r in running:
            kv = r.kv
            start = max(kv.window_freed, kv.cached_len)
            end = kv.length - keep
            if end - start >= every and kv.row is not None:
                self.allocator.free_window(kv.slots[start:end])
                kv.window_freed = end
            if end >= kv.cached_len and not kv.window_unpinned and kv.last_node is not None:
                self.window.unpin(kv.last_node)
                kv.window_unpinned = True

    def take_window_map(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The window slots assigned since the last step, for the next batch (or None)."""
        return self.allocator.take_map_writes() if self.window is not None else None

    def follower_gone(self, g: Group) -> None:
        """A follower of ``g`` waits no more (admitted or aborted): the last one frees the
        group's lock on the prompt."""
        g.followers_waiting -= 1
        if g.followers_waiting == 0 and g.prompt_node is not None:
            self.cache.unlock(g.prompt_node)

    def commit(self, plan: list[tuple[Request, int]]) -> None:
        """The step of ``plan`` is built: its KV positions count as computed from now on (the
        device runs steps in order, so a later step may read them), prefill chunks go into the
        cache, and a group leader that samples has its prompt cached for its followers."""
        leaders = []
        for r, n in plan:
            r.kv.length += n
            if n > 1:
                self._cache_progress(r)  # a prefill chunk: share it with later requests now
            if r.group is not None and r.index == 0:
                leaders.append(r)
        for r in leaders:
            g = r.group
            if g.prompt_node is None and g.followers_waiting > 0 and r.kv.length == r.seq_len:
                g.prompt_node = r.kv.last_node  # the leader's prompt is cached: followers may go
                self.cache.lock(g.prompt_node)

    def take_load_events(self) -> list:
        """The tier loads the step being built must wait for."""
        events, self._load_events = self._load_events, []
        return events

    def _cache_progress(self, r: Request) -> None:
        """Move ``r``'s computed KV into the radix tree and pin it with ``r``'s lock."""
        kv = r.kv
        key = r.seq[: kv.length]
        existing = self.cache.insert(key, kv.slots[: kv.length], r.namespace)
        if existing > kv.cached_len:
            # Someone cached these tokens meanwhile: drop our copies, read theirs.
            self.allocator.free(kv.slots[kv.cached_len : existing])
        match = self.cache.match_prefix(key, r.namespace)
        self.cache.lock(match.node)
        if kv.last_node is not None:
            self._unlock_last(kv)
        if existing > kv.cached_len:
            kv.table_writes.append((kv.cached_len, match.slots[kv.cached_len : existing]))
        kv.slots = match.slots
        kv.cached_len = kv.length
        kv.last_node = match.node

    def _unlock_last(self, kv: KVHandle) -> None:
        """Unlock ``kv.last_node`` (its window pin dropped already, if ``free_behind_windows``
        dropped it)."""
        if kv.window_unpinned:
            self.window.unlock(kv.last_node, pinned=False)
            kv.window_unpinned = False
        else:
            self.cache.unlock(kv.last_node)

    def release(self, r: Request) -> None:
        """``r`` leaves the running set: its KV goes into the cache (and the tiers, per the
        write policy), its lock and row go back; it gets a fresh handle."""
        kv = r.kv
        if kv.row is None:
            return
        self.truncate(r, min(kv.length, r.seq_len))  # (KV of drafts past where it stopped)
        self._cache_progress(r)
        if self.tiers is not None and r.namespace == 0:
            self._write_through(kv.last_node)
        self.cache.unlock(kv.last_node)
        self.rows.free(kv.row)
        r.kv = KVHandle()

    def truncate(self, r: Request, length: int) -> None:
        """Give back ``r``'s private KV past ``length`` tokens (a verify step's rejected
        drafts, or drafts accepted past where the request stopped)."""
        kv = r.kv
        if length >= kv.length:
            return
        assert length >= kv.cached_len, "only private KV is truncated"
        slots = kv.slots
        self.allocator.free(slots[length : kv.length])
        kv.slots = slots[:length]
        kv.length = length

    def keep_path(self, r: Request, start: int, nodes: list[int]) -> None:
        """A verified token tree's accepted ``nodes`` (its node indices; node i's KV at
        position ``start + i``) move to the positions from ``start`` on, in order, the other
        nodes' after them (for ``truncate``); the table row is rewritten before its next step."""
        kv = r.kv
        n = kv.length - start
        if nodes == list(range(len(nodes))):
            return  # already in place
        slots = kv.slots
        tail = slots[start:]
        kept = set(nodes)
        rest = [i for i in range(n) if i not in kept]
        kv.slots = torch.cat((slots[:start], tail[nodes + rest]))
        kv.table_writes.append((start, kv.slots[start : start + len(nodes)]))

    def rollback(self, step: ScheduledStep) -> None:
        """A launched step failed: forget the KV it would have computed.

        Prefill chunks went into the radix cache when the step was built: each such request
        moves its lock back to where its valid KV ends, and the tree drops the nodes past
        it that nobody else holds (their slots go back to the free list); a decode step's
        slot goes back at once."""
        uncached = []
        for r, n in zip(step.reqs, step.batch.extend_lens, strict=True):
            kv = r.kv
            kv.length -= n
            kv.cached_len = min(kv.cached_len, kv.length)
            if n == 1:
                slots = kv.slots
                self.allocator.free(slots[kv.length :])
                kv.slots = slots[: kv.length]
            elif kv.last_node is not None:
                if self.cache.enabled:  # (disabled, the unlock below drops the path itself)
                    uncached.append((r, kv.last_node))
                g = r.group
                if g is not None and g.prompt_node is kv.last_node:  # set by this step: not valid
                    self.cache.unlock(g.prompt_node)
                    g.prompt_node = None
                    g.leader_gone = True  # the followers compute the prompt themselves
                match = self.cache.match_prefix(r.seq[: kv.length], r.namespace)
                self.cache.lock(match.node)
                self._unlock_last(kv)
                kv.slots, kv.last_node = match.slots, match.node
                kv.table_writes = [(0, match.slots)]  # the table row is rewritten on resume
        for r, invalid in uncached:
            self.cache.drop_unlocked_path(invalid, stop=r.kv.last_node)

    # ------------------------------------------------------------------ KV written from outside

    def reserve(self, n: int) -> tuple[int, torch.Tensor] | None:
        """Hold ``n`` free slots (evicting if needed) for KV another instance writes: (key,
        slots), or None if there is no room."""
        if not self.make_room(n):
            return None
        key = next(self._reservations)
        self.reserved[key] = self.allocator.alloc(n)
        return key, self.reserved[key]

    def received(self, key: int, tokens: list[int]) -> None:
        """The KV of ``tokens`` is in reservation ``key``'s slots: into the radix cache (a
        prefix cached meanwhile keeps the tree's slots; ours of it go back)."""
        slots = self.reserved.pop(key)
        existing = self.cache.insert(tokens, slots)
        self.allocator.free(slots[:existing])

    def unreserve(self, key: int) -> None:
        """Reservation ``key`` is given up (nothing may write its slots any more)."""
        self.allocator.free(self.reserved.pop(key))

    # ------------------------------------------------------------------ lower tiers

    def _load_from_tiers(self, seq: list[int], match, planned: int, limit: int):
        """Extend a locked pool ``match`` of ``seq`` with pages loaded from the lower tiers
        (up to ``limit`` tokens; into fresh slots, inserted into the tree, locked instead of
        ``match``)."""
        hit = match.slots.numel()
        first, plan = self.tiers.plan_load(seq, hit, limit)
        if not plan:
            return match
        p = self.tiers.page_tokens
        skip = hit - first * p
        want = len(plan) * p - skip
        if not self.make_room(planned + want):
            fit = self.allocator.available - planned
            plan = plan[: max(0, (fit + skip) // p)]
            want = len(plan) * p - skip
            if want <= 0:
                return match
        slots = self.allocator.alloc(want)
        assert slots is not None, "scheduler: room was made for the tier load"
        n, event = self.tiers.load(plan, slots, skip)
        if n < want:
            self.allocator.free(slots[n:])
        if n <= 0:
            return match
        if event is not None:
            self._load_events.append(event)
        key = seq[: hit + n]
        existing = self.cache.insert(key, torch.cat((match.slots, slots[:n])), 0)
        if existing > hit:  # cannot happen while match.node is locked; stay correct anyway
            self.allocator.free(slots[: existing - hit])
        loaded = self.cache.match_prefix(key, 0)
        self.cache.lock(loaded.node)
        self.cache.unlock(match.node)
        node = loaded.node
        came = []  # the nodes whose pages came from the tiers
        while node is not match.node and not node.is_root:
            came.append(node)
            node = node.parent
        self.cache.mark_backed(came)
        self.stats.tier_loaded_tokens += n
        return loaded

    def _write_through(self, node) -> None:
        """A request left with ``node`` the end of its KV: store per the write policy."""
        policy = self.tiers.write_policy
        if policy == "write_through":
            self._store_path(node)
        elif policy == "write_through_hits":
            while not node.is_root and node.hits < self.tiers.write_hits:
                node = node.parent
            if not node.is_root:
                self._store_path(node)

    def _store_path(self, node) -> None:
        """Store the pages of the path to ``node`` from its first node not yet backed. Every
        node in the tree that no running request still computes has its KV (the callers:
        release and eviction of unlocked leaves)."""
        path = self.cache.path(node)
        i = start = 0
        while i < len(path) and path[i].backed:
            start += len(path[i].key)
            i += 1
        if i == len(path):
            return
        tokens = [t for n in path for t in n.key]
        slots = torch.cat([n.value for n in path])
        self.tiers.store(tokens, slots, start, len(tokens))
        self.cache.mark_backed(path[i:])

    # ------------------------------------------------------------------ accounting

    def accounting(self, running: list[Request]) -> dict[str, int]:
        """free + evictable + locked + private + reserved == total, recounted from the parts
        (and the same of the window region, ``window_*``, with sliding windows)."""
        a = {
            "total": self.allocator.total,
            "free": self.allocator.available,
            "evictable": self.cache.evictable_size,
            "locked": self.cache.protected_size,
            "private": sum(r.kv.private_len for r in running),
            "reserved": sum(s.numel() for s in self.reserved.values()),
        }
        if self.window is not None:
            a |= self.window.window_accounting(self._private(running))
        return a

    @staticmethod
    def _private(running: list[Request]) -> list[torch.Tensor]:
        return [r.kv.slots[r.kv.cached_len : r.kv.length] for r in running]

    def check_accounting(self, running: list[Request]) -> None:
        a = self.accounting(running)
        if self.window is not None:
            self.window.check_window(self._private(running))
        if a["free"] + a["evictable"] + a["locked"] + a["private"] + a["reserved"] != a["total"]:
            raise AssertionError(f"KV accounting broken: {a}")
        self.cache.check()
        every = torch.cat(
            [self.allocator.free_slots(), self.cache.all_slots()]
            + [r.kv.slots[r.kv.cached_len : r.kv.length] for r in running]
            + list(self.reserved.values())
        )
        if every.numel() != a["total"] or torch.unique(every).numel() != a["total"]:
            raise AssertionError("KV slots are lost or owned twice")
