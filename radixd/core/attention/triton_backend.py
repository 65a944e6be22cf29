"""The ``triton`` attention backend: radix attention kernels reading the pool in place.

A batch of only decode requests runs the split-KV decode kernel; any other batch runs the
extend kernel for its extends and, in a mixed step of at least ``MIXED_DECODE_ROWS`` one-token
rows, the decode kernel for those (through the extend kernel a decode row takes a whole tile of
query rows sized for the step's longest chunk). On an H200, 8B shape, one layer, decodes of 576
keys beside one chunk, device time (``benchmarks.mixed_step``): 32 decodes + 512 tokens, 92.8
us through the extend kernel alone vs 65.8 split; 64 + 512, 150.4 vs 92.0; 128 + 512, 278.0 vs
124.2 (1024-token chunks: 1.26x, 1.50x, 2.10x); but 8 decodes + 512 tokens, 32.9 vs 44.4 (the
decode kernel's few rows are a small grid), hence the threshold between them.
With ``dense_prefill`` (an engine option, on by default) the step's extends of at least
``dense_prefill.MIN_TOKENS`` new tokens attend in cuDNN's fused kernels instead, over a fixed
set of execution plans built at start (``dense_prefill``'s docstring; ``warm_up``), and the
others in the extend kernel; a step with too little device work to hide the fused calls' host
time (``dense_prefill.CALL_FLOPS``) keeps the extend kernel. On an H200, 8B shape, the extend kernel reaches 0.63x cuDNN's
speed on 8 x 2048 fresh prompts and 0.73x on a 32k prompt's last chunk
(``benchmarks.extend_attention``). Windows, soft-capping, fp8 pools, float32 on CUDA and token
trees keep the extend kernel; a model's window layers run it over every extend of the step.
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

import torch
import triton

import radixd.core.attention.dense_prefill as dense_prefill
from radixd.core.attention.dense_prefill import DensePlans, DenseStep
from radixd.core.attention.extends import Extends
from radixd.core.attention.triton_kernels import (
    cascade_decode_attention,
    decode_attention,
    extend_attention,
    extend_config,
    prefix_members,
    processors,
)
from radixd.core.forward_batch import ForwardBatch
from radixd.core.kv_pool import KVPool
from radixd.core.quant.gemv import RopeStore
from radixd.core.triton_ops import gemv_rope_store, one_row, rope_store

MIN_SPLITS, MAX_SPLITS = 1, 32
PREFIX_SPLITS = 8  # cascade: the most splits a shared prefix is read in (the grid's)
MERGE_ROWS = 4096  # merge_in_kernel: decode rows its counters hold (more: a second kernel merges)
MIXED_DECODE_ROWS = 32  # a mixed step's one-token rows take the decode kernel from this many (module docstring)


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
    ``dense_prefill``: long extends in cuDNN's kernels (module docstring), for extends of up
    to ``prefill_limits[0]`` new tokens, ``prefill_limits[1]`` in a step (the scheduler's
    chunk and step budget: what ``warm_up`` builds plans for). ``pdl``: the decode path's
    kernels (rotary and store, the q/k/v GEMV, decode attention) launched for programmatic
    dependent launch (``KernelChoice.pdl``). ``merge_in_kernel``: plain (not cascade) decode
    attention of up to ``MERGE_ROWS`` rows merges its splits in its first kernel, counting in
    one buffer of ``MERGE_ROWS`` x KV heads made here (fixed: graphs captured on it never see
    it move; every kernel leaves it at 0)."""

    def __init__(self, pool: KVPool, *, num_heads: int, head_dim: int, scale: float, cascade: bool = False,
                 fuse_one_row: bool = True, dense_prefill: bool = False, windows: tuple[int, ...] = (),
                 softcap: float = 0.0, prefill_limits: tuple[int, int] = (2048, 4096), pdl: bool = False,
                 merge_in_kernel: bool = False):
        self.pool = pool
        self.pdl = pdl
        self.counters = (torch.zeros((MERGE_ROWS, pool.k_buffers[0].shape[1]), dtype=torch.int32, device=pool.device)
                         if merge_in_kernel else None)
        self.windows = windows or (0,) * len(pool.k_buffers)
        self.softcap = softcap
        self.mapped = tuple(bool(w) and pool.to_window is not None for w in self.windows)
        self._window_loc: torch.Tensor | None = None  # this step's new tokens' window slots
        self.fuse_one_row = fuse_one_row
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        dev = pool.device
        self.processors = processors(pool.k_buffers[0].get_device()) if dev.type == "cuda" else 8
        self.decode = False
        self.mixed = None
        self.plans = self._dense_plans(prefill_limits) if dense_prefill else None
        self.dense: DenseStep | None = None
        self.extends: Extends | None = None  # the extend kernel's share of a step (None: nothing)
        self.window_extends: Extends | None = None  # ... on window layers (every extend)
        self.shared = None
        self.tree: tuple[torch.Tensor, torch.Tensor] | None = None
        self.graph_extends: tuple[Extends, tuple] | None = None  # (set_decode's)
        # Requests per shared-prefix item when decoding in cascade (ForwardBatch.shared);
        # 0: cascade off (the scheduler then plans no items).
        self.cascade_members = prefix_members(num_heads // pool.k_buffers[0].shape[1]) if cascade else 0
        self.num_splits = MAX_SPLITS + (PREFIX_SPLITS if cascade else 0)  # partials' slots per request
        self._mid: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _dense_plans(self, limits: tuple[int, int]) -> DensePlans | None:
        """``dense_prefill``'s plans, or None where the fused path does not apply (module docstring)."""
        pool = self.pool
        dtype = pool.k_buffers[0].dtype
        cuda = pool.device.type == "cuda"
        if self.softcap or all(self.windows) or dtype not in (
                (torch.bfloat16, torch.float16) if cuda else (torch.bfloat16, torch.float16, torch.float32)):
            return None
        layer = self.windows.index(0)
        return DensePlans(heads=self.num_heads, kv_heads=pool.k_buffers[0].shape[1], head_dim=self.head_dim,
                          dtype=dtype, device=pool.device,
                          max_extend=min(limits), max_tokens=limits[1],
                          max_context=min(pool.req_to_token.shape[1], pool.k_buffers[layer].shape[0] - 1))

    def warm_up(self) -> None:
        """Build on this thread the cuDNN plans the steps' fused attention may take (the
        thread that runs the steps: torch keeps them per thread), before the first step."""
        if self.plans is not None:
            layer = self.windows.index(0)
            self.plans.warm_up(self.pool.k_buffers[layer], self.pool.v_buffers[layer])

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

    def decode_scratch(self, rows: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Split-KV partials of a decode step of ``rows`` rows for its caller to keep (a
        graph's), or None where that step reads in one split (none needed)."""
        splits = decode_splits(rows, self.pool.k_buffers[0].shape[1], self.processors)
        if splits == 1:
            return None
        dev = self.pool.device
        return (torch.empty((rows, self.num_heads, splits, self.head_dim), dtype=torch.float32, device=dev),
                torch.empty((rows, self.num_heads, splits), dtype=torch.float32, device=dev))

    def prefix_splits(self, items: int) -> int:
        """Splits each shared prefix is read in, for a step with ``items`` items: like
        ``decode_splits`` with an item in place of a request (on an H200, 256 x 2308-token
        requests in 32 groups: 200 us in 1 split, 258 in 8; in 8 groups of 8 requests: 120
        us in 1, 76 in 4; ``python -m benchmarks.decode_profile --sections cascade``)."""
        return min(PREFIX_SPLITS, decode_splits(items, self.pool.k_buffers[0].shape[1], self.processors))

    def set_decode(self, rows: torch.Tensor, seq_lens: torch.Tensor, out_cache_loc: torch.Tensor,
                   shared: tuple[torch.Tensor, ...] | None = None,
                   tree: tuple[torch.Tensor, torch.Tensor] | None = None,
                   extends: Extends | None = None,
                   scratch: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Decode steps read these device tensors; ``shared``: (shares [B], prefix parts [B],
        item rows [N], item lengths [N], members [M, N]) to decode in cascade
        (``cascade_decode_attention``); ``tree``: (base [B], bits [B]), token trees' rows
        among them (``decode_attention``'s mask; not with ``shared``). ``extends`` (a mixed
        step replayed in a graph, ``cuda_graph.MixedGraphs``): after the decode kernel over
        the step's first ``rows.numel()`` rows (``out_cache_loc`` has every row; the later
        ones are all the extends'), the extend kernel overwrites these extends' rows (its
        grid: ``max_extend`` new tokens for each of its requests, an unused one with
        ``extend_len`` 0; its tile: the one of a single extend that long). With ``extends``
        the split-KV partials go to ``scratch`` (``decode_scratch``'s; None: one split, no
        partials), never to the backend's own buffers, whose growth past the decode graphs'
        largest bucket would move what those graphs read."""
        self.decode = True
        self.rows, self.seq_lens, self.out_cache_loc = rows, seq_lens, out_cache_loc
        self._window_loc = None
        self.shared = shared
        self.tree = tree
        kv_heads = self.pool.k_buffers[0].shape[1]
        self.splits = decode_splits(rows.numel(), kv_heads, self.processors)
        self.graph_extends = None
        if extends is not None:
            tile = extend_config(self.head_dim, extends.max_extend, self.num_heads // kv_heads, self.num_heads, 1,
                                 self.processors)
            self.graph_extends = (extends, tile)
            self.mid_o, self.mid_lse = scratch if scratch is not None else (None, None)
            return
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
            self.window_extends = self.extends
            return
        ones = [i for i, e in enumerate(batch.extend_lens) if e == 1]
        ext = list(range(len(batch.extend_lens)))
        if len(ones) >= MIXED_DECODE_ROWS:  # a mixed step: the one-token rows decode
            ext = [i for i, e in enumerate(batch.extend_lens) if e != 1]
            n = len(ones)
            # their tokens: the step's first n when the decodes lead (the scheduler's order), else gathered
            tokens = slice(0, n) if ones[-1] == n - 1 else stage([starts[i] for i in ones])
            splits = decode_splits(n, self.pool.k_buffers[0].shape[1], self.processors)
            mid_o, mid_lse = self._scratch(n)
            self.mixed = (tokens, stage([batch.rows[i] for i in ones]), stage([batch.seq_lens[i] for i in ones]),
                          splits, mid_o[:, :, :splits], mid_lse[:, :, :splits])
        kernel = ext
        if self.plans is not None and ext:
            self.dense = self._plan_dense(batch, ext, starts)
            if self.dense is not None:
                kernel = [ext[j] for j in self.dense.rest]
        self.extends = self._stage_extends(batch, kernel, starts, stage, rows)
        self.window_extends = self.extends
        if self.dense is not None and any(self.windows):
            self.window_extends = self._stage_extends(batch, ext, starts, stage, rows)

    @staticmethod
    def _stage_extends(batch: ForwardBatch, which: list[int], starts: list[int], stage,
                       rows: torch.Tensor) -> Extends | None:
        """The extend kernel's inputs for the extends ``which`` (indices into the batch), None
        if none; ``rows``: the batch's rows, staged."""
        if not which:
            return None
        if len(which) == len(batch.extend_lens):
            return Extends(rows, stage(batch.prefix_lens), stage(batch.extend_lens), stage(starts),
                           max(batch.extend_lens))
        lens = [batch.extend_lens[i] for i in which]
        return Extends(stage([batch.rows[i] for i in which]), stage([batch.prefix_lens[i] for i in which]),
                       stage(lens), stage([starts[i] for i in which]), max(lens))

    def _plan_dense(self, batch: ForwardBatch, ext: list[int], starts: list[int]) -> DenseStep | None:
        """The fused calls of the step's extends ``ext`` (``dense_prefill.plan``), or None if
        none is long enough and warmed."""
        pick = lambda xs: [xs[i] for i in ext]  # noqa: E731
        fresh, joined, split, rest, exact = dense_prefill.plan(
            pick(batch.extend_lens), pick(batch.prefix_lens), pick(batch.rows), pick(starts), self.plans.ready,
            self.plans.min_tokens)
        calls = len(fresh) + len(joined) + 2 * len(split)
        kept = set(range(len(ext))) - set(rest)
        fused = [(batch.extend_lens[ext[j]], batch.prefix_lens[ext[j]]) for j in sorted(kept)]
        if not calls or dense_prefill.layer_flops(batch.num_tokens, self.num_heads * self.head_dim, fused) \
                < dense_prefill.CALL_FLOPS * calls:
            return None  # (too little device work to hide the fused calls' host time: the extend kernel's)
        loc = batch.out_cache_loc
        first = int(loc[0])
        in_order = int(loc[-1]) - first == loc.numel() - 1 and bool((loc.diff() == 1).all())
        return DenseStep(first if in_order else None, fresh, joined, split, rest, batch.num_tokens, exact)

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
        self.extends = Extends(stage(rows), stage(prefix), stage(extend), stage(q_starts), max(extend))
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
        dense = None if self.decode or self.windows[layer] else self.dense
        # the fused calls' q: as projected for a step of exact-shape plans, else contiguous (bucketed plans)
        strided = dense is None or (dense.exact and q.stride() == self.plans.q_strides)
        q_out = q if strided else torch.empty(q.shape, dtype=q.dtype, device=q.device)
        rope_store(q, k, v, positions, rotary.cos, rotary.sin, k_buf, v_buf, self._loc(layer), *scales,
                   qk_norm=qk_norm, q_out=q_out, pdl=self.pdl)
        q = q_out
        if self.decode:
            return self._decode(q, layer)
        ext = self.window_extends if self.windows[layer] else self.extends
        if dense is not None and ext is None and self.mixed is None and len(dense.fresh) == 1 \
                and not (dense.joined or dense.split) and dense.fresh[0][1] * dense.fresh[0][2] == q.shape[0]:
            return dense_prefill.attend(dense, q, k_buf, v_buf, self.out_cache_loc, self.pool.req_to_token,
                                        self.scale, None)  # (one call, the whole step: its output as it is)
        out = torch.empty_like(q)
        if dense is not None:
            dense_prefill.attend(dense, q, k_buf, v_buf, self.out_cache_loc, self.pool.req_to_token, self.scale, out)
        if ext is not None:
            extend_attention(q, k_buf, v_buf, self.pool.req_to_token, ext.rows, ext.prefix_lens,
                             ext.extend_lens, ext.q_starts, ext.max_extend, self.scale, out=out,
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
                            self._loc(layer), num_heads=self.num_heads, k_scale=k_scale, v_scale=v_scale,
                            pdl=self.pdl)
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
        r = self.rows.numel()  # (a mixed graph's step: its first rows only, the rest the extend kernel's)
        out = None
        if r < q.shape[0]:
            out = torch.empty_like(q)
            out[r:].zero_()  # (the bucket's padding rows: finite, as their K/V go to the padding slot)
        od = decode_attention(q[:r], self.pool.k_buffers[layer], self.pool.v_buffers[layer], self.pool.req_to_token,
                              self.rows, self.seq_lens, self.scale, num_splits=self.splits, mid_o=self.mid_o,
                              mid_lse=self.mid_lse, window=self.windows[layer], softcap=self.softcap,
                              k_scale=k_scale, v_scale=v_scale, slot_map=self._map(layer), tree=self.tree,
                              pdl=self.pdl, counters=self.counters, out=None if out is None else out[:r],
                              merge_in_kernel=self.counters is not None and r <= MERGE_ROWS)
        out = od if out is None else out
        if self.graph_extends is not None:
            ext, config = self.graph_extends
            extend_attention(q, self.pool.k_buffers[layer], self.pool.v_buffers[layer], self.pool.req_to_token,
                             ext.rows, ext.prefix_lens, ext.extend_lens, ext.q_starts, ext.max_extend, self.scale,
                             out=out, config=config, window=self.windows[layer], softcap=self.softcap,
                             k_scale=k_scale, v_scale=v_scale, slot_map=self._map(layer))
        return out
