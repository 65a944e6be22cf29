"""The host-memory tier (L2): pages kept as tensors in RAM, page-locked when the pool is on
CUDA (so loads back are asynchronous copies), least recently used dropped past its limit."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

from radixd.core.errors import ConfigError
from radixd.core.tiers.base import CacheTier, Page, TierContext, check_options

DEFAULT_MAX_BYTES = 4 << 30


class HostTier(CacheTier):
    name = "host"
    fast = True

    def __init__(self, options: dict[str, Any], ctx: TierContext):
        super().__init__(options, ctx)
        check_options(self.name, options, {"max_bytes": int})
        self.max_bytes = options.get("max_bytes", DEFAULT_MAX_BYTES)
        if self.max_bytes < ctx.page_bytes:
            raise ConfigError("cache.host.max_bytes", self.max_bytes,
                              f"an integer >= one page ({ctx.page_bytes} bytes for this model and page size)")
        self.pin = ctx.device.type == "cuda"  # page-locked: loads back are asynchronous copies
        self.stats.capacity_bytes = self.max_bytes
        self._pages: OrderedDict[bytes, Page] = OrderedDict()

    def store(self, key: bytes, page: Page) -> bool:
        n = page.nbytes
        if n > self.max_bytes:
            return False
        if self.pin and not page.data.is_pinned():
            pinned = torch.empty(page.data.shape, dtype=page.data.dtype, pin_memory=True)
            pinned.copy_(page.host())
            page = Page(pinned)
        with self._lock:
            old = self._pages.pop(key, None)
            if old is not None:
                self.stats.used_bytes -= old.nbytes
            while self._pages and self.stats.used_bytes + n > self.max_bytes:
                _, dropped = self._pages.popitem(last=False)
                self.stats.used_bytes -= dropped.nbytes
                self.stats.evictions += 1
            self._pages[key] = page
            self.stats.used_bytes += n
            self.stats.stores += 1
            self.stats.bytes_stored += n
        return True

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

    def close(self) -> None:
        with self._lock:
            self._pages.clear()
            self.stats.used_bytes = 0
