"""A request's KV: its table row, its slots, how far they are computed and cached.

Contract
--------
* One ``KVHandle`` per request (``Request.kv``). Only the KV manager
  (``radixd.core.kv_manager``) changes it, except that the batch builder appends the slots of
  the step it builds (``append_slot`` / ``slots``) and takes the ``table_writes`` it puts in
  the batch; everything else only reads it.
* Ownership of a running request's ``length`` tokens with KV in the pool::

      slots[0:cached_len]        owned by the radix tree, pinned by the lock on last_node
      slots[cached_len:length]   private to this request (freed or inserted on release)

  A waiting request has no row, no slots and no lock (a fresh handle).
* Decode steps append one slot each: ``append_slot`` keeps those as Python ints and ``slots``
  folds them into the tensor only when read (release, cache insertion, accounting checks), so
  a decode step costs no tensor operation per request.
* ``share_chain`` (``cascade.chain`` of ``slots[:cached_len]``) is the batch builder's cache;
  it is dropped whenever ``slots`` is replaced (appended decode slots lie past ``cached_len``
  and leave it valid).
"""

from __future__ import annotations

import torch

from radixd.core.radix_cache import TreeNode


class KVHandle:
    __slots__ = ("row", "_slots", "_slot_tail", "length", "cached_len", "last_node", "share_chain",
                 "table_writes", "window_freed", "window_unpinned")

    def __init__(self) -> None:
        self.row: int | None = None           # the request-to-token table row
        self._slots = torch.empty(0, dtype=torch.int64)
        self._slot_tail: list[int] = []       # appended, not yet in _slots
        self.length = 0                       # tokens whose KV is computed (or being computed)
        self.cached_len = 0                   # of those, owned by the radix tree
        self.last_node: TreeNode | None = None  # the locked node where the cached part ends
        self.share_chain: list[int] | None = None
        # (start position, slots) to write into the table row before the next step runs
        self.table_writes: list[tuple[int, torch.Tensor]] = []
        # sliding windows: positions below this have had their private window KV freed
        self.window_freed = 0
        self.window_unpinned = False  # its lock's window pin was dropped (its window is past it)

    @property
    def slots(self) -> torch.Tensor:
        """int64 KV slots of the request's tokens, in order."""
        if self._slot_tail:
            self._slots = torch.cat((self._slots, torch.tensor(self._slot_tail, dtype=torch.int64)))
            self._slot_tail = []
        return self._slots

    @slots.setter
    def slots(self, value: torch.Tensor) -> None:
        self._slots = value
        self._slot_tail = []
        self.share_chain = None

    def append_slot(self, slot: int) -> None:
        """One more slot at the end of ``slots`` (a decode step's)."""
        self._slot_tail.append(slot)

    @property
    def private_len(self) -> int:
        return self.length - self.cached_len

    def __repr__(self) -> str:
        return f"KVHandle(row={self.row}, length={self.length}, cached_len={self.cached_len})"
