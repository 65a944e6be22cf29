"""Sliding-window KV slots: the window layers' own region of the pool and each token's slot
in it, allocated and freed beside the token's slot.

Memory layout of a ``KVPool`` with a window region (models with sliding-window layers)::

    k_buffers[global layer]  [num_slots, kv_heads, head_dim]      indexed by slot
    k_buffers[window layer]  [window_slots, kv_heads, head_dim]   indexed by to_window[slot]
    to_window                [num_slots] int64                     slot -> window slot (0: none)
    req_to_token             [rows, context] int64                 (row, position) -> slot

A token has one slot, what the table, the radix tree and the requests hold and the
``SlotAllocator`` counts as before (with no global layer, as for Mistral-style models, a slot
is only a name and costs no KV memory); while a window layer may still read the token, it also
has a window slot holding the window layers' K/V. Window slot 0, like slot 0, is the padding
sink. The attention backends read a window layer's KV at ``to_window[req_to_token[row, p]]``.

Contract
--------
* ``HybridSlotAllocator`` is the replica's ``SlotAllocator``, used as one (by the KV manager
  and the radix cache, on the event-loop thread): ``alloc`` gives every slot a window slot
  too, ``free`` returns both. ``free_window`` returns only the window slots (KV that no window
  layer will read again: behind every window of the request that computed it, or evicted from
  the cache's window region); ``move_window`` hands a window slot from one slot to another.
* The host map ``to_window`` is the truth. Each assignment queues a device write
  (``take_map_writes``) that the next batch carries (``ForwardBatch.window_map``) and the
  worker applies before its forward, as it applies table writes; they are taken as the batch
  is built, before its commit moves any (``move_window``: the batch still stores its new
  tokens' window KV through their own slots; the next one reads it through the tree's).
  Frees queue none: a slot
  without window KV is never read unmasked by a window layer, since requests free only what
  lies behind their windows and the radix cache serves no prefix whose window KV is gone.
"""

from __future__ import annotations

import math

import torch

from radixd.core.kv_pool import SlotAllocator


def window_slots(num_slots: int, ratio: float) -> int:
    """The window region's size (in slots, with its sink) for a pool of ``num_slots``:
    ``ratio`` of its tokens."""
    return max(2, math.ceil(ratio * (num_slots - 1)) + 1)


class HybridSlotAllocator(SlotAllocator):
    """Slots and their window slots (see the module docstring). ``window``: the widest layer
    window, in keys a query reads, itself included."""

    def __init__(self, num_slots: int, num_window_slots: int, window: int):
        super().__init__(num_slots)
        self.window = window
        self.windows = SlotAllocator(num_window_slots)
        self.to_window = torch.zeros(num_slots, dtype=torch.int64)
        self._writes: list[torch.Tensor] = []

    @property
    def window_available(self) -> int:
        return self.windows.available

    @property
    def window_total(self) -> int:
        return self.windows.total

    def alloc(self, n: int) -> torch.Tensor | None:
        if n > self.windows.available:
            return None
        slots = super().alloc(n)
        if slots is None:
            return None
        w = self.windows.alloc(n)
        self.to_window[slots] = w
        self._writes.append(slots)
        return slots

    def free(self, slots: torch.Tensor) -> None:
        super().free(slots)
        self.free_window(slots)

    def free_window(self, slots: torch.Tensor) -> int:
        """Free the window slots of ``slots`` (those they still have); how many."""
        if not slots.numel():
            return 0
        w = self.to_window[slots]
        w = w[w != 0]
        self.windows.free(w)
        self.to_window[slots] = 0
        return int(w.numel())

    def has_window(self, slots: torch.Tensor) -> torch.Tensor:
        """bool per slot: its window KV is there."""
        return self.to_window[slots] != 0

    def move_window(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """``dst`` (slots without window KV) take over the window slots of ``src``."""
        w = self.to_window[src]
        self.to_window[dst] = w
        self.to_window[src] = 0
        self._writes.append(dst.clone())

    def take_map_writes(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(slots, window slots) assigned since the last call, for the next batch: each slot
        once, with its window slot now (a slot may have been given one, freed and given
        another meanwhile, and a scatter with repeated indices has no order)."""
        if not self._writes:
            return None
        slots = torch.cat(self._writes).unique()
        self._writes = []
        return slots, self.to_window[slots]
