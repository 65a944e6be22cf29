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

The decoder layers use it fused with what follows every all-reduce there (``add_rmsnorm``):
``residual += sum; out = RMSNorm(residual)``, one program per row, so a layer's two
all-reduces cost no kernels of their own. The plain and the fused kernel each have their own
slots, flags and epochs (a channel), so the alternation argument holds for each.

A rank that never arrives would leave its peers spinning: the wait is bounded (minutes), and
a timed-out wait is counted in ``errors`` (``check``; the tensor-parallel worker raises).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024          # elements per program (plain kernel)
SLOT = 512 * 1024     # elements per slot: bf16 decode activations up to batch 64 x 8192 wide
MAX_BLOCKS = 512      # programs (plain: blocks, fused: rows) per call at most
MAX_SPIN = (1 << 31) - 1  # iterations of a wait before it gives up (minutes)
MAX_ROW = 16384       # widest row the fused kernel normalizes in one program


@triton.jit
def _push_and_wait(x, offs, m, pid, buf_addrs, flag_addrs, epochs, errors,
                   RANK: tl.constexpr, WORLD: tl.constexpr, SLOT_: tl.constexpr,
                   MAX_BLOCKS_: tl.constexpr, MAX_SPIN_: tl.constexpr):
    """Put ``x`` (this program's part) into every peer's slot, raise this program's flags
    there, wait for the peers' flags here; returns the sum over ranks in rank order (fp32)."""
    elem = x.dtype
    ep = tl.load(epochs + pid) + 1
    tl.store(epochs + pid, ep)
    half = (ep % 2) * WORLD
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
    acc = tl.zeros(x.shape, dtype=tl.float32)
    for p in tl.static_range(WORLD):
        if p == RANK:
            acc += x.to(tl.float32)
        else:
            acc += tl.load(own + (half + p) * SLOT_ + offs, mask=m, other=0.0, volatile=True).to(tl.float32)
    return acc


@triton.jit
def _all_reduce_kernel(x_ptr, n, buf_addrs, flag_addrs, epochs, errors,
                       RANK: tl.constexpr, WORLD: tl.constexpr, SLOT_: tl.constexpr,
                       MAX_BLOCKS_: tl.constexpr, BLOCK_: tl.constexpr, MAX_SPIN_: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK_ + tl.arange(0, BLOCK_)
    m = offs < n
    x = tl.load(x_ptr + offs, mask=m, other=0.0)
    acc = _push_and_wait(x, offs, m, pid, buf_addrs, flag_addrs, epochs, errors,
                         RANK, WORLD, SLOT_, MAX_BLOCKS_, MAX_SPIN_)
    tl.store(x_ptr + offs, acc.to(x.dtype), mask=m)


@triton.jit
def _all_reduce_add_rmsnorm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, stride_x, stride_r, stride_o, N, eps,
                                   buf_addrs, flag_addrs, epochs, errors,
                                   RANK: tl.constexpr, WORLD: tl.constexpr, SLOT_: tl.constexpr,
                                   MAX_BLOCKS_: tl.constexpr, BLOCK_: tl.constexpr, MAX_SPIN_: tl.constexpr):
    """Row ``pid``: s = sum over ranks of x; residual += s; out = RMSNorm(residual) * w, with
    ``add_rmsnorm``'s roundings (s rounded to x's dtype first, as an all-reduce returns it)."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_)
    m = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=m, other=0.0)
    acc = _push_and_wait(x, row * N + cols, m, row, buf_addrs, flag_addrs, epochs, errors,
                         RANK, WORLD, SLOT_, MAX_BLOCKS_, MAX_SPIN_)
    h = acc.to(x.dtype).to(tl.float32) + tl.load(res_ptr + row * stride_r + cols, mask=m, other=0.0).to(tl.float32)
    tl.store(res_ptr + row * stride_r + cols, h.to(res_ptr.dtype.element_ty), mask=m)
    var = tl.sum(h * h, 0) / N
    w = tl.load(w_ptr + cols, mask=m, other=0.0)
    y = (h * tl.rsqrt(var + eps)).to(out_ptr.dtype.element_ty) * w
    tl.store(out_ptr + row * stride_o + cols, y, mask=m)


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


class _Channel:
    """Slots, flags and epochs of one kernel kind, on every device of the group."""

    def __init__(self, devices: list[torch.device], dtype: torch.dtype):
        world = len(devices)
        self.bufs = [torch.zeros(2 * world * SLOT, dtype=dtype, device=d) for d in devices]
        self.flags = [torch.zeros(world * MAX_BLOCKS, dtype=torch.int64, device=d) for d in devices]
        self.epochs = [torch.zeros(MAX_BLOCKS, dtype=torch.int64, device=d) for d in devices]
        bufs = torch.tensor([b.data_ptr() for b in self.bufs], dtype=torch.int64)
        flags = torch.tensor([f.data_ptr() for f in self.flags], dtype=torch.int64)
        self.buf_addrs = [bufs.to(d) for d in devices]
        self.flag_addrs = [flags.to(d) for d in devices]

    def args(self, rank: int) -> tuple:
        return self.buf_addrs[rank], self.flag_addrs[rank], self.epochs[rank]


class PeerAllReduce:
    """The channels and per-rank entry points of one group of devices."""

    def __init__(self, devices: list[torch.device], dtype: torch.dtype):
        self.devices = devices
        self.dtype = dtype
        self.world = len(devices)
        self.plain = _Channel(devices, dtype)
        self.fused = _Channel(devices, dtype)
        self.errors = [torch.zeros(1, dtype=torch.int64, device=d) for d in devices]
        for d in devices:
            torch.cuda.synchronize(d)

    def _consts(self) -> dict:
        return dict(WORLD=self.world, SLOT_=SLOT, MAX_BLOCKS_=MAX_BLOCKS, MAX_SPIN_=MAX_SPIN)

    def fits(self, t: torch.Tensor) -> bool:
        return (t.dtype == self.dtype and t.is_contiguous() and t.numel() <= SLOT
                and triton.cdiv(t.numel(), BLOCK) <= MAX_BLOCKS)

    def all_reduce(self, rank: int, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` (rank ``rank``'s partial, on its device) over the group, in place, on the
        current stream. Every rank must make the same calls in the same order."""
        n = t.numel()
        _all_reduce_kernel[(triton.cdiv(n, BLOCK),)](
            t, n, *self.plain.args(rank), self.errors[rank], RANK=rank, BLOCK_=BLOCK, **self._consts(), num_warps=4)
        return t

    def fits_rows(self, x: torch.Tensor, residual: torch.Tensor) -> bool:
        rows, n = x.shape
        return (x.dtype == self.dtype and x.stride(-1) == 1 and residual.stride(-1) == 1
                and rows <= MAX_BLOCKS and rows * n <= SLOT and n <= MAX_ROW)

    def all_reduce_add_rmsnorm(self, rank: int, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                               eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``add_rmsnorm(sum over ranks of x, weight, eps, residual)`` in one kernel: returns
        (RMSNorm(residual + sum), residual), the residual updated in place."""
        rows, n = x.shape
        out = torch.empty_like(x)
        _all_reduce_add_rmsnorm_kernel[(rows,)](
            x, residual, weight, out, x.stride(0), residual.stride(0), out.stride(0), n, eps,
            *self.fused.args(rank), self.errors[rank], RANK=rank, BLOCK_=triton.next_power_of_2(n),
            **self._consts(), num_warps=4 if n <= 4096 else 8)
        return out, residual

    def check(self) -> int:
        """Waits that timed out so far, over all ranks (0 unless a rank went missing)."""
        return int(sum(int(e.item()) for e in self.errors))
