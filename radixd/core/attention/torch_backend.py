"""Reference attention: gather each request's KV through the table, then SDPA.

Decode requests (one new token) are padded into one batched SDPA call; extend requests run
one SDPA each with a causal mask offset by their cached prefix, and so does each token tree's
rows (``ForwardBatch.trees``), with the tree's mask over its own rows. Extend requests that
share a cached prefix (a system prompt: their tables' first ``SHARED_MIN`` slots or more
alike) attend together: one SDPA over the prefix's KV, read once, and each member's own KV,
each query masked to the prefix and its own part causally (layers without a window or
soft-cap; ``_group_extends``). A layer's sliding window
narrows the mask; a prompt with nothing cached attends to its K/V as computed, causal in
SDPA's own mode (no table read, no mask); a score soft-cap (which SDPA cannot apply) takes the explicit
softmax(cap * tanh(q.k * scale / cap)) path. K and V are read through the pool (``KVPool.read``:
dequantized from an fp8 pool). With a window region in the pool (``swa_pool``) a window
layer's KV is read and stored at the window slots of the table's slots.

On the CPU, decode steps of layers without a window or soft-cap read KV where it lies: all
requests of a layer in one call of radixd's C kernel (``cpu_kernels``), or, without a C
compiler, each request's leading run of consecutive slots in place, once for all requests
sharing it (``run_decode``). So do a float32 step's extends on an AVX2 CPU (plain layers, a
pool of float32, float16 or bfloat16): all of them in one call of ``cpu_kernels.extend``
per layer, each row attending to its table's slots up to its own position (2x torch's SDPA
on the default model's heads, and no gather); the groups and masks above are then not made.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from radixd.core import cpu_kernels
from radixd.core.attention.run_decode import attend as run_attend
from radixd.core.attention.run_decode import plan as run_plan
from radixd.core.forward_batch import ForwardBatch
from radixd.core.kv_pool import KVPool

SHARED_MIN = 16  # extends sharing at least this many cached slots attend together
GROUP_MASK_MAX = 1 << 24  # ... unless the group's mask (queries x keys) would be larger


class Extend(NamedTuple):
    """One request's (or token tree's) rows of a step attended as an extend."""

    start: int                      # its first row in the batch
    length: int                     # its rows
    slots: torch.Tensor             # its table's slots, cached prefix and new rows
    window_slots: torch.Tensor      # the same in the pool's window region (``swa_pool``)
    masks: dict                     # window -> [length, slots] bool; {} for a fresh one
    fresh: bool                     # nothing cached: attends to its K/V as computed, causal


class TorchAttention:
    cascade_members = 0  # no cascade decode items (shared prefixes are found per step: _group_extends)

    def __init__(self, pool: KVPool, *, num_heads: int, head_dim: int, scale: float, windows: tuple[int, ...] = (),
                 softcap: float = 0.0):
        self.pool = pool
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        self.windows = windows or (0,) * len(pool.k_buffers)
        self.softcap = softcap
        # layers whose KV lies in the pool's window region
        self.mapped = tuple(bool(w) and pool.to_window is not None for w in self.windows)

    def begin(self, batch: ForwardBatch, stage=None) -> None:
        device = self.pool.device
        self.out_cache_loc = batch.out_cache_loc.to(device)
        starts = [0]
        for e in batch.extend_lens:
            starts.append(starts[-1] + e)
        table = self.pool.req_to_token
        decode = [i for i, e in enumerate(batch.extend_lens) if e == 1]
        trees = batch.trees
        if trees is not None:  # a tree's rows attend as one extend, through its mask
            in_tree = {i for f, n in zip(trees.first, trees.sizes, strict=True) for i in range(f, f + n)}
            decode = [i for i in decode if i not in in_tree]
        windows = set(self.windows)
        to_window = self.pool.to_window
        mapped = to_window.__getitem__ if to_window is not None else lambda idx: idx
        self.window_loc = mapped(self.out_cache_loc)
        self.extends = []
        # a prompt with nothing cached attends to its own K/V as computed (the values the
        # pool holds where it stores them unquantized): not read back, causal in SDPA's own
        # mode, which skips the blocks above the diagonal (plain layers only)
        plain = windows == {0} and not self.softcap
        fresh_ok = plain and not self.pool.quantized
        # a float32 step's extends on an AVX2 CPU: all in radixd's kernel (no masks, no groups)
        kernel = (fresh_ok and device.type == "cpu"
                  and cpu_kernels.extend_takes(self.pool.model_dtype, self.pool.k_buffers[0], self.num_heads))
        for i, e in enumerate(batch.extend_lens):
            if e == 1:
                continue
            p = batch.prefix_lens[i]
            kv_idx = table[batch.rows[i], : p + e]
            fresh = p == 0 and fresh_ok
            masks = {}
            if not fresh and not kernel:
                q_pos = torch.arange(p, p + e, device=device)[:, None]
                kv_pos = torch.arange(p + e, device=device)[None, :]
                masks = {w: (kv_pos <= q_pos) & (kv_pos > q_pos - w if w else True) for w in windows}
            self.extends.append(Extend(starts[i], e, kv_idx, mapped(kv_idx), masks, fresh))
        self.groups = []
        self.cpu_extends = None
        if self.extends and kernel:
            self.cpu_extends = _kernel_extends(self.extends)
            self.extends = []
        elif len(self.extends) > 1 and plain:
            self.extends, self.groups = _group_extends(self.extends, device)
        for f, n, tree_mask in zip(trees.first, trees.sizes, trees.masks, strict=True) if trees is not None else ():
            p = batch.prefix_lens[f]
            kv_idx = table[batch.rows[f], : p + n]
            mask = torch.cat((torch.ones((n, p), dtype=torch.bool), tree_mask), 1).to(device)
            self.extends.append(Extend(starts[f], n, kv_idx, kv_idx, dict.fromkeys(windows, mask), False))
        self.decode_tok = None
        self.decode_runs = None
        self.decode_lens = None
        self.decode_all = False  # every token a request's one new token, attended by the C kernel
        if decode:
            lens = torch.tensor([batch.prefix_lens[i] + 1 for i in decode], device=device)
            max_len = int(lens.max())
            rows = torch.tensor([batch.rows[i] for i in decode], device=device)
            kv_idx = table[rows, :max_len]                      # [Bd, L]; padding reads slot 0..
            kv_pos = torch.arange(max_len, device=device)[None, :]
            valid = kv_pos < lens[:, None]
            kv_idx = torch.where(valid, kv_idx, torch.zeros_like(kv_idx))
            self.decode_tok = torch.tensor([starts[i] for i in decode], device=device)
            if device.type == "cpu" and not self.pool.quantized and not self.softcap:
                if cpu_kernels.takes(self.pool.model_dtype, self.pool.k_buffers[0], self.num_heads):
                    self.decode_lens = lens
                    self.decode_all = not self.extends and len(decode) == len(batch.extend_lens)
                elif self.pool.dtype == self.pool.model_dtype:
                    self.decode_runs = run_plan(kv_idx, lens.tolist(), self.pool.dtype)
            self.decode_kv_idx = kv_idx
            self.decode_window_idx = mapped(kv_idx)
            self.decode_masks = {w: (valid & (kv_pos >= lens[:, None] - w if w else True))[:, None, None, :]
                                 for w in windows}  # [Bd, 1, 1, L]

    def project_forward(self, x, proj, layer: int, positions, rotary) -> None:
        return None  # no fused projection: the layer projects and calls forward

    def warm_up(self) -> None:
        """Nothing to build (torch's SDPA, decode kernels that plan nothing)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                positions: torch.Tensor, rotary) -> torch.Tensor:
        q, k = rotary(positions, q, k)
        mapped = self.mapped[layer]
        self.pool.store(layer, self.window_loc if mapped else self.out_cache_loc, k, v)
        window = self.windows[layer]
        out = torch.empty_like(q)
        for start, e, kv_idx, window_idx, masks, fresh in self.extends:
            if mapped:
                kv_idx = window_idx
            qi = q[start : start + e].transpose(0, 1)[None]          # [1, H, e, D]
            if fresh:  # (begin's comment; a 16-bit pool under a float32 model: K/V rounded as stored)
                ki, vi = k[start : start + e].transpose(0, 1)[None], v[start : start + e].transpose(0, 1)[None]
                if self.pool.dtype != q.dtype:
                    ki, vi = ki.to(self.pool.dtype).to(q.dtype), vi.to(self.pool.dtype).to(q.dtype)
                out[start : start + e] = F.scaled_dot_product_attention(
                    qi, ki, vi, is_causal=True, scale=self.scale, enable_gqa=True)[0].transpose(0, 1)
                continue
            ki, vi = self.pool.read(layer, kv_idx, q.dtype)          # [S, Hkv, D]
            ki, vi = ki.transpose(0, 1)[None], vi.transpose(0, 1)[None]  # [1, Hkv, S, D]
            out[start : start + e] = self._attend(qi, ki, vi, masks[window])[0].transpose(0, 1)
        if self.cpu_extends is not None:
            cpu_kernels.extend(q, self.pool.k_buffers[layer], self.pool.v_buffers[layer], *self.cpu_extends, self.scale,
                               out)
        for q_rows, kv_idx, mask in self.groups:
            qg = q[q_rows].transpose(0, 1)[None]                     # [1, H, sum e, D]
            kg, vg = self.pool.read(layer, kv_idx, q.dtype)          # [S, Hkv, D]: the prefix once
            kg, vg = kg.transpose(0, 1)[None], vg.transpose(0, 1)[None]
            out[q_rows] = self._attend(qg, kg, vg, mask)[0].transpose(0, 1)
        if self.decode_lens is not None and not window and q.dtype == self.pool.model_dtype:
            k_buf, v_buf = self.pool.k_buffers[layer], self.pool.v_buffers[layer]
            out[self.decode_tok] = cpu_kernels.decode(q[self.decode_tok], k_buf, v_buf, self.decode_kv_idx,
                                                      self.decode_lens, self.scale)
        elif self.decode_runs is not None and not window:
            k_buf, v_buf = self.pool.k_buffers[layer], self.pool.v_buffers[layer]
            out[self.decode_tok] = run_attend(self.decode_runs, q[self.decode_tok], k_buf, v_buf, self.scale)
        elif self.decode_tok is not None:
            qd = q[self.decode_tok][:, :, None, :]                    # [Bd, H, 1, D]
            idx = self.decode_window_idx if mapped else self.decode_kv_idx
            kd, vd = self.pool.read(layer, idx, q.dtype)             # [Bd, L, Hkv, D]
            kd, vd = kd.transpose(1, 2), vd.transpose(1, 2)           # [Bd, Hkv, L, D]
            out[self.decode_tok] = self._attend(qd, kd, vd, self.decode_masks[window])[:, :, 0, :]
        return out

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """q [B, H, M, D], k/v [B, Hkv, S, D], mask broadcastable to [B, H, M, S]."""
        if not self.softcap:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=True)
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.tanh(q.float() @ k.float().transpose(-1, -2) * (self.scale / self.softcap)) * self.softcap
        scores = scores.masked_fill(~mask, float("-inf"))
        return (scores.softmax(-1) @ v.float()).to(q.dtype)


def _kernel_extends(extends: list[Extend]) -> tuple[torch.Tensor, torch.Tensor]:
    """``cpu_kernels.extend``'s slots and meta for ``extends`` (their tables' slots one after
    another; per extend its first row, rows, cached prefix and first slot there)."""
    meta, off = [], 0
    for x in extends:
        n = x.slots.numel()
        meta.append((x.start, x.length, n - x.length, off))
        off += n
    return torch.cat([x.slots for x in extends]), torch.tensor(meta, dtype=torch.int64)


def _group_extends(extends: list[Extend], device: torch.device) -> tuple[list[Extend], list]:
    """Split ``extends`` (``TorchAttention.begin``'s) into the
    ones attended alone and groups sharing a cached prefix, each ``(query rows, slots, mask)``:
    the slots are the shared prefix's (``C`` of them, read once per layer for the whole group)
    followed by each member's own (its table past ``C``: the rest of its cached prefix and
    its new tokens), and the mask [sum of lengths, slots] lets a member's query at position
    ``P + j`` see the prefix and its own slots up to itself. Requests group by their table's
    first slot (the radix cache gives requests with one cached prefix the same slots); ``C``
    is the longest run of slots all members' tables begin with, within their cached prefixes."""
    by_first: dict[int, list[int]] = {}
    for i, x in enumerate(extends):
        if x.slots.numel() - x.length >= SHARED_MIN:  # a cached prefix worth sharing
            by_first.setdefault(int(x.slots[0]), []).append(i)
    alone = set(range(len(extends)))
    groups = []
    for members in by_first.values():
        if len(members) < 2:
            continue
        group = [extends[i] for i in members]
        shortest = min(x.slots.numel() - x.length for x in group)  # cached slots
        tables = torch.stack([x.slots[:shortest] for x in group])
        same = (tables == tables[0]).all(0)
        shared = int(same.numel() if bool(same.all()) else int(same.to(torch.int8).argmin()))
        if shared < SHARED_MIN:
            continue
        lengths = [x.length for x in group]
        owns = [x.slots[shared:] for x in group]
        keys = shared + sum(o.numel() for o in owns)
        if sum(lengths) * keys > GROUP_MASK_MAX:
            continue
        mask = torch.zeros((sum(lengths), keys), dtype=torch.bool, device=device)
        mask[:, :shared] = True
        row = col = 0
        for e, own in zip(lengths, owns, strict=True):
            cached = own.numel() - e  # the member's cached slots past the shared ones
            q_pos = torch.arange(e, device=device)[:, None]
            mask[row : row + e, shared + col : shared + col + own.numel()] = (
                torch.arange(own.numel(), device=device)[None, :] <= cached + q_pos)
            row += e
            col += own.numel()
        q_rows = torch.cat([torch.arange(x.start, x.start + x.length, device=device) for x in group])
        kv_idx = torch.cat([group[0].slots[:shared], *owns])
        groups.append((q_rows, kv_idx, mask[None, None]))
        alone -= set(members)
    return [x for i, x in enumerate(extends) if i in alone], groups
