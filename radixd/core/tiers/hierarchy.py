"""``KVHierarchy``: the pool's lower tiers as the scheduler sees them.

::

    pool (L1, device)  --store (write-through / on eviction)-->  tiers[0] (host, sync)
                                                             `-> tiers[1:] (disk, Redis...: write-behind thread)
    pool <--load (admission: a match continuing past the pool)-- first tier holding each page
    tiers[0] <--prefetch (background, on arrival)-- tiers[1:]

Pages are ``page_tokens`` long and named by content keys chained over the token ids (see
``tiers.base``); only whole pages are stored. Loads go into fresh pool slots the scheduler
allocated; on CUDA they are queued on a side stream (``KVPool.write_pages``) and the step
that first reads them waits for its event, so the copy overlaps the step in flight.

Threads: the scheduler's thread calls everything here; the write-behind and prefetch threads
only call tier methods (tiers guard their own state).
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import logging
import queue
import threading
import time
from array import array
from collections.abc import Sequence

import torch

from radixd.core.tiers.base import CacheTier, Page

log = logging.getLogger("radixd.tiers")

WRITE_POLICIES = ("write_back", "write_through", "write_through_hits")
MAX_PENDING_WRITE_BYTES = 1 << 30   # write-behind backlog beyond which stores are dropped
MAX_PENDING_PREFETCHES = 64


class KVHierarchy:
    def __init__(self, tiers: list[CacheTier], *, pool, page_tokens: int, identity: str,
                 write_policy: str = "write_back", write_hits: int = 2, prefetch: bool = True):
        if not tiers:
            raise ValueError("KVHierarchy needs at least one tier")
        self.tiers = tiers
        self.pool = pool
        self.page_tokens = page_tokens
        self.identity = identity
        self.write_policy = write_policy
        self.write_hits = write_hits
        self.prefetch_enabled = prefetch and len(tiers) > 1 and tiers[0].fast
        self._root_key = hashlib.blake2b(identity.encode(), digest_size=16).digest()
        self._writes: queue.Queue = queue.Queue()
        self._pending_bytes = 0
        self._pending_lock = threading.Lock()
        self._writer = None
        if len(tiers) > 1 or not tiers[0].fast:
            self._writer = threading.Thread(target=self._write_behind, name="radixd-tier-writer", daemon=True)
            self._writer.start()
        self._prefetcher = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="radixd-tier-prefetch") \
            if self.prefetch_enabled else None
        self._prefetches: list[concurrent.futures.Future] = []
        self.dropped_writes = 0
        self.prefetched_pages = 0
        self._closed = False

    # ------------------------------------------------------------------ keys

    def page_keys(self, tokens: Sequence[int], n_pages: int) -> list[bytes]:
        """Content keys of the first ``n_pages`` whole pages of ``tokens``."""
        p = self.page_tokens
        keys, h = [], self._root_key
        for j in range(n_pages):
            h = hashlib.blake2b(h + array("q", tokens[j * p:(j + 1) * p]).tobytes(), digest_size=16).digest()
            keys.append(h)
        return keys

    # ------------------------------------------------------------------ store

    def store(self, tokens: Sequence[int], slots: torch.Tensor, start: int, end: int) -> int:
        """Store the whole pages that end in ``(start, end]`` of a sequence whose first ``end``
        tokens have KV in ``slots`` (all of it computed). Returns pages written to tier 0."""
        p = self.page_tokens
        first, last = start // p, end // p
        if first >= last:
            return 0
        keys = self.page_keys(tokens, last)
        todo = [j for j in range(first, last) if not all(t.contains(keys[j]) for t in self.tiers)]
        if not todo:
            return 0
        pages = self.pool.read_pages(torch.cat([slots[j * p:(j + 1) * p] for j in todo]), p)
        stored = 0
        for j, page in zip(todo, pages, strict=True):
            key = keys[j]
            for i, tier in enumerate(self.tiers):
                if tier.contains(key):
                    continue
                if tier.fast and i == 0:
                    stored += tier.store(key, page)
                else:
                    self._queue_write(tier, key, page)
        return stored

    def _queue_write(self, tier: CacheTier, key: bytes, page: Page) -> None:
        with self._pending_lock:
            if self._pending_bytes + page.nbytes > MAX_PENDING_WRITE_BYTES:
                self.dropped_writes += 1
                return
            self._pending_bytes += page.nbytes
        self._writes.put((tier, key, page))

    def _write_behind(self) -> None:
        while True:
            item = self._writes.get()
            if item is None:
                return
            tier, key, page = item
            try:
                tier.store(key, page)
            except Exception:  # a tier bug must not kill the writer: count and go on
                tier.stats.errors += 1
                log.exception("tier %s: store failed", tier.name)
            finally:
                with self._pending_lock:
                    self._pending_bytes -= page.nbytes
                self._writes.task_done()

    def flush(self) -> None:
        """Wait until queued writes reached their tiers (tests, shutdown)."""
        if self._writer is not None:
            self._writes.join()
        for f in list(self._prefetches):
            f.result()

    # ------------------------------------------------------------------ load

    def plan_load(self, tokens: Sequence[int], hit: int, limit: int) -> tuple[int, list[tuple[bytes, list[CacheTier]]]]:
        """Pages that would extend a pool match of ``hit`` tokens (up to ``limit`` tokens):
        ``(first page index, [(key, tiers that claim it)])``, consecutive from the first."""
        p = self.page_tokens
        first, last = hit // p, limit // p
        if first >= last:
            return first, []
        keys = self.page_keys(tokens, last)
        plan = []
        for j in range(first, last):
            holders = [t for t in self.tiers if t.contains(keys[j])]
            if not holders:
                self.tiers[-1].stats.misses += 1
                break
            plan.append((keys[j], holders))
        return first, plan

    def load(self, plan: list[tuple[bytes, list[CacheTier]]], slots: torch.Tensor, skip: int) -> tuple[int, object]:
        """Load the planned pages into ``slots`` (the page tokens after the first ``skip``).
        Stops at the first page no tier can produce. Returns (tokens loaded, the event the
        next step waits for, None on CPU)."""
        p = self.page_tokens
        pages: list[Page] = []
        for key, holders in plan:
            page = None
            for tier in holders:
                t0 = time.perf_counter()
                page = tier.load(key)
                if page is not None:
                    tier.count_load(page, p - (skip if not pages else 0), time.perf_counter() - t0)
                    if tier is not self.tiers[0] and self.tiers[0].fast:
                        self.tiers[0].store(key, page)  # promote: the next load is from memory
                    break
            if page is None:
                break
            pages.append(page)
        n = len(pages) * p - skip
        if n <= 0:
            return 0, None
        event = self.pool.write_pages(slots[:n], pages, skip)
        return n, event

    # ------------------------------------------------------------------ prefetch

    def prefetch(self, tokens: Sequence[int], hit: int) -> None:
        """Bring pages past a pool match of ``hit`` tokens from slow tiers into the fast one,
        in the background, so that admission finds them in memory."""
        if self._prefetcher is None or self._closed:
            return
        self._prefetches = [f for f in self._prefetches if not f.done()]
        if len(self._prefetches) >= MAX_PENDING_PREFETCHES:
            return
        self._prefetches.append(self._prefetcher.submit(self._prefetch, list(tokens), hit))

    def _prefetch(self, tokens: list[int], hit: int) -> None:
        p = self.page_tokens
        fast, slow = self.tiers[0], self.tiers[1:]
        keys = self.page_keys(tokens, len(tokens) // p)
        for key in keys[hit // p:]:
            if fast.contains(key):
                continue
            page = source = None
            for source in slow:
                if source.contains(key):
                    page = source.load(key)
                    if page is not None:
                        break
            if page is None:
                return
            if fast.store(key, page):
                self.prefetched_pages += 1
                with source._lock:
                    source.stats.prefetched += 1

    # ------------------------------------------------------------------ life cycle

    def close(self, close_tiers: bool = True) -> None:
        """Stop the background threads (queued writes are finished first), then close the
        tiers unless others share them (``close_tiers=False``)."""
        if self._closed:
            return
        self._closed = True
        if self._prefetcher is not None:
            self._prefetcher.shutdown(wait=True)
        if self._writer is not None:
            self._writes.put(None)
            self._writer.join()
        for t in self.tiers if close_tiers else ():
            try:
                t.close()
            except Exception:
                log.exception("tier %s: close failed", t.name)
