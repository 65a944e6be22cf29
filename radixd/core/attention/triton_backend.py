"""The ``triton`` attention backend: radix attention kernels reading the pool in place.

A batch of only decode requests runs the split-KV decode kernel; any other batch runs the
extend kernel for its extends and, in a mixed step of at least ``MIXED_DECODE_ROWS`` one-token
rows, the decode kernel for those (through the extend kernel a decode row takes a whole tile of
query rows sized for the step's longest chunk). On an H200, 8B shape, one layer, decodes of 576
keys beside one chunk (``benchmarks.mixed_step``, two calls): 256 decodes + 512 tokens, 613 us
through the extend kernel alone vs 377 us split (1.6-2.0x); + 2048 tokens, 2.1-2.3x; but 64
decodes + 512 tokens, 222 vs 280 us (0.8-0.9x: the decode kernel's 64 rows are a small grid),
hence the threshold between them.
With ``dense_prefill`` (an engine option, off by default), long extends (each of the step's
at least ``DENSE_MIN_TOKENS``) attend through cuDNN's fused attention instead (torch's SDPA; on
CPU its flash kernel): on an H200, 8B shape, the extend kernel reaches 0.63x its speed on 8 x
2048 fresh prompts and 0.73x on a 32k prompt's last chunk (``benchmarks.extend_attention``).
It is off by default because cuDNN builds an execution plan for every new shape (prompts per
call, their length, the prefix length): about 70 ms each on an H200, about 1 s where a new
kernel variant is compiled, which serving with varied prompt lengths pays again and again.
Prompts with nothing cached attend causally in one call per run of equal lengths; a chunk
after a cached prefix in two, over the prefix (gathered through the request's table row) and
over its own tokens causally, merged by their log-sum-exps. K is read from the pool (rotated
there): a view where the step's slots ascend without gaps, else gathered; V as projected.
Windows, soft-capping, fp8 pools, float32 on CUDA and token trees keep the extend kernel.
Token trees run every row through the extend kernel. ``set_decode`` points the backend at
caller-owned device tensors, which is how CUDA graphs replay it.

A decode step of one request on CUDA also takes ``project_forward``: the layer's q/k/v
projection with rotary and the KV store in its epilogue (``triton_ops.gemv_rope_store``).
Models with per-head q/k norms (Qwen3) take ``forward_qk_norm``: the norms in the rotary
kernel.

With a window region in the pool (``swa_pool``) a window layer stores at and reads through
``pool.to_window``: its new tokens' window slots are gathered once per step, by the first
window layer (inside a CUDA graph's capture, so that replays gather them again)."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton

from radixd.core.attention.triton_kernels import (
    cascade_decode_attention,
    decode_attention,
    extend_attention,
    prefix_members,
)
from radixd.core.forward_batch import ForwardBatch
from radixd.core.kv_pool import KVPool
from radixd.core.quant.gemv import RopeStore
from radixd.core.triton_ops import gemv_rope_store, one_row, rope_store

MIN_SPLITS, MAX_SPLITS = 1, 32
PREFIX_SPLITS = 8  # cascade: the most splits a shared prefix is read in (the grid's)
MIXED_DECODE_ROWS = 128  # a mixed step's one-token rows take the decode kernel from this many (module docstring)
DENSE_MIN_TOKENS = 256  # a step's extends attend in cuDNN's kernels when each has this many (module docstring)
DENSE_MAX_CALLS = 32  # ... in at most this many groups (runs of fresh prompts, chunks after a prefix) per layer
CUDNN_NATIVE_GQA = True  # cuDNN's kernel reads grouped K/V heads as they are (the H200: same output; else repeated)


class Dense(NamedTuple):
    """A step of long extends, attended in cuDNN's kernels (module docstring)."""

    first: int | None  # the first token's slot where the step's slots ascend without gaps, else None (K gathered)
    runs: list[tuple[int, int, int]]  # (first token, requests, tokens each): consecutive fresh prompts of one length
    prefixed: list[tuple[int, int, int, int]]  # (first token, tokens, table row, prefix length): chunks after a prefix


def attention_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused attention of q [B, H, L, D] over k/v [B, Hkv, S, D] (``causal``: L == S) and its
    log-sum-exp [B, H, L, 1] (float32): cuDNN's kernel on CUDA, the flash kernel on CPU."""
    rep = q.shape[1] // k.shape[1]
    if rep > 1 and not (q.is_cuda and CUDNN_NATIVE_GQA):
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    if q.is_cuda:
        o, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False,
                                                                     scale=scale)[:2]
    else:
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return o, lse.reshape(*q.shape[:3], 1).float()


def merge_lse(o1: torch.Tensor, l1: torch.Tensor, o2: torch.Tensor, l2: torch.Tensor) -> torch.Tensor:
    """Attention over the union of two key sets from each set's output and log-sum-exp."""
    m = torch.maximum(l1, l2)
    w1, w2 = torch.exp(l1 - m), torch.exp(l2 - m)
    return ((o1.float() * w1 + o2.float() * w2) / (w1 + w2)).to(o1.dtype)


def decode_splits(batch: int, kv_heads: int, processors: int) -> int:
    """KV splits per request for a decode batch: enough programs (batch x kv heads x splits)
    to fill the device's processors about twice, so that a small batch is not left with a
    few long serial loops (latency-bound) while most of the device idles; no more, since
    every split adds partials to merge (on an H200, 64 x 576 tokens: 47 us unsplit vs 58 us
    in 4 splits; 256 x 576: 166 vs 203 us; ``python -m benchmarks.decode_profile --sections attn``)."""
    want = -(-2 * processors // (batch * kv_heads))
    return min(MAX_SPLITS, max(MIN_SPLITS, triton.next_power_of_2(want)))


class TritonAttention:
    """A ``GraphAttention``. ``fuse_one_row``: take ``project_forward``'s one-kernel path;
    ``dense_prefill``: long extends in cuDNN's kernels (module docstring)."""

    def __init__(self, pool: KVPool, *, num_heads: int, head_dim: int, scale: float, cascade: bool = False,
                 fuse_one_row: bool = True, dense_prefill: bool = False, windows: tuple[int, ...] = (),
                 softcap: float = 0.0):
        self.pool = pool
        self.dense_prefill = dense_prefill
        self.windows = windows or (0,) * len(pool.k_buffers)
        self.softcap = softcap
        self.mapped = tuple(bool(w) and pool.to_window is not None for w in self.windows)
        self._window_loc: torch.Tensor | None = None  # this step's new tokens' window slots
        self.fuse_one_row = fuse_one_row
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        dev = pool.device
        self.processors = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 8
        self.decode = False
        self.mixed = None
        self.dense: Dense | None = None
        self.shared = None
        self.tree: tuple[torch.Tensor, torch.Tensor] | None = None
        # Requests per shared-prefix item when decoding in cascade (ForwardBatch.shared);
        # 0: cascade off (the scheduler then plans no items).
        self.cascade_members = prefix_members(num_heads // pool.k_buffers[0].shape[1]) if cascade else 0
        self.num_splits = MAX_SPLITS + (PREFIX_SPLITS if cascade else 0)  # partials' slots per request
        self._mid: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _scratch(self, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Split-KV partials for up to ``batch`` requests (grown, never shrunk)."""
        have = max(self._mid, default=0)
        if have < batch:
            dev = self.pool.device
            self._mid = {batch: (
                torch.empty((batch, self.num_heads, self.num_splits, self.head_dim), dtype=torch.float32, device=dev),
                torch.empty((batch, self.num_heads, self.num_splits), dtype=torch.float32, device=dev),
            )}
            have = batch
        mid_o, mid_lse = self._mid[have]
        return mid_o[:batch], mid_lse[:batch]

    def prefix_splits(self, items: int) -> int:
        """Splits each shared prefix is read in, for a step with ``items`` items: like
        ``decode_splits`` with an item in place of a request (on an H200, 256 x 2308-token
        requests in 32 groups: 200 us in 1 split, 258 in 8; in 8 groups of 8 requests: 120
        us in 1, 76 in 4; ``python -m benchmarks.decode_profile --sections cascade``)."""
        return min(PREFIX_SPLITS, decode_splits(items, self.pool.k_buffers[0].shape[1], self.processors))

    def set_decode(self, rows: torch.Tensor, seq_lens: torch.Tensor, out_cache_loc: torch.Tensor,
                   shared: tuple[torch.Tensor, ...] | None = None,
                   tree: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Decode steps read these device tensors; ``shared``: (shares [B], prefix parts [B],
        item rows [N], item lengths [N], members [M, N]) to decode in cascade
        (``cascade_decode_attention``); ``tree``: (base [B], bits [B]), token trees' rows
        among them (``decode_attention``'s mask; not with ``shared``)."""
        self.decode = True
        self.rows, self.seq_lens, self.out_cache_loc = rows, seq_lens, out_cache_loc
        self._window_loc = None
        self.shared = shared
        self.tree = tree
        self.splits = decode_splits(rows.numel(), self.pool.k_buffers[0].shape[1], self.processors)
        parts = self.splits + (PREFIX_SPLITS if shared is not None else 0)
        mid_o, mid_lse = self._scratch(rows.numel())
        self.mid_o, self.mid_lse = mid_o[:, :, :parts], mid_lse[:, :, :parts]

    def begin(self, batch: ForwardBatch, stage=None) -> None:
        stage = stage or (lambda t: torch.as_tensor(t, dtype=torch.int64).to(self.pool.device))
        rows = stage(batch.rows)
        seq_lens = stage(batch.seq_lens)
        loc = stage(batch.out_cache_loc)
        if batch.trees is None and all(e == 1 for e in batch.extend_lens):
            self.set_decode(rows, seq_lens, loc, self._stage_shared(batch, stage))
            return
        self.decode = False
        self.mixed = None  # (a mixed step's decode rows: set below)
        self.dense = None
        self.out_cache_loc = loc
        self._window_loc = None
        self.tree_mask = self.tree_offsets = None
        starts = [0]
        for e in batch.extend_lens[:-1]:
            starts.append(starts[-1] + e)
        if batch.trees is not None:
            self._begin_trees(batch, starts, stage)
            return
        ones = [i for i, e in enumerate(batch.extend_lens) if e == 1]
        if len(ones) < MIXED_DECODE_ROWS:
            self.dense = self._plan_dense(batch)
            self.rows = rows
            self.prefix_lens = stage(batch.prefix_lens)
            self.extend_lens = stage(batch.extend_lens)
            self.q_starts = stage(starts)
            self.max_extend = max(batch.extend_lens)
            return
        # a mixed step: the one-token rows decode, the others extend
        ext = [i for i, e in enumerate(batch.extend_lens) if e != 1]
        self.rows = stage([batch.rows[i] for i in ext])
        self.prefix_lens = stage([batch.prefix_lens[i] for i in ext])
        self.extend_lens = stage([batch.extend_lens[i] for i in ext])
        self.q_starts = stage([starts[i] for i in ext])
        self.max_extend = max(batch.extend_lens[i] for i in ext)
        n = len(ones)
        # their tokens: the step's first n when the decodes lead (the scheduler's order), else gathered
        tokens = slice(0, n) if ones[-1] == n - 1 else stage([starts[i] for i in ones])
        splits = decode_splits(n, self.pool.k_buffers[0].shape[1], self.processors)
        mid_o, mid_lse = self._scratch(n)
        self.mixed = (tokens, stage([batch.rows[i] for i in ones]), stage([batch.seq_lens[i] for i in ones]), splits,
                      mid_o[:, :, :splits], mid_lse[:, :, :splits])

    def _plan_dense(self, batch: ForwardBatch) -> Dense | None:
        """The cuDNN plan of a step of long extends (module docstring), or None."""
        lens = batch.extend_lens
        dtype = self.pool.k_buffers[0].dtype
        if not self.dense_prefill or min(lens) < DENSE_MIN_TOKENS or self.softcap:
            return None
        if dtype not in ((torch.bfloat16, torch.float16) if self.pool.device.type == "cuda" else
                         (torch.bfloat16, torch.float16, torch.float32)):
            return None
        runs: list[tuple[int, int, int]] = []
        prefixed: list[tuple[int, int, int, int]] = []
        start = 0
        for n, p, row in zip(lens, batch.prefix_lens, batch.rows, strict=True):
            if p:
                prefixed.append((start, n, row, p))
            elif runs and runs[-1][2] == n and runs[-1][0] + runs[-1][1] * n == start:
                runs[-1] = (runs[-1][0], runs[-1][1] + 1, n)
            else:
                runs.append((start, 1, n))
            start += n
        if len(runs) + len(prefixed) > DENSE_MAX_CALLS:
            return None
        loc = batch.out_cache_loc
        first = int(loc[0])
        in_order = int(loc[-1]) - first == loc.numel() - 1 and bool((loc.diff() == 1).all())
        return Dense(first if in_order else None, runs, prefixed)

    def _attend_dense(self, q: torch.Tensor, v: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor) -> torch.Tensor:
        """``forward``'s attention for a ``Dense`` step (module docstring)."""
        first, runs, prefixed = self.dense
        T, H, D = q.shape
        k = k_buf[first:first + T] if first is not None else k_buf[self.out_cache_loc]
        out = None if len(runs) == 1 and not prefixed else torch.empty((T, H, D), dtype=q.dtype, device=q.device)
        for start, count, n in runs:
            span = slice(start, start + count * n)
            o = F.scaled_dot_product_attention(
                *(t[span].view(count, n, t.shape[1], D).transpose(1, 2) for t in (q, k, v)),
                is_causal=True, scale=self.scale, enable_gqa=True).transpose(1, 2)
            if out is None:
                return o.reshape(T, H, D)
            out[span].view(count, n, H, D).copy_(o)
        for start, n, row, p in prefixed:
            span = slice(start, start + n)
            slots = self.pool.req_to_token[row, :p]
            qs = q[span].view(1, n, H, D).transpose(1, 2)
            o1, l1 = attention_lse(qs, *(b[slots].view(1, p, -1, D).transpose(1, 2) for b in (k_buf, v_buf)),
                                   False, self.scale)
            o2, l2 = attention_lse(qs, *(t[span].view(1, n, -1, D).transpose(1, 2) for t in (k, v)), True, self.scale)
            out[span].view(1, n, H, D).copy_(merge_lse(o1, l1, o2, l2).transpose(1, 2))
        return out

    def _begin_trees(self, batch: ForwardBatch, starts: list[int], stage) -> None:
        """The extend kernel's inputs for a batch with token trees: each tree's rows are one
        extend of its request (from the root's table position), with its mask."""
        trees = batch.trees
        at = dict(zip(trees.first, range(len(trees.first)), strict=True))
        rows, prefix, extend, q_starts, offsets, masks = [], [], [], [], [], []
        off = i = 0
        while i < len(batch.rows):
            t = at.get(i)
            n = batch.extend_lens[i] if t is None else trees.sizes[t]
            rows.append(batch.rows[i])
            prefix.append(batch.prefix_lens[i])
            extend.append(n)
            q_starts.append(starts[i])
            offsets.append(-1 if t is None else off)
            if t is not None:
                masks.append(trees.masks[t].reshape(-1))
                off += n * n
            i += 1 if t is None else n
        self.rows, self.prefix_lens, self.extend_lens = stage(rows), stage(prefix), stage(extend)
        self.q_starts = stage(q_starts)
        self.max_extend = max(extend)
        self.tree_offsets = stage(offsets)
        self.tree_mask = torch.cat(masks).to(torch.int8).to(self.pool.device)

    def item_rows(self, sh) -> tuple[list[int], list[int], list[int], list[int]]:
        """The kernel's per-request and per-item inputs of ``sh`` (a ``SharedPrefixes``):
        shares [B], prefix split counts [B], item rows [N], item lengths [N]."""
        return sh.shares, sh.parts(self.prefix_splits(len(sh.item_lens))), sh.item_rows, sh.item_lens

    def _stage_shared(self, batch: ForwardBatch, stage) -> tuple[torch.Tensor, ...] | None:
        sh = batch.shared
        if sh is None or not self.cascade_members:
            return None
        members = sh.fill_members(torch.empty((self.cascade_members, len(sh.item_lens)), dtype=torch.int64))
        return (*map(stage, self.item_rows(sh)), stage(members))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                positions: torch.Tensor, rotary, qk_norm=None) -> torch.Tensor:
        k_buf, v_buf = self.pool.k_buffers[layer], self.pool.v_buffers[layer]
        scales = self._scales(layer)
        rope_store(q, k, v, positions, rotary.cos, rotary.sin, k_buf, v_buf, self._loc(layer), *scales,
                   qk_norm=qk_norm)
        if self.decode:
            return self._decode(q, layer)
        if self.dense is not None and not self.windows[layer]:
            return self._attend_dense(q, v, k_buf, v_buf)
        out = torch.empty_like(q)
        if self.max_extend:
            extend_attention(q, k_buf, v_buf, self.pool.req_to_token, self.rows, self.prefix_lens,
                             self.extend_lens, self.q_starts, self.max_extend, self.scale, out=out,
                             window=self.windows[layer], softcap=self.softcap, k_scale=scales[0],
                             v_scale=scales[1], slot_map=self._map(layer), tree_mask=self.tree_mask,
                             tree_offsets=self.tree_offsets)
        if self.mixed is not None:
            tokens, rows, seq_lens, splits, mid_o, mid_lse = self.mixed
            qd = q[tokens]
            od = decode_attention(qd, k_buf, v_buf, self.pool.req_to_token, rows, seq_lens, self.scale,
                                  num_splits=splits, out=out[tokens] if isinstance(tokens, slice) else None,
                                  mid_o=mid_o, mid_lse=mid_lse, window=self.windows[layer], softcap=self.softcap,
                                  k_scale=scales[0], v_scale=scales[1], slot_map=self._map(layer))
            if not isinstance(tokens, slice):
                out[tokens] = od
        return out

    def forward_qk_norm(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                        positions: torch.Tensor, rotary, qk_norm: tuple[torch.Tensor, torch.Tensor, float]) -> torch.Tensor:
        """``forward`` of q and k before their per-head RMS norms (Qwen3's), which the rotary
        kernel applies (``rope_store``'s ``qk_norm``: (q weight, k weight, eps)): two kernels
        fewer per layer."""
        return self.forward(q, k, v, layer, positions, rotary, qk_norm=qk_norm)

    def _scales(self, layer: int) -> tuple[float, float]:
        """The layer's K and V scales (an fp8 pool's; 1.0 otherwise)."""
        return self.pool.k_scales[layer], self.pool.v_scales[layer]

    def _loc(self, layer: int) -> torch.Tensor:
        """Where ``layer`` stores the step's new K/V."""
        if not self.mapped[layer]:
            return self.out_cache_loc
        if self._window_loc is None:
            self._window_loc = self.pool.to_window[self.out_cache_loc]
        return self._window_loc

    def _map(self, layer: int) -> torch.Tensor | None:
        return self.pool.to_window if self.mapped[layer] else None

    def project_forward(self, x: torch.Tensor, proj: torch.nn.Linear, layer: int, positions: torch.Tensor,
                        rotary) -> torch.Tensor | None:
        """``forward`` from the layer's input ``x``: for a decode step of one request on CUDA,
        project q/k/v, rotate and store K/V in one kernel, then attend; None otherwise (the
        caller projects and calls ``forward``)."""
        if not (self.decode and self.fuse_one_row):
            return None
        k_buf, v_buf = self.pool.k_buffers[layer], self.pool.v_buffers[layer]
        k_scale, v_scale = self._scales(layer)
        quantized = getattr(proj, "forward_rope", None)  # (a quantized projection's own GEMV)
        if quantized is not None:
            q = quantized(x, RopeStore(positions, rotary.cos, rotary.sin, k_buf, v_buf, self._loc(layer),
                                       self.num_heads, k_scale, v_scale))
            return None if q is None else self._decode(q, layer)
        if not (isinstance(proj, torch.nn.Linear) and one_row(x, proj.weight)):
            return None
        q = gemv_rope_store(x, proj.weight, proj.bias, positions, rotary.cos, rotary.sin, k_buf, v_buf,
                            self._loc(layer), num_heads=self.num_heads, k_scale=k_scale, v_scale=v_scale)
        return self._decode(q, layer)

    def _decode(self, q: torch.Tensor, layer: int) -> torch.Tensor:
        k_scale, v_scale = self._scales(layer)
        if self.shared is not None:
            shares, parts, item_rows, item_lens, members = self.shared
            return cascade_decode_attention(
                q, self.pool.k_buffers[layer], self.pool.v_buffers[layer], self.pool.req_to_token, self.rows,
                self.seq_lens, self.scale, shares, parts, item_rows, item_lens, members, num_splits=self.splits,
                prefix_splits=PREFIX_SPLITS, mid_o=self.mid_o, mid_lse=self.mid_lse, softcap=self.softcap,
                k_scale=k_scale, v_scale=v_scale)
        return decode_attention(q, self.pool.k_buffers[layer], self.pool.v_buffers[layer], self.pool.req_to_token,
                                self.rows, self.seq_lens, self.scale, num_splits=self.splits, mid_o=self.mid_o,
                                mid_lse=self.mid_lse, window=self.windows[layer], softcap=self.softcap,
                                k_scale=k_scale, v_scale=v_scale, slot_map=self._map(layer), tree=self.tree)
