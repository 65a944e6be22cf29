"""The cache-tier contract, pages and the page codec.

A *page* is the KV of ``page_tokens`` consecutive tokens for every layer, a tensor
``[2 (K, V), num_layers, page_tokens, num_kv_heads, head_dim]`` in the pool's dtype. Its
*content key* is a hash chained over the token ids of every page up to and including it and
the model identity (``KVHierarchy.page_keys``), so one key names one whole prefix: a tier
needs no tree, and two models never share a key.

Tiers that keep bytes (disk, Redis) store ``encode_page`` blobs: a header naming the key, the
model identity, dtype, shape and a CRC32 of the payload. ``decode_page`` checks all of them;
any mismatch raises ``PageCorrupt``, which the tier turns into a miss (logged and counted).
"""

from __future__ import annotations

import json
import struct
import threading
import time
import zlib
from dataclasses import asdict, dataclass
from typing import Any

import torch

from radixd.core.config import check
from radixd.core.errors import ConfigError

MAGIC = b"RDXKVPG1"
_HEAD = struct.Struct("<8sI")  # magic, header length


class Page:
    """One page of KV. ``data`` is on the host, or (just read out of a CUDA pool) still on
    the device; ``ready``: the CUDA event that ends the copy filling ``data``, if any;
    ``reads``: the CUDA event that ends the last copy reading it (a slot that holds it is
    reused only after). ``host()`` is the data on the host, waited for."""

    __slots__ = ("data", "ready", "reads")

    def __init__(self, data: torch.Tensor, ready: Any = None):
        self.data = data
        self.ready = ready
        self.reads = None

    def host(self) -> torch.Tensor:
        if self.ready is not None:
            self.ready.synchronize()
            self.ready = None
        return self.data.cpu() if self.data.is_cuda else self.data

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


class PageCorrupt(Exception):
    """A stored page failed its checks (checksum, key, model identity, dtype or shape)."""


@dataclass(frozen=True)
class TierContext:
    """What a tier learns about the engine it serves."""

    identity: str                 # model/config identity; pages of another identity are misses
    page_shape: tuple[int, ...]   # [2, layers, page_tokens, kv_heads, head_dim]
    dtype: torch.dtype
    device: torch.device          # the pool's device (pin host memory when it is CUDA)

    @property
    def page_bytes(self) -> int:
        n = 1
        for d in self.page_shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()


@dataclass
class TierStats:
    """Counters of one tier (read by ``Engine.stats()`` and ``/metrics``)."""

    hits: int = 0             # pages loaded back into the pool from this tier
    tokens_loaded: int = 0    # tokens served from it (not recomputed)
    bytes_loaded: int = 0
    load_seconds: float = 0.0  # time spent loading those pages (sum)
    stores: int = 0           # pages written
    bytes_stored: int = 0
    evictions: int = 0        # pages dropped for room
    prefetched: int = 0       # pages read from it ahead of need into the first (memory) tier
    misses: int = 0           # pages looked for and not found
    errors: int = 0           # failed operations (unreachable, write failed, full): misses
    corrupt: int = 0          # pages that failed their checks: misses
    used_bytes: int = 0
    capacity_bytes: int = 0

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


class CacheTier:
    """A store of pages under content keys. The contract:

    * ``store(key, page) -> bool``: keep the page (False if it could not: too big, failed);
      may evict other pages (LRU) to stay within ``capacity_bytes``.
    * ``contains(key) -> bool``: a cheap membership test (may be stale; ``load`` decides).
    * ``load(key) -> Page | None``: the page, or None for a miss. A corrupt page, a page of
      another model, an unreachable or failing store are misses: log, count, never raise.
    * ``evict(key)``: drop one page if present. ``close()``: release resources (idempotent).
    * ``stats``: a ``TierStats``; ``used_bytes``/``capacity_bytes`` kept current.

    Methods may be called from the scheduler's thread and from the hierarchy's background
    threads (write-behind and prefetch): implementations guard their own state.
    Constructed as ``cls(options, ctx)``: ``options`` is the tier's ``[cache.NAME]`` table
    (unknown keys refused with ``ConfigError``), ``ctx`` a ``TierContext``.
    """

    name = "tier"
    #: True for tiers as fast as the pool's host side (the host tier): loads from the others
    #: are worth a background prefetch into the first fast tier.
    fast = False

    def __init__(self, options: dict[str, Any], ctx: TierContext):
        self.ctx = ctx
        self.stats = TierStats()
        self._lock = threading.Lock()

    def store(self, key: bytes, page: Page) -> bool:
        raise NotImplementedError

    def contains(self, key: bytes) -> bool:
        raise NotImplementedError

    def load(self, key: bytes) -> Page | None:
        raise NotImplementedError

    def evict(self, key: bytes) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass

    def count_load(self, page: Page, tokens: int, seconds: float) -> None:
        with self._lock:
            s = self.stats
            s.hits += 1
            s.tokens_loaded += tokens
            s.bytes_loaded += page.nbytes
            s.load_seconds += seconds


def check_options(tier: str, options: dict[str, Any], known: dict[str, type]) -> None:
    """Refuse unknown keys and wrong types in a plugin tier's options, naming ``cache.TIER.KEY``
    (the built-in tiers declare theirs: ``radixd.core.config.tier_options``)."""
    for key, value in options.items():
        want = known.get(key)
        if want is None:
            raise ConfigError(f"cache.{tier}.{key}", value, "keys " + ", ".join(known) if known else "no keys")
        check(f"cache.{tier}.{key}", value, want, {})


def encode_page(key: bytes, identity: str, page: Page) -> bytes:
    data = page.host().contiguous()
    payload = data.view(torch.uint8).numpy().tobytes() if data.numel() else b""
    header = json.dumps({
        "key": key.hex(), "identity": identity, "dtype": str(data.dtype).removeprefix("torch."),
        "shape": list(data.shape), "crc32": zlib.crc32(payload), "created": time.time(),
    }).encode()
    return _HEAD.pack(MAGIC, len(header)) + header + payload


def decode_page(blob: bytes, key: bytes, ctx: TierContext) -> Page:
    """The page in ``blob``; ``PageCorrupt`` unless every check passes."""
    if len(blob) < _HEAD.size:
        raise PageCorrupt("truncated header")
    magic, hlen = _HEAD.unpack_from(blob)
    if magic != MAGIC or _HEAD.size + hlen > len(blob):
        raise PageCorrupt("not a radixd KV page")
    try:
        header = json.loads(blob[_HEAD.size:_HEAD.size + hlen])
    except ValueError as exc:
        raise PageCorrupt(f"unreadable header ({exc})") from None
    payload = memoryview(blob)[_HEAD.size + hlen:]
    if header.get("key") != key.hex():
        raise PageCorrupt("stored under another key")
    if header.get("identity") != ctx.identity:
        raise PageCorrupt("written for another model or configuration")
    if header.get("dtype") != str(ctx.dtype).removeprefix("torch.") or tuple(header.get("shape", ())) != ctx.page_shape:
        raise PageCorrupt(f"dtype/shape {header.get('dtype')}/{header.get('shape')} do not match the pool")
    if len(payload) != ctx.page_bytes or zlib.crc32(payload) != header.get("crc32"):
        raise PageCorrupt("checksum mismatch")
    data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(ctx.dtype).view(ctx.page_shape)
    return Page(data)
