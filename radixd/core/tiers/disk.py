"""The disk tier (L3): one file per page in a directory, kept across restarts.

``DIR/ab/abcdef....kv`` holds an ``encode_page`` blob (checksum, key, model identity). Files
are written to a temporary name and renamed, so a crash never leaves half a page under a
real name. At start the directory is scanned into an LRU index (oldest modification first)
and trimmed to ``max_bytes``. Every failure (unreadable or corrupt file, another model's
page, a failed or short write, a full disk, a vanished directory) is a miss: logged, counted,
never raised.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from pathlib import Path
from typing import Any

from radixd.core.config import tier_options
from radixd.core.errors import ConfigError
from radixd.core.tiers.base import (
    CacheTier,
    Page,
    PageCorrupt,
    TierContext,
    decode_page,
    encode_page,
)

log = logging.getLogger("radixd.tiers.disk")

SUFFIX = ".kv"


class DiskTier(CacheTier):
    name = "disk"

    def __init__(self, options: dict[str, Any], ctx: TierContext):
        super().__init__(options, ctx)
        opts = tier_options(self.name, options)
        path, self.max_bytes = opts.path, opts.max_bytes
        self.dir = Path(path).expanduser()
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError("cache.disk.path", path, f"a directory radixd can create and write ({exc.strerror})") from exc
        self.stats.capacity_bytes = self.max_bytes
        self._index: OrderedDict[bytes, int] = OrderedDict()  # key -> file size, LRU first
        self._scan()

    def _file(self, key: bytes) -> Path:
        h = key.hex()
        return self.dir / h[:2] / (h + SUFFIX)

    def _scan(self) -> None:
        found = []
        for f in self.dir.glob("*/*" + SUFFIX):
            try:
                st = f.stat()
                found.append((st.st_mtime_ns, bytes.fromhex(f.name.removesuffix(SUFFIX)), st.st_size))
            except (OSError, ValueError):
                continue
        for _, key, size in sorted(found):
            self._index[key] = size
            self.stats.used_bytes += size
        with self._lock:
            self._trim(0)
        log.info("disk tier %s: %d pages, %d bytes", self.dir, len(self._index), self.stats.used_bytes)

    def _trim(self, incoming: int) -> None:
        """Drop least recently used files until ``incoming`` more bytes fit (lock held)."""
        while self._index and self.stats.used_bytes + incoming > self.max_bytes:
            key, size = self._index.popitem(last=False)
            self.stats.used_bytes -= size
            self.stats.evictions += 1
            self._unlink(self._file(key))

    @staticmethod
    def _unlink(path: Path) -> None:
        try:
            path.unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("disk tier: cannot remove %s: %s", path, exc)

    def store(self, key: bytes, page: Page) -> bool:
        blob = encode_page(key, self.ctx.identity, page)
        n = len(blob)
        if n > self.max_bytes:
            with self._lock:
                self.stats.errors += 1
            log.warning("disk tier: a page of %d bytes exceeds cache.disk.max_bytes=%d; not stored", n, self.max_bytes)
            return False
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
                return True
            self._trim(n)
        path = self._file(key)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            path.parent.mkdir(exist_ok=True)
            self._write(tmp, blob)
            os.replace(tmp, path)
        except OSError as exc:
            self._unlink(tmp)
            with self._lock:
                self.stats.errors += 1
            log.warning("disk tier: writing a page to %s failed (%s); not stored", self.dir, exc)
            return False
        with self._lock:
            self._index[key] = n
            self.stats.used_bytes += n
            self.stats.stores += 1
            self.stats.bytes_stored += n
        return True

    @staticmethod
    def _write(path: Path, blob: bytes) -> None:
        with open(path, "wb") as fh:
            written = fh.write(blob)
        if written != len(blob):
            raise OSError(f"short write ({written} of {len(blob)} bytes)")

    def contains(self, key: bytes) -> bool:
        return key in self._index

    def load(self, key: bytes) -> Page | None:
        path = self._file(key)
        try:
            blob = path.read_bytes()
            page = decode_page(blob, key, self.ctx)
        except FileNotFoundError:
            self._forget(key)
            with self._lock:
                self.stats.misses += 1
            return None
        except OSError as exc:
            with self._lock:
                self.stats.errors += 1
            log.warning("disk tier: reading %s failed (%s); recomputing", path, exc)
            return None
        except PageCorrupt as exc:
            with self._lock:
                self.stats.corrupt += 1
            log.warning("disk tier: page %s rejected (%s); removed, recomputing", path.name, exc)
            self._forget(key)
            self._unlink(path)
            return None
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
        return page

    def _forget(self, key: bytes) -> None:
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self.stats.used_bytes -= size

    def evict(self, key: bytes) -> None:
        self._forget(key)
        self._unlink(self._file(key))
