"""Token-level KV memory: the pool of KV slots and the request-to-token table.

Memory layout (one pool per worker, on its device)::

    k_buffers[layer]  [num_slots, num_kv_heads, head_dim]   slot 0 is a padding sink
    v_buffers[layer]  [num_slots, num_kv_heads, head_dim]
    req_to_token      [max_rows, max_context_len] int64      row r, position p -> slot

The scheduler owns *which* slots a request uses (``SlotAllocator`` and the radix cache live
on the event-loop thread, on the CPU); the worker owns the buffers and the table, and applies
the table writes each batch carries before its forward pass.
"""

from __future__ import annotations

import torch


class SlotAllocator:
    """Free list of KV slots. Slot 0 is never handed out (padding writes land there)."""

    def __init__(self, num_slots: int):
        if num_slots < 2:
            raise ValueError("a KV pool needs at least 2 slots")
        self.total = num_slots - 1
        self._free = torch.arange(1, num_slots, dtype=torch.int64)

    @property
    def available(self) -> int:
        return int(self._free.numel())

    def alloc(self, n: int) -> torch.Tensor | None:
        """Take ``n`` free slots, or return None (and take nothing) if fewer are free."""
        if n > self._free.numel():
            return None
        out, self._free = self._free[:n], self._free[n:]
        return out

    def free(self, slots: torch.Tensor) -> None:
        if slots.numel():
            self._free = torch.cat((self._free, slots.to(torch.int64)))

    def free_slots(self) -> torch.Tensor:
        return self._free


class RowAllocator:
    """Rows of the request-to-token table, one per running request."""

    def __init__(self, num_rows: int):
        self._free = list(range(num_rows - 1, -1, -1))

    @property
    def available(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        return self._free.pop() if self._free else None

    def free(self, row: int) -> None:
        self._free.append(row)


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * num_kv_heads * head_dim * elem


class KVPool:
    """The per-layer K and V buffers and the request-to-token table (device side)."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        max_rows: int,
        max_context_len: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.num_slots = num_slots
        self.dtype = dtype
        self.device = device
        shape = (num_slots, num_kv_heads, head_dim)
        self.k_buffers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_buffers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.req_to_token = torch.zeros((max_rows, max_context_len), dtype=torch.int64, device=device)

    def store(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k_buffers[layer][loc] = k.to(self.dtype)
        self.v_buffers[layer][loc] = v.to(self.dtype)
