"""radixd-mooncake: a ``mooncake`` KV cache tier (the ``radixd_cache_tiers`` hook) on Mooncake
Store, the distributed KV store of kvcache-ai/Mooncake.

Pages are Mooncake objects under ``key_prefix + hex(content key)`` holding radixd's page
encoding (checksum, key, model identity), put and got through one
``mooncake.store.MooncakeDistributedStore`` client. The memory holding them is the store's
(segments mounted by ``mooncake_client`` store services, or by this client when
``global_segment_size`` > 0), so with the default of 0 pages outlive the daemon.

Failures are misses, never request errors. A store that is full refuses puts (counted,
logged, loads go on). A master or store service that fails makes the tier skip the store
for ``retry_s``; the master's port is probed (``timeout_s``) before it is used again, because
the client's own calls to a dead master each block for seconds. Connecting (``setup``) happens
when the tier is made if the master answers, else on a background thread after ``retry_s``.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Any

from radixd.core.config import check
from radixd.core.errors import ConfigError
from radixd.core.tiers import CacheTier, Page, PageCorrupt, TierContext, decode_page, encode_page
from radixd.core.tiers.base import check_options
from radixd.plugins import hookimpl

__version__ = "0.1.0"

log = logging.getLogger("radixd.tiers.mooncake")

MIN_SEGMENT = 16 << 20  # Mooncake refuses smaller segments and buffers ("at least 16777216")
PROTOCOLS = ("tcp", "rdma")

# option: (type, check metadata, default)
OPTIONS: dict[str, tuple[type, dict, Any]] = {
    "master_server_address": (str, {"allowed": "HOST:PORT of mooncake_master's RPC service"}, "127.0.0.1:50051"),
    "metadata_server": (str, {"nonempty": True, "allowed": '"P2PHANDSHAKE", an http://.../metadata URL or etcd endpoints'},
                        "P2PHANDSHAKE"),
    "local_hostname": (str, {"nonempty": True}, "127.0.0.1"),
    "global_segment_size": (int, {"allowed": f"0 (store in the store services' memory) or an integer >= {MIN_SEGMENT}"}, 0),
    "local_buffer_size": (int, {"min": MIN_SEGMENT}, 64 << 20),
    "protocol": (str, {"choices": PROTOCOLS}, "tcp"),
    "device_name": (str, {}, ""),
    "key_prefix": (str, {}, "radixd:kv:"),
    "timeout_s": (float, {"min": 0.001}, 0.5),
    "retry_s": (float, {"min": 0}, 5.0),
}

OBJECT_ALREADY_EXISTS = -705  # Mooncake's ErrorCode values (mooncake-store/include/types.h)
OBJECT_NOT_FOUND = -704
NO_AVAILABLE_HANDLE = -200    # no room left in any segment


def _options(options: dict[str, Any]) -> dict[str, Any]:
    """The tier's options with defaults, each checked (``cache.mooncake.KEY`` in errors)."""
    check_options("mooncake", options, {k: hint for k, (hint, _, _) in OPTIONS.items()})
    out = {}
    for key, (hint, meta, default) in OPTIONS.items():
        value = options.get(key, default)
        check(f"cache.mooncake.{key}", value, hint, meta)
        out[key] = value
    seg = out["global_segment_size"]
    if seg != 0 and seg < MIN_SEGMENT:
        raise ConfigError("cache.mooncake.global_segment_size", seg, OPTIONS["global_segment_size"][1]["allowed"])
    host, _, port = out["master_server_address"].rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError("cache.mooncake.master_server_address", out["master_server_address"],
                          OPTIONS["master_server_address"][1]["allowed"])
    out["master"] = (host.strip("[]"), int(port))
    return out


class MooncakeTier(CacheTier):
    name = "mooncake"

    def __init__(self, options: dict[str, Any], ctx: TierContext):
        super().__init__(options, ctx)
        self.opts = _options(options)
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as exc:
            raise ConfigError("cache.tiers", "mooncake", "an importable Mooncake store client (pip install "
                              "mooncake-transfer-engine, or mooncake-transfer-engine-non-cuda without CUDA): "
                              f"{exc}") from exc
        self._client_cls = MooncakeDistributedStore
        self.master = self.opts["master_server_address"]
        self.prefix = self.opts["key_prefix"]
        self.retry_s = float(self.opts["retry_s"])
        self.client = None
        self._state = threading.Lock()
        self._down_until = 0.0
        self._full_logged_until = 0.0
        self._connector: threading.Thread | None = None
        self._closed = False
        self._sizes: dict[bytes, int] = {}  # pages this process stored (for used_bytes)
        self.stats.capacity_bytes = self.opts["global_segment_size"]
        self._connect()

    # ------------------------------------------------------------------ connection

    def _master_answers(self) -> bool:
        try:
            with socket.create_connection(self.opts["master"], timeout=self.opts["timeout_s"]):
                return True
        except OSError:
            return False

    def _connect(self) -> None:
        """Set up a client if the master answers; else (or if setup fails) stay down."""
        if not self._master_answers():
            self._failed("connect", f"{self.master} does not answer")
            return
        o = self.opts
        client = self._client_cls()
        rc = client.setup(o["local_hostname"], o["metadata_server"], o["global_segment_size"], o["local_buffer_size"],
                          o["protocol"], o["device_name"], self.master)
        if rc != 0:
            self._failed("connect", f"setup returned {rc}")
            return
        with self._state:
            if self._closed:
                client.close()
                return
            self.client = client
            self._down_until = 0.0
        log.info("mooncake tier: connected to master %s", self.master)

    def _up(self):
        """The client when the store may be used now, else None (a miss). After a failure
        the store is left alone for ``retry_s``, then probed before it is used."""
        with self._state:
            if self._closed or time.monotonic() < self._down_until:
                return None
            client = self.client
            if client is None:
                if self._connector is None or not self._connector.is_alive():
                    self._down_until = time.monotonic() + self.retry_s  # one attempt per window
                    self._connector = threading.Thread(target=self._connect, name="radixd-mooncake-connect",
                                                       daemon=True)
                    self._connector.start()
                return None
            if self._down_until:  # the first use since a failure: only if the master answers
                self._down_until = time.monotonic() + self.retry_s
                probe = True
            else:
                probe = False
        if probe:
            if not self._master_answers():
                return None
            with self._state:
                self._down_until = 0.0
        return client

    def _failed(self, what: str, why: object) -> None:
        with self._state:
            self.stats.errors += 1
            first = time.monotonic() >= self._down_until
            self._down_until = time.monotonic() + self.retry_s
        if first:
            log.warning("mooncake tier %s: %s failed (%s); misses for %.1f s", self.master, what, why, self.retry_s)

    def _name(self, key: bytes) -> str:
        return self.prefix + key.hex()

    # ------------------------------------------------------------------ the tier contract

    def store(self, key: bytes, page: Page) -> bool:
        client = self._up()
        if client is None:
            return False
        blob = encode_page(key, self.ctx.identity, page)
        rc = client.put(self._name(key), blob)
        if rc == NO_AVAILABLE_HANDLE:
            with self._state:
                self.stats.errors += 1
                first = time.monotonic() >= self._full_logged_until
                if first:
                    self._full_logged_until = time.monotonic() + self.retry_s
            if first:
                log.warning("mooncake tier %s: store failed (the store is full, code %d); pages not stored",
                            self.master, rc)
            return False
        if rc not in (0, OBJECT_ALREADY_EXISTS):
            self._failed("store", f"code {rc}")
            return False
        with self._state:
            self.stats.stores += 1
            self.stats.bytes_stored += len(blob)
            if key not in self._sizes:
                self._sizes[key] = len(blob)
                self.stats.used_bytes += len(blob)
        return True

    def contains(self, key: bytes) -> bool:
        client = self._up()
        if client is None:
            return False
        rc = client.is_exist(self._name(key))
        if rc < 0:
            self._failed("lookup", f"code {rc}")
            return False
        return rc == 1

    def load(self, key: bytes) -> Page | None:
        client = self._up()
        if client is None:
            return None
        name = self._name(key)
        blob = client.get(name)
        if not blob:  # gone (evicted by the master), or the read failed: ask which
            rc = client.is_exist(name)
            if rc == 0:
                with self._state:
                    self.stats.misses += 1
            else:
                self._failed("load", f"the object is listed but could not be read (code {rc})")
            return None
        try:
            return decode_page(blob, key, self.ctx)
        except PageCorrupt as exc:
            with self._state:
                self.stats.corrupt += 1
            log.warning("mooncake tier: page %s rejected (%s); removed, recomputing", name, exc)
            self.evict(key)
            return None

    def evict(self, key: bytes) -> None:
        with self._state:
            size = self._sizes.pop(key, None)
            if size is not None:
                self.stats.used_bytes -= size
        client = self._up()
        if client is None:
            return
        rc = client.remove(self._name(key), True)  # force: a reader's lease must not keep a bad page
        if rc not in (0, OBJECT_NOT_FOUND):
            self._failed("remove", f"code {rc}")

    def close(self) -> None:
        with self._state:
            self._closed = True
            client, self.client = self.client, None
        if client is not None:
            client.close()


@hookimpl
def radixd_cache_tiers():
    return {"mooncake": MooncakeTier}
