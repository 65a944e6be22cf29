"""The host-memory tier (L2): pages kept in RAM, least recently used dropped past its limit.

On CPU pages are kept as the tensors they come in. With the pool on CUDA the tier is one
page-locked slab of ``max_bytes // page_bytes`` page slots, allocated once (page-locking is
slow, and its allocator rounds sizes up to a power of two): a page from the device is copied
into its slot asynchronously on the compute stream (``Page.ready`` marks the end), and loads
back are asynchronous copies out of it. A slot is reused only after the last load that read
from it (``Page.reads``) has finished.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

from radixd.core.config import tier_options
from radixd.core.errors import ConfigError
from radixd.core.tiers.base import CacheTier, Page, TierContext


class HostTier(CacheTier):
    name = "host"
    fast = True

    def __init__(self, options: dict[str, Any], ctx: TierContext):
        super().__init__(options, ctx)
        self.max_bytes = tier_options(self.name, options).max_bytes
        if self.max_bytes < ctx.page_bytes:
            raise ConfigError("cache.host.max_bytes", self.max_bytes,
                              f"an integer >= one page ({ctx.page_bytes} bytes for this model and page size)")
        self.stats.capacity_bytes = self.max_bytes
        self._pages: OrderedDict[bytes, Page] = OrderedDict()
        self._slab = None
        if ctx.device.type == "cuda":
            n = self.max_bytes // ctx.page_bytes
            self._slab = torch.empty((n, *ctx.page_shape), dtype=ctx.dtype, pin_memory=torch.cuda.is_available())
            self._free = list(range(n - 1, -1, -1))
            self._slot_of: dict[bytes, int] = {}

    def store(self, key: bytes, page: Page) -> bool:
        n = page.nbytes
        if n > self.max_bytes:
            return False
        with self._lock:
            old = self._pages.pop(key, None)
            if old is not None:
                self._pages[key] = old  # already held: only its recency changes
                return True
            if self._slab is not None:
                page = self._into_slab(key, page)
            else:
                while self._pages and self.stats.used_bytes + n > self.max_bytes:
                    self._drop_lru()
            self._pages[key] = page
            self.stats.used_bytes += n
            self.stats.stores += 1
            self.stats.bytes_stored += n
        return True

    def _into_slab(self, key: bytes, page: Page) -> Page:
        """Copy ``page`` into a free slot of the page-locked slab (lock held)."""
        if not self._free:
            reused = self._drop_lru()
            for pending in (reused.reads, reused.ready):  # a load out of the slot, a copy into it
                if pending is None:
                    continue
                if page.data.is_cuda:  # the copy below is queued after it
                    torch.cuda.current_stream(page.data.device).wait_event(pending)
                else:
                    pending.synchronize()
        slot = self._free.pop()
        self._slot_of[key] = slot
        dst = self._slab[slot]
        if page.data.is_cuda:
            if page.ready is not None:
                torch.cuda.current_stream(page.data.device).wait_event(page.ready)
            dst.copy_(page.data, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(page.data.device))
            return Page(dst, ready)
        dst.copy_(page.host())
        return Page(dst)

    def _drop_lru(self) -> Page:
        """Forget the least recently used page (lock held); its slab slot becomes free."""
        key, page = self._pages.popitem(last=False)
        self.stats.used_bytes -= page.nbytes
        self.stats.evictions += 1
        if self._slab is not None:
            self._free.append(self._slot_of.pop(key))
        return page

    def contains(self, key: bytes) -> bool:
        return key in self._pages

    def load(self, key: bytes) -> Page | None:
        with self._lock:
            page = self._pages.get(key)
            if page is None:
                self.stats.misses += 1
                return None
            self._pages.move_to_end(key)
            return page

    def evict(self, key: bytes) -> None:
        with self._lock:
            page = self._pages.pop(key, None)
            if page is not None:
                self.stats.used_bytes -= page.nbytes
                self.stats.evictions += 1
                if self._slab is not None:
                    self._free.append(self._slot_of.pop(key))

    def close(self) -> None:
        with self._lock:
            self._pages.clear()
            self.stats.used_bytes = 0
            self._slab = None
