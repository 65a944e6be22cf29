"""radixd-redis: a ``redis`` KV cache tier (the ``radixd_cache_tiers`` hook).

Pages are Redis strings under ``key_prefix + hex(content key)`` holding radixd's page
encoding (checksum, key, model identity). Any failure of the server is a miss: logged,
counted, and the server is left alone for ``retry_s`` before it is tried again.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import redis

from radixd.core.errors import ConfigError
from radixd.core.tiers import CacheTier, Page, PageCorrupt, TierContext, decode_page, encode_page
from radixd.core.tiers.base import check_options
from radixd.plugins import hookimpl

__version__ = "0.1.0"

log = logging.getLogger("radixd.tiers.redis")

OPTIONS = {"url": str, "key_prefix": str, "ttl_s": int, "timeout_s": float, "retry_s": float}


class RedisTier(CacheTier):
    name = "redis"

    def __init__(self, options: dict[str, Any], ctx: TierContext):
        super().__init__(options, ctx)
        check_options("redis", options, OPTIONS)
        self.url = options.get("url", "redis://127.0.0.1:6379/0")
        self.prefix = options.get("key_prefix", "radixd:kv:")
        self.ttl_s = options.get("ttl_s", 0)
        self.timeout_s = float(options.get("timeout_s", 0.5))
        self.retry_s = float(options.get("retry_s", 5.0))
        for key, value, low in (("ttl_s", self.ttl_s, 0), ("timeout_s", self.timeout_s, 0.001), ("retry_s", self.retry_s, 0)):
            if value < low:
                raise ConfigError(f"cache.redis.{key}", value, f"a number >= {low}")
        try:
            self.client = redis.Redis.from_url(self.url, socket_timeout=self.timeout_s,
                                               socket_connect_timeout=self.timeout_s)
        except ValueError as exc:
            raise ConfigError("cache.redis.url", self.url, f"a redis:// URL ({exc})") from exc
        self._down_until = 0.0
        self._state = threading.Lock()
        self._sizes: dict[bytes, int] = {}  # pages this process stored (for used_bytes)

    def _name(self, key: bytes) -> str:
        return self.prefix + key.hex()

    def _up(self) -> bool:
        return time.monotonic() >= self._down_until

    def _failed(self, what: str, exc: Exception) -> None:
        with self._state:
            self.stats.errors += 1
            first = self._up()
            self._down_until = time.monotonic() + self.retry_s
        if first:
            log.warning("redis tier %s: %s failed (%s); misses for %.1f s", self.url, what, exc, self.retry_s)

    def store(self, key: bytes, page: Page) -> bool:
        if not self._up():
            return False
        blob = encode_page(key, self.ctx.identity, page)
        try:
            self.client.set(self._name(key), blob, ex=self.ttl_s or None)
        except redis.RedisError as exc:
            self._failed("store", exc)
            return False
        with self._state:
            self.stats.stores += 1
            self.stats.bytes_stored += len(blob)
            if key not in self._sizes:
                self._sizes[key] = len(blob)
                self.stats.used_bytes += len(blob)
        return True

    def contains(self, key: bytes) -> bool:
        if not self._up():
            return False
        try:
            return bool(self.client.exists(self._name(key)))
        except redis.RedisError as exc:
            self._failed("lookup", exc)
            return False

    def load(self, key: bytes) -> Page | None:
        if not self._up():
            return None
        try:
            blob = self.client.get(self._name(key))
        except redis.RedisError as exc:
            self._failed("load", exc)
            return None
        if blob is None:
            with self._state:
                self.stats.misses += 1
            return None
        try:
            return decode_page(blob, key, self.ctx)
        except PageCorrupt as exc:
            with self._state:
                self.stats.corrupt += 1
            log.warning("redis tier: page %s rejected (%s); deleted, recomputing", self._name(key), exc)
            self.evict(key)
            return None

    def evict(self, key: bytes) -> None:
        with self._state:
            size = self._sizes.pop(key, None)
            if size is not None:
                self.stats.used_bytes -= size
        if not self._up():
            return
        try:
            self.client.delete(self._name(key))
        except redis.RedisError as exc:
            self._failed("delete", exc)

    def close(self) -> None:
        try:
            self.client.close()
        except redis.RedisError:
            pass


@hookimpl
def radixd_cache_tiers():
    return {"redis": RedisTier}
