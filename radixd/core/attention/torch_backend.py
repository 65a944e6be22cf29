"""Reference attention: gather each request's KV through the table, then SDPA.

Decode requests (one new token) are padded into one batched SDPA call; extend requests run
one SDPA each with a causal mask offset by their cached prefix, and so does each token tree's
rows (``ForwardBatch.trees``), with the tree's mask over its own rows. A layer's sliding window
narrows the mask; a score soft-cap (which SDPA cannot apply) takes the explicit
softmax(cap * tanh(q.k * scale / cap)) path. K and V are read through the pool (``KVPool.read``:
dequantized from an fp8 pool). With a window region in the pool (``swa_pool``) a window
layer's KV is read and stored at the window slots of the table's slots.

On the CPU, decode steps of layers without a window or soft-cap read KV where it lies: all
requests of a layer in one call of radixd's C kernel (``cpu_kernels``), or, without a C
compiler, each request's leading run of consecutive slots in place, once for all requests
sharing it (``run_decode``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from radixd.core import cpu_kernels
from radixd.core.attention.run_decode import attend as run_attend
from radixd.core.attention.run_decode import plan as run_plan
from radixd.core.forward_batch import ForwardBatch
from radixd.core.kv_pool import KVPool


class TorchAttention:
    cascade_members = 0  # attends per request, shared prefixes too

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
        for i, e in enumerate(batch.extend_lens):
            if e == 1:
                continue
            p = batch.prefix_lens[i]
            kv_idx = table[batch.rows[i], : p + e]
            q_pos = torch.arange(p, p + e, device=device)[:, None]
            kv_pos = torch.arange(p + e, device=device)[None, :]
            masks = {w: (kv_pos <= q_pos) & (kv_pos > q_pos - w if w else True) for w in windows}
            self.extends.append((starts[i], e, kv_idx, mapped(kv_idx), masks))
        for f, n, tree_mask in zip(trees.first, trees.sizes, trees.masks, strict=True) if trees is not None else ():
            p = batch.prefix_lens[f]
            kv_idx = table[batch.rows[f], : p + n]
            mask = torch.cat((torch.ones((n, p), dtype=torch.bool), tree_mask), 1).to(device)
            self.extends.append((starts[f], n, kv_idx, kv_idx, dict.fromkeys(windows, mask)))
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
                if cpu_kernels.takes(self.pool.dtype, self.pool.k_buffers[0], self.num_heads):
                    self.decode_lens = lens
                    self.decode_all = not self.extends and len(decode) == len(batch.extend_lens)
                else:
                    self.decode_runs = run_plan(kv_idx, lens.tolist(), self.pool.dtype)
            self.decode_kv_idx = kv_idx
            self.decode_window_idx = mapped(kv_idx)
            self.decode_masks = {w: (valid & (kv_pos >= lens[:, None] - w if w else True))[:, None, None, :]
                                 for w in windows}  # [Bd, 1, 1, L]

    def project_forward(self, x, proj, layer: int, positions, rotary) -> None:
        return None  # no fused projection: the layer projects and calls forward

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                positions: torch.Tensor, rotary) -> torch.Tensor:
        q, k = rotary(positions, q, k)
        mapped = self.mapped[layer]
        self.pool.store(layer, self.window_loc if mapped else self.out_cache_loc, k, v)
        window = self.windows[layer]
        out = torch.empty_like(q)
        for start, e, kv_idx, window_idx, masks in self.extends:
            if mapped:
                kv_idx = window_idx
            qi = q[start : start + e].transpose(0, 1)[None]          # [1, H, e, D]
            ki, vi = self.pool.read(layer, kv_idx, q.dtype)          # [S, Hkv, D]
            ki, vi = ki.transpose(0, 1)[None], vi.transpose(0, 1)[None]  # [1, Hkv, S, D]
            out[start : start + e] = self._attend(qi, ki, vi, masks[window])[0].transpose(0, 1)
        if self.decode_lens is not None and not window and q.dtype == self.pool.dtype:
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
