"""Host-to-device copies that do not stall the host.

A copy from ordinary (pageable) host memory makes the host wait until the device's stream
reaches it, i.e. until the step before has finished: that would undo overlap scheduling.
``Stager`` copies each small host tensor into page-locked memory first, so the transfer is
queued and the host moves on. Two arenas alternate between launched steps: a step's arena
is reused two launches later, after the engine has read that step's picks back (so its
copies are done). Callers that launch without reading back must synchronise themselves.
"""

from __future__ import annotations

import torch


class Stager:
    def __init__(self, device: torch.device, nbytes: int = 16 << 20):
        self.device = device
        self.pinned = device.type == "cuda"
        self.arenas = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)] if self.pinned else []
        self.cur = 0
        self.off = 0

    def next_step(self) -> None:
        self.cur ^= 1
        self.off = 0

    def host(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """An uninitialised page-locked host tensor in this step's arena, to fill and then
        copy with ``non_blocking=True`` (None off CUDA or when the arena is full)."""
        if not self.pinned:
            return None
        n = torch.Size(shape).numel() * dtype.itemsize
        start = (self.off + 15) // 16 * 16
        if start + n > self.arenas[self.cur].numel():
            return None
        self.off = start + n
        return self.arenas[self.cur][start : start + n].view(dtype).view(shape)

    def to_device(self, t: torch.Tensor | list[int]) -> torch.Tensor:
        if not isinstance(t, torch.Tensor):
            t = torch.tensor(t, dtype=torch.int64)
        if not self.pinned:
            return t.to(self.device)
        staged = self.host(tuple(t.shape), t.dtype)
        if staged is None:
            return t.to(self.device)  # too big for the arena: a plain (blocking) copy
        staged.copy_(t)
        return staged.to(self.device, non_blocking=True)
