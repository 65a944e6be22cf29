"""A one-shot all-reduce over peer-to-peer memory, for the small messages of decode steps.

Tensor parallel decoding sums two partial activations per layer; at batch 1 each is a few
kilobytes, and a ring all-reduce spends its time in latency, not bandwidth. The shards of one
process can address each other's memory directly (CUDA peer access over NVLink), so each
rank *pushes* its partial into a slot of every peer's buffer, raises a flag there, waits for
the peers' flags on its own device, and sums the slots in rank order (so every rank ends up
with the same bits). One kernel launch per all-reduce, no host involvement: it runs inside
the shards' CUDA graphs like any other kernel.

Every program of the grid handles one block of the message and has its own flags and epoch
(a counter kept on the device, so graph replays need no host-side state). Slots alternate
between two halves by epoch parity: a rank can only write a slot again two all-reduces later,
after its peers have raised the flags of the one in between, which they do only once they
have read the slot. Messages larger than a slot go to the fallback (NCCL).

A rank that never arrives would leave its peers spinning: the wait is bounded, and a timed-out
wait is counted in ``errors`` (checked by the tests and by ``check``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024          # elements per program
SLOT = 512 * 1024     # elements per slot: bf16 decode activations up to batch 64 x 8192 wide
MAX_BLOCKS = SLOT // BLOCK
MAX_SPIN = 1 << 24    # iterations of a wait before it gives up (seconds, not minutes)


@triton.jit
def _one_shot_all_reduce(x_ptr, n, buf_addrs, flag_addrs, epochs, errors,
                         RANK: tl.constexpr, WORLD: tl.constexpr, SLOT_: tl.constexpr,
                         MAX_BLOCKS_: tl.constexpr, BLOCK_: tl.constexpr, MAX_SPIN_: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK_ + tl.arange(0, BLOCK_)
    m = offs < n
    elem = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + offs, mask=m, other=0.0)
    ep = tl.load(epochs + pid) + 1
    tl.store(epochs + pid, ep)
    half = (ep % 2) * WORLD
    # push this rank's partial into its slot on every peer
    for p in tl.static_range(WORLD):
        if p != RANK:
            dst = tl.load(buf_addrs + p).to(tl.pointer_type(elem))
            tl.store(dst + (half + RANK) * SLOT_ + offs, x, mask=m)
    tl.debug_barrier()
    for p in tl.static_range(WORLD):
        if p != RANK:
            flags = tl.load(flag_addrs + p).to(tl.pointer_type(tl.int64))
            tl.atomic_xchg(flags + RANK * MAX_BLOCKS_ + pid, ep, sem="release", scope="sys")
    mine = tl.load(flag_addrs + RANK).to(tl.pointer_type(tl.int64))
    for p in tl.static_range(WORLD):
        if p != RANK:
            spins = 0
            while (tl.atomic_add(mine + p * MAX_BLOCKS_ + pid, 0, sem="acquire", scope="sys") < ep) & (spins < MAX_SPIN_):
                spins += 1
            if spins >= MAX_SPIN_:
                tl.atomic_add(errors, 1)
    tl.debug_barrier()
    own = tl.load(buf_addrs + RANK).to(tl.pointer_type(elem))
    acc = tl.zeros([BLOCK_], dtype=tl.float32)
    for p in tl.static_range(WORLD):
        if p == RANK:
            acc += x.to(tl.float32)
        else:
            acc += tl.load(own + (half + p) * SLOT_ + offs, mask=m, other=0.0, volatile=True).to(tl.float32)
    tl.store(x_ptr + offs, acc.to(elem), mask=m)


def enable_peer_access(devices: list[torch.device]) -> bool:
    """Whether every pair of ``devices`` can address each other's memory; when they can, a
    copy between each ordered pair makes torch enable the access (it does so lazily)."""
    idx = [d.index for d in devices]
    if not all(torch.cuda.can_device_access_peer(a, b) for a in idx for b in idx if a != b):
        return False
    for a in devices:
        for b in devices:
            if a != b:
                torch.ones(1, device=b).copy_(torch.ones(1, device=a))
    for d in devices:
        torch.cuda.synchronize(d)
    return True


class PeerAllReduce:
    """The buffers, flags and per-rank entry points of one group of devices."""

    def __init__(self, devices: list[torch.device], dtype: torch.dtype):
        self.devices = devices
        self.dtype = dtype
        world = len(devices)
        self.world = world
        self.bufs = [torch.zeros(2 * world * SLOT, dtype=dtype, device=d) for d in devices]
        self.flags = [torch.zeros(world * MAX_BLOCKS, dtype=torch.int64, device=d) for d in devices]
        self.epochs = [torch.zeros(MAX_BLOCKS, dtype=torch.int64, device=d) for d in devices]
        self.errors = [torch.zeros(1, dtype=torch.int64, device=d) for d in devices]
        bufs = torch.tensor([b.data_ptr() for b in self.bufs], dtype=torch.int64)
        flags = torch.tensor([f.data_ptr() for f in self.flags], dtype=torch.int64)
        self.buf_addrs = [bufs.to(d) for d in devices]
        self.flag_addrs = [flags.to(d) for d in devices]
        for d in devices:
            torch.cuda.synchronize(d)

    def fits(self, t: torch.Tensor) -> bool:
        return t.dtype == self.dtype and t.numel() <= SLOT and t.is_contiguous()

    def all_reduce(self, rank: int, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` (rank ``rank``'s partial, on its device) over the group, in place, on the
        current stream. Every rank must make the same calls in the same order."""
        n = t.numel()
        _one_shot_all_reduce[(triton.cdiv(n, BLOCK),)](
            t, n, self.buf_addrs[rank], self.flag_addrs[rank], self.epochs[rank], self.errors[rank],
            RANK=rank, WORLD=self.world, SLOT_=SLOT, MAX_BLOCKS_=MAX_BLOCKS, BLOCK_=BLOCK, MAX_SPIN_=MAX_SPIN,
            num_warps=4)
        return t

    def check(self) -> int:
        """Waits that timed out so far, over all ranks (0 unless a rank went missing)."""
        return int(sum(int(e.item()) for e in self.errors))
