"""Cascade decoding's plan: which requests of a decode batch read the same prefix of KV.

Requests that share a cached prefix (a system prompt, few-shot examples) hold the very same
pool slots for it: the radix tree gives every matching request the slots it holds. Decode
attention can then read that KV once for all of them (``cascade_decode_attention``) instead
of once per request; on a long shared prefix that is most of a decode step's memory traffic.

A slot belongs to one position of one path of the tree, so two requests whose slot at
position ``p`` is the same share every slot before it too. Each request is summarised by its
*chain*: its slots at positions ``CHUNK - 1, 2 * CHUNK - 1, ...`` of its cached prefix. Sorted
chains put requests with long common prefixes next to each other, and the common length of
two chains is found by binary search (equal at ``k`` means equal before ``k``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

CHUNK = 64         # shared lengths are multiples of this many tokens
MIN_CHUNKS = 4     # a shared prefix shorter than this many chunks is not worth a second level


@dataclass
class SharedPrefixes:
    """A decode batch's shared-prefix items (``ForwardBatch.shared``)."""

    shares: list[int]          # [B] each request's shared length (0: in no item)
    item_rows: list[int]       # [N] a member's table row (the prefix's slots are read from it)
    item_lens: list[int]       # [N] the shared length
    members: list[list[int]]   # [N] the members' batch indices (at most ``per_item`` each)

    def parts(self, splits: int) -> list[int]:
        """[B] the kernel's prefix split count of each request: ``splits`` in an item, 0 not."""
        return [splits if n else 0 for n in self.shares]

    def fill_members(self, out: torch.Tensor) -> torch.Tensor:
        """The kernel's ``members`` matrix into ``out`` [M, >= N] (int64, M member slots per
        item): item i's members down column i, -1 in every other place."""
        out.fill_(-1)
        slots = [j for mem in self.members for j in range(len(mem))]
        cols = [i for i, mem in enumerate(self.members) for _ in mem]
        out[torch.tensor(slots, dtype=torch.int64), torch.tensor(cols, dtype=torch.int64)] = torch.tensor(
            [x for mem in self.members for x in mem], dtype=torch.int64)
        return out


def chain(slots, cached_len: int) -> list[int]:
    """The chain of a request whose first ``cached_len`` slots (``slots``, a 1-D int64
    tensor) belong to the radix tree."""
    return slots[CHUNK - 1 : cached_len : CHUNK].tolist()


def _common(a: list[int], b: list[int]) -> int:
    """Chunks shared by two chains: the largest k with a[k-1] == b[k-1]."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[mid - 1] == b[mid - 1]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def plan(chains: list[list[int]], rows: list[int], per_item: int,
         min_chunks: int = MIN_CHUNKS) -> SharedPrefixes | None:
    """Group the batch's requests (``chains[b]``, table row ``rows[b]``) into items of 2 to
    ``per_item`` requests sharing at least ``min_chunks`` chunks; None if no item forms.

    Greedy over the sorted chains: a run's shared length is set by its first two requests;
    the next one joins while it shares at least that much (a shorter match starts a new run,
    so a member never shortens its item's prefix)."""
    if len(chains) < 2 or per_item < 2:
        return None
    order = sorted((b for b in range(len(chains)) if len(chains[b]) >= min_chunks), key=chains.__getitem__)
    shares = [0] * len(chains)
    items: list[tuple[int, list[int]]] = []  # (chunks, members)
    run: list[int] = []
    run_len = 0

    def close() -> None:
        if len(run) >= 2:
            items.append((run_len, list(run)))

    for b in order:
        if run:
            common = _common(chains[run[-1]], chains[b])
            joins = common >= min_chunks and len(run) < per_item and (len(run) == 1 or common >= run_len)
            if joins:
                run_len = common if len(run) == 1 else run_len
                run.append(b)
                continue
            close()
        run, run_len = [b], 0
    close()
    if not items:
        return None
    item_rows, item_lens, members = [], [], []
    for chunks, mem in items:
        n = chunks * CHUNK
        for b in mem:
            shares[b] = n
        item_rows.append(rows[mem[0]])
        item_lens.append(n)
        members.append(mem)
    return SharedPrefixes(shares, item_rows, item_lens, members)
