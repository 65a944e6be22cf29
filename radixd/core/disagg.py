"""Prefill/decode disaggregation, the engine's side: whose KV slots a transfer reads and writes.

A prefill instance computes a prompt and writes its KV into slots a decode instance reserved
for it; the decode instance then owns that KV as a cached prefix and decodes. This module
holds what both sides need of an engine, whatever carries the bytes:

* ``KVPoll``, the states of one transfer (SGLang's numbering: failed, bootstrapping, waiting
  for input, transferring, success).
* ``KVTransport``, the contract of a transfer engine (Mooncake by default, a plugin's
  otherwise): register local buffers, write local byte ranges into a peer's registered ones.
* ``PoolLayout``, the KV pool as byte ranges (one K and one V buffer per layer, a slot being
  one row of each), and ``transfer_ranges``, a prefix's slots on one side against reserved
  slots on the other as (source, destination, length) ranges, contiguous runs merged.
* ``hold`` / ``let_go`` on the prefill side: a computed prompt's cached slots pinned while
  they are read. ``copy_kv``: the transfer between two engines of one process (replicas on
  one or several GPUs), a direct device-to-device copy, no transfer engine. ``reserve`` / ``received`` / ``unreserve`` on the decode side go through the
  KV manager, whose accounting counts reserved slots until they become a cached prefix.

Contract: the callers run on the engine's event loop (the KV manager's thread), between
steps; the transport's ``write`` may run on another thread, reading slots ``hold`` pinned and
writing slots ``reserve`` took, which no step reads or writes meanwhile. Only one replica
and one shard (``dp_size == tp_size == 1``) and a radix cache: the caller checks.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from radixd.core.radix_cache import TreeNode


class KVPoll(enum.IntEnum):
    """One transfer's state, numbered as SGLang's ``KVPoll``."""

    FAILED = 0
    BOOTSTRAPPING = 1
    WAITING_FOR_INPUT = 2
    TRANSFERRING = 3
    SUCCESS = 4


class KVTransport(Protocol):
    """A transfer engine. ``session_id`` names this end to peers; ``register`` makes local
    memory writable by peers (and readable as a source); ``write`` copies each local range
    ``srcs[i]`` of ``lens[i]`` bytes to ``dsts[i]`` in ``peer``'s registered memory, blocking
    until done, raising ``RuntimeError`` on failure. ``write`` is called off the loop."""

    session_id: str

    def register(self, buffers: list[tuple[int, int]]) -> None: ...

    def write(self, peer: str, srcs: list[int], dsts: list[int], lens: list[int]) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class PoolLayout:
    """A KV pool as byte ranges: ``bases[i]`` the address of buffer i (the K buffers of every
    layer, then the V buffers), ``item_lens[i]`` the bytes of one slot in it."""

    bases: tuple[int, ...]
    item_lens: tuple[int, ...]
    num_slots: int

    @classmethod
    def of(cls, engine) -> PoolLayout:
        pool = engine.worker.pool
        bufs = [*pool.k_buffers, *pool.v_buffers]
        return cls(tuple(b.data_ptr() for b in bufs), tuple(b[0].numel() * b.element_size() for b in bufs),
                   pool.num_slots)

    def buffers(self) -> list[tuple[int, int]]:
        """(address, bytes) of each buffer, for ``KVTransport.register``."""
        return [(base, item * self.num_slots) for base, item in zip(self.bases, self.item_lens, strict=True)]

    def to_json(self) -> dict:
        return {"bases": list(self.bases), "item_lens": list(self.item_lens), "num_slots": self.num_slots}

    @classmethod
    def from_json(cls, d: dict) -> PoolLayout:
        return cls(tuple(int(b) for b in d["bases"]), tuple(int(i) for i in d["item_lens"]), int(d["num_slots"]))


def transfer_ranges(src: PoolLayout, src_slots: torch.Tensor, dst: PoolLayout,
                    dst_slots: torch.Tensor) -> tuple[list[int], list[int], list[int]]:
    """The (source addresses, destination addresses, lengths) that copy the KV of
    ``src_slots`` into ``dst_slots``, one range per buffer per run of slots consecutive on
    both sides. Raises ``ValueError`` when the two layouts cannot exchange KV."""
    if src.item_lens != dst.item_lens:
        raise ValueError(f"the KV layouts differ (bytes per slot per buffer {src.item_lens[:2]}... "
                         f"against {dst.item_lens[:2]}...: another model, dtype or shape)")
    if src_slots.numel() != dst_slots.numel():
        raise ValueError(f"{src_slots.numel()} KV slots to send into {dst_slots.numel()}")
    s = src_slots.cpu().numpy().astype(np.int64)
    d = dst_slots.cpu().numpy().astype(np.int64)
    if s.size and (s.max() >= src.num_slots or d.max() >= dst.num_slots or d.min() < 1):
        raise ValueError("KV slot out of range")
    # a run ends where either side's next slot is not the next one
    breaks = np.flatnonzero((np.diff(s) != 1) | (np.diff(d) != 1)) + 1
    starts = np.concatenate(([0], breaks)) if s.size else np.zeros(0, np.int64)
    ends = np.concatenate((breaks, [s.size])) if s.size else np.zeros(0, np.int64)
    srcs: list[int] = []
    dsts: list[int] = []
    lens: list[int] = []
    for sb, db, item in zip(src.bases, dst.bases, src.item_lens, strict=True):
        for a, b in zip(starts.tolist(), ends.tolist(), strict=True):
            srcs.append(sb + int(s[a]) * item)
            dsts.append(db + int(d[a]) * item)
            lens.append((b - a) * item)
    return srcs, dsts, lens


# ------------------------------------------------------------------ prefill side


def hold(engine, ids: list[int]) -> tuple[TreeNode, torch.Tensor] | None:
    """Pin the cached KV of all of ``ids`` (a prompt just computed): (node to let go of,
    slots), or None when part of it is no longer cached (evicted, or never: no radix cache)."""
    cache = engine.cache
    match = cache.match_prefix(ids)
    if match.slots.numel() < len(ids):
        return None
    cache.lock(match.node)
    return match.node, match.slots


def let_go(engine, node: TreeNode) -> None:
    engine.cache.unlock(node)


def copy_kv(src_engine, src_slots: torch.Tensor, dst_engine, dst_slots: torch.Tensor) -> int:
    """Copy the KV of ``src_slots`` in ``src_engine``'s pool into ``dst_slots`` of
    ``dst_engine``'s (one process; either device); the bytes moved. Queued on the current
    stream of the destination's device (CUDA): synchronize before timing it."""
    src, dst = src_engine.worker.pool, dst_engine.worker.pool
    s = src_slots.to(src.device)
    d = dst_slots.to(dst.device)
    moved = 0
    for sb, db in zip([*src.k_buffers, *src.v_buffers], [*dst.k_buffers, *dst.v_buffers], strict=True):
        rows = sb[s]
        db[d] = rows.to(dst.device, non_blocking=True)
        moved += rows.numel() * rows.element_size()
    return moved


# ------------------------------------------------------------------ decode side


def reserve(engine, n: int) -> tuple[int, torch.Tensor] | None:
    """``n`` slots held for KV to come: (reservation key, slots), or None without room."""
    return engine.scheduler.kv_manager.reserve(n)


def received(engine, key: int, ids: list[int]) -> None:
    """The KV of ``ids`` arrived in reservation ``key``: it becomes a cached prefix."""
    engine.scheduler.kv_manager.received(key, ids)


def unreserve(engine, key: int) -> None:
    engine.scheduler.kv_manager.unreserve(key)
