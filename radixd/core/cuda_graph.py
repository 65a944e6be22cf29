"""CUDA graphs of the forward pass: ``DecodeGraphs``, decode steps, one per batch-size bucket;
``MixedGraphs``, steps that decode and prefill together, one per token-count bucket (its
docstring).

Each graph reads static device buffers: one int64 block per bucket, [7, bucket] (token ids,
positions, output slots, table rows, sequence lengths, and the token-tree mask's base and
bits), with cascade attention followed by the shared-prefix items' rows (each request's
shared length and its item's split count, the items' table rows and lengths, their
members). A replay fills the block on the host in
page-locked memory, padding the bucket with dummy requests (row 0, length 1, writing into
the pool's padding slot 0), copies it with one transfer, writes the new slots into the
table and the previous step's picks into the token ids from the block on the device, and
returns the real rows' logits. With cascade attention each bucket (of two or more) has a second graph, replayed
for batches with shared-prefix items (``ForwardBatch.shared``).

With ``trees`` (speculative decoding drafts token trees) the plain graphs attend through the
tree mask rows (``decode_attention``'s ``tree``), so that a verify step with token trees
replays them too: its rows are decode rows at their table positions (``LEN`` = table
position + 1, ``POS`` the RoPE position), each tree's rows seeing its root's prefix and, past
the root, only the nodes whose bits are set; a row outside any tree has base = its length.

With ``aux_layers`` (an EAGLE-3 drafter reads the target's streams) each graph also captures
them, and a replay returns ``(logits, aux)``, ``aux`` copied out of the graph's buffer (the
drafter reads it after the next step may have replayed the same graph).
"""

from __future__ import annotations

import bisect

import torch

from radixd.core.attention import GraphAttention
from radixd.core.attention.extends import Extends
from radixd.core.forward_batch import ForwardBatch

IDS, POS, LOC, ROW, LEN, TBASE, TBITS = range(7)  # the rows of a bucket's input block
SHARE, PARTS, IROW, ILEN, MEM = range(7, 12)  # cascade's rows (MEM: the first of M member rows)
MAX_TREE_ROWS = 63  # a tree's rows (its root and nodes) in one int64 of mask bits


def buckets_up_to(max_batch: int) -> list[int]:
    sizes = [1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 448, 512]
    out = [b for b in sizes if b < max_batch]
    return out + [max_batch]


class DecodeGraphs:
    def __init__(self, model, attn: GraphAttention, pool, *, max_batch: int, capture_error_mode: str = "global",
                 deferred: bool = False, trees: bool = False, aux_layers: tuple[int, ...] = ()):
        """``deferred``: only the buffers; the caller runs ``warm_up`` and ``capture`` (tensor-
        parallel shards warm up together, then capture, so no shard's capture, which
        synchronizes and frees cached memory, overlaps another's collective kernels).
        ``trees``: the plain graphs also replay verify steps with token trees."""
        self.capture_error_mode = capture_error_mode
        self.trees = trees
        self.model = model
        self.aux = {"aux_layers": aux_layers} if aux_layers else {}  # the model's keyword
        self.attn = attn
        self.pool = pool
        self.buckets = buckets_up_to(max_batch)
        dev = pool.device
        self.members = attn.cascade_members
        # Per bucket: the rows IDS, POS, LOC, ROW, LEN, TBASE, TBITS (and SHARE, PARTS, IROW,
        # ILEN, M x MEM).
        height = MEM + self.members if self.members else SHARE
        self.inputs = {bs: torch.zeros(height, bs, dtype=torch.int64, device=dev) for bs in self.buckets}
        for block in self.inputs.values():
            block[LEN].fill_(1)
            block[TBASE].fill_(1)
            block[MEM:].fill_(-1)
        self.logits_idx = torch.arange(self.buckets[-1], dtype=torch.int64, device=dev)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.cascade_graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        # Warm-up and capture on one stream: what a kernel makes on first use for its stream
        # (rows_linear's split-K scratch) exists before capture.
        self.stream = torch.cuda.Stream(dev)
        if not deferred:
            self.warm_up()
            self.capture()

    def _variants(self) -> list[tuple[int, bool]]:
        """(bucket, cascade) of every graph, largest bucket first."""
        return [(bs, c) for bs in reversed(self.buckets) for c in (False, True)
                if not c or (self.members and bs >= 2)]

    def _bucket_args(self, bs: int, cascade: bool = False) -> tuple:
        block = self.inputs[bs]
        shared = (block[SHARE], block[PARTS], block[IROW], block[ILEN], block[MEM:]) if cascade else None
        tree = (block[TBASE], block[TBITS]) if self.trees and not cascade else None
        self.attn.set_decode(block[ROW], block[LEN], block[LOC], shared, tree)
        return (block[IDS], block[POS], self.attn, self.logits_idx[:bs])

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Every bucket's forward twice outside capture (autotuning, lazy initialisation),
        largest first so scratch buffers never regrow; returns with the device idle."""
        dev = self.pool.device
        stream = self.stream
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):
            for bs, cascade in self._variants():
                args = self._bucket_args(bs, cascade)
                for _ in range(2):
                    self.model(*args, **self.aux)
        torch.cuda.current_stream(dev).wait_stream(stream)
        torch.cuda.synchronize(dev)

    @torch.inference_mode()
    def capture(self) -> None:
        dev = self.pool.device
        mempool = torch.cuda.graph_pool_handle()
        stream = self.stream
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):
            for bs, cascade in self._variants():
                args = self._bucket_args(bs, cascade)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=mempool, stream=stream, capture_error_mode=self.capture_error_mode):
                    out = self.model(*args, **self.aux)
                (self.cascade_graphs if cascade else self.graphs)[bs] = (graph, out)
        torch.cuda.current_stream(dev).wait_stream(stream)
        torch.cuda.synchronize(dev)

    def can_run(self, batch: ForwardBatch) -> bool:
        return (batch.batch_size <= self.buckets[-1] and all(e == 1 for e in batch.extend_lens)
                and not batch.prompt_lp_pos and not batch.pool_rows
                and (batch.trees is None or self.trees and max(batch.trees.sizes) <= MAX_TREE_ROWS))

    def run(self, batch: ForwardBatch, prev, stager) -> torch.Tensor:
        """Replay the bucket's graph for a decode batch (``can_run``) whose new slots go into
        the table (``write_new_slots``, no other ``table_writes``); ``prev``: the previous
        step's picks for the batch's placeholders; ``stager``: this step's pinned arena."""
        b = batch.batch_size
        bs = self.buckets[bisect.bisect_left(self.buckets, b)]
        shared = batch.shared if bs in self.cascade_graphs else None
        height = self.inputs[bs].shape[0] if shared is not None else SHARE
        block = self.inputs[bs][:height]
        staged = stager.host((height, bs), torch.int64)
        if staged is None:
            staged = torch.empty(height, bs, dtype=torch.int64)
        staged[IDS, :b] = batch.input_ids
        staged[POS, :b] = batch.positions
        staged[LOC, :b] = batch.out_cache_loc
        staged[ROW, :b] = torch.tensor(batch.rows, dtype=torch.int64)
        staged[LEN, :b] = torch.tensor(batch.seq_lens, dtype=torch.int64)
        staged[TBASE, :b] = staged[LEN, :b]
        staged[TBITS, :b] = 0
        if batch.trees is not None:
            self._stage_trees(staged, batch)
        if bs > b:
            staged[:LEN, b:] = 0
            staged[LEN:SHARE, b:] = 1
            staged[TBITS, b:] = 0
        if shared is not None:
            self._stage_items(staged, shared)
        block.copy_(staged, non_blocking=True)
        fill_placeholders(block[IDS], batch, prev, stager)
        if batch.write_new_slots:  # (at each row's table position: a tree's differ from its RoPE positions)
            cols = block[POS, :b] if batch.trees is None else block[LEN, :b] - 1
            self.pool.req_to_token[block[ROW, :b], cols] = block[LOC, :b]
        graph, out = (self.cascade_graphs if shared is not None else self.graphs)[bs]
        graph.replay()
        if self.aux:
            out, aux = out
            return self._rows(out, batch, stager), aux[:b].clone()
        return self._rows(out, batch, stager)

    @staticmethod
    def _rows(logits: torch.Tensor, batch: ForwardBatch, stager) -> torch.Tensor:
        """The sampled requests' rows of a replay's logits."""
        b = batch.batch_size
        if len(batch.sample_indices) == b:
            return logits[:b]
        return logits[:b].index_select(0, stager.to_device(batch.sample_indices))

    @staticmethod
    def _stage_trees(staged: torch.Tensor, batch: ForwardBatch) -> None:
        """Each tree's rows: base = the root's table position, bits = its mask's row."""
        trees = batch.trees
        for first, n, mask in zip(trees.first, trees.sizes, trees.masks, strict=True):
            staged[TBASE, first : first + n] = batch.prefix_lens[first]
            bits = (mask.to(torch.int64) << torch.arange(n, dtype=torch.int64)).sum(1)
            staged[TBITS, first : first + n] = bits

    def _stage_items(self, staged: torch.Tensor, shared) -> None:
        """The shared-prefix items' rows of the host block (unused item slots: length 0)."""
        staged[SHARE:MEM].zero_()
        for r, values in zip((SHARE, PARTS, IROW, ILEN), self.attn.item_rows(shared), strict=True):
            staged[r, : len(values)] = torch.tensor(values, dtype=torch.int64)
        shared.fill_members(staged[MEM:])


def fill_placeholders(ids: torch.Tensor, batch: ForwardBatch, prev, stager) -> None:
    """The batch's tokens not known when it was built (the previous step's picks, still on
    the device) written into a graph's token ids ``ids``."""
    n_ph = len(batch.placeholder_pos)
    if n_ph and batch.placeholder_pos == batch.placeholder_src == list(range(n_ph)):
        ids[:n_ph].copy_(prev.tokens[:n_ph])  # each request's own pick, in order
    elif n_ph:
        pos, src = stager.to_device(torch.tensor([batch.placeholder_pos, batch.placeholder_src]))
        ids[pos] = prev.tokens[src]


MIXED_EXTENDS = 8  # extends one captured mixed step may carry (its chunks, ones_beyond's requests)
XROW, XPRE, XLEN, XSTART = range(4)  # the rows of a mixed bucket's extends block


def ones_beyond(extend_lens: list[int], decode_rows: int) -> int:
    """One-token requests whose flat row is ``decode_rows`` or later (a mixed replay's extend
    kernel takes them)."""
    n, start = 0, 0
    for e in extend_lens:
        n += e == 1 and start >= decode_rows
        start += e
    return n


def mixed_buckets(most: int) -> list[int]:
    """Token counts of the mixed graphs up to ``most``: close together while small, then
    every 64 (a step pads at most 64 rows of matrix products beyond 128 tokens)."""
    sizes = [4, 8, 16, 32, 48, 64, 96, 128, *range(192, most, 64)]
    return [b for b in sizes if b < most] + [most]


class MixedGraphs:
    """CUDA graphs of steps that decode and prefill together, one per token-count bucket
    (``mixed_buckets``), so that such a step costs the host one replay rather than the
    launch of every kernel of every layer.

    A replay's rows are the step's tokens in flat order, padded to the bucket. The decode
    kernel reads only the first ``decode_rows[bs]`` (``max_rows`` at most) of them: each
    one-token request there (a decode, or a prompt's one-token chunk; the scheduler puts
    decodes first) is a decode row at its table row and length, every other row a dummy
    decode row (row 0, length 1) whose output the extend kernel then overwrites. The extend
    kernel takes up to ``MIXED_EXTENDS`` extends (``GraphAttention.set_decode``'s
    ``extends``), each at its table row, prefix, length and first flat row, unused ones of
    length 0: the prompt chunks, and any one-token request beyond the decode rows. K/V are
    stored at every row's slot (padding: the pool's padding slot 0). The logits are computed only at the sampled rows
    (a block of at most ``max_rows`` indices, padding 0) and copied into one buffer all the
    mixed graphs share. The step's table writes are the worker's (one scatter before the
    replay), not the graph's. Not with token trees, prompt logprobs, embeddings or an
    EAGLE-3 drafter's hidden states (those steps run eagerly), nor over tensor parallel.

    ``capture`` False (a CPU, the tests): nothing is captured, and a replay runs the same
    forward over the same static buffers eagerly."""

    def __init__(self, model, attn: GraphAttention, pool, *, max_rows: int, max_tokens: int,
                 capture: bool = True, capture_error_mode: str = "global"):
        self.model = model
        self.attn = attn
        self.pool = pool
        self.buckets = mixed_buckets(max_tokens)
        self.logit_rows = {bs: min(bs, max_rows) for bs in self.buckets}
        self.decode_rows = self.logit_rows  # (the rows the decode kernel reads: as many)
        dev = pool.device
        # Per bucket one int64 block, copied in one transfer: [5, bs] (IDS, POS, LOC, ROW, LEN),
        # [4, MIXED_EXTENDS] (XROW, XPRE, XLEN, XSTART), [logit rows] (the sampled rows).
        self.inputs = {bs: torch.zeros(5 * bs + 4 * MIXED_EXTENDS + self.logit_rows[bs], dtype=torch.int64, device=dev)
                       for bs in self.buckets}
        for bs, flat in self.inputs.items():
            self._views(flat, bs)[0][LEN].fill_(1)
        self.scratch = {bs: attn.decode_scratch(self.decode_rows[bs]) for bs in self.buckets}
        self.logits: torch.Tensor | None = None  # [max_rows, vocab] float32, made by the first forward
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.capture_error_mode = capture_error_mode
        self.captured = capture
        if capture:
            self.stream = torch.cuda.Stream(dev)
            self.warm_up()
            self.capture()

    def _views(self, flat: torch.Tensor, bs: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A bucket's block as (rows [5, bs], extends [4, MIXED_EXTENDS], sampled rows)."""
        rows = flat[: 5 * bs].view(5, bs)
        ext = flat[5 * bs : 5 * bs + 4 * MIXED_EXTENDS].view(4, MIXED_EXTENDS)
        return rows, ext, flat[5 * bs + 4 * MIXED_EXTENDS :]

    def _forward(self, bs: int) -> None:
        """Bucket ``bs``'s step over its static buffers, its logits into ``self.logits``."""
        rows, ext, picks = self._views(self.inputs[bs], bs)
        extends = Extends(ext[XROW], ext[XPRE], ext[XLEN], ext[XSTART], bs)
        r = self.decode_rows[bs]
        self.attn.set_decode(rows[ROW, :r], rows[LEN, :r], rows[LOC], extends=extends, scratch=self.scratch[bs])
        out = self.model(rows[IDS], rows[POS], self.attn, picks)
        if self.logits is None:
            self.logits = torch.empty((max(self.logit_rows.values()), out.shape[1]), dtype=out.dtype, device=out.device)
        self.logits[: picks.numel()].copy_(out)

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Every bucket's forward twice outside capture, largest first (as ``DecodeGraphs``)."""
        dev = self.pool.device
        self.stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(self.stream):
            for bs in reversed(self.buckets):
                for _ in range(2):
                    self._forward(bs)
        torch.cuda.current_stream(dev).wait_stream(self.stream)
        torch.cuda.synchronize(dev)

    @torch.inference_mode()
    def capture(self) -> None:
        dev = self.pool.device
        mempool = torch.cuda.graph_pool_handle()
        self.stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(self.stream):
            for bs in reversed(self.buckets):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=mempool, stream=self.stream,
                                      capture_error_mode=self.capture_error_mode):
                    self._forward(bs)
                self.graphs[bs] = graph
        torch.cuda.current_stream(dev).wait_stream(self.stream)
        torch.cuda.synchronize(dev)

    def can_run(self, batch: ForwardBatch) -> bool:
        """A step of at most the largest bucket's tokens with 1 to ``MIXED_EXTENDS`` extends of
        2+ tokens (any number of one-token rows), sampling no more than its logit rows, and
        nothing a replay does not compute (trees, prompt logprobs, pooled embeddings)."""
        if batch.trees is not None or batch.prompt_lp_pos or batch.pool_rows or batch.num_tokens > self.buckets[-1]:
            return False
        bs = self.buckets[bisect.bisect_left(self.buckets, batch.num_tokens)]
        chunks = sum(1 for e in batch.extend_lens if e > 1)
        if not 0 < chunks or chunks + ones_beyond(batch.extend_lens, self.decode_rows[bs]) > MIXED_EXTENDS:
            return False
        return len(batch.sample_indices) <= self.logit_rows[bs]

    @staticmethod
    def _stage(rows: torch.Tensor, ext: torch.Tensor, picks: torch.Tensor, batch: ForwardBatch,
               decode_rows: int) -> int:
        """Fill a bucket's host block for ``batch`` (the decode kernel reading its first
        ``decode_rows`` rows); returns its sampled rows' count."""
        t = batch.num_tokens
        rows[IDS, :t] = batch.input_ids
        rows[POS, :t] = batch.positions
        rows[LOC, :t] = batch.out_cache_loc
        rows[: LOC + 1, t:] = 0  # (padding: token 0 at position 0 into the padding slot)
        rows[ROW] = 0  # (every row a dummy decode row but the one-token requests' below)
        rows[LEN] = 1
        ext.zero_()
        lens = batch.extend_lens
        k = lens.count(1)
        starts = {}  # each extend's first flat row, by request index
        leading = all(e > 1 for e in lens[k:])  # the one-token requests first (the scheduler's order)
        if leading:
            d = min(k, decode_rows)
            if d:
                rows[ROW, :d] = torch.tensor(batch.rows[:d], dtype=torch.int64)
                rows[LEN, :d] = torch.tensor(batch.prefix_lens[:d], dtype=torch.int64) + 1
            start = d
            for i in range(d, len(lens)):
                starts[i] = start
                start += lens[i]
        else:
            ones, start = [], 0
            for i, e in enumerate(lens):
                if e == 1 and start < decode_rows:
                    ones.append((start, batch.rows[i], batch.prefix_lens[i] + 1))
                else:
                    starts[i] = start
                start += e
            if ones:
                at, one_rows, one_lens = torch.tensor(ones, dtype=torch.int64).T
                rows[ROW, at] = one_rows
                rows[LEN, at] = one_lens
        cols = [(batch.rows[i], batch.prefix_lens[i], lens[i], q0) for i, q0 in starts.items()]
        ext[:, : len(cols)] = torch.tensor(cols, dtype=torch.int64).T
        if leading:  # a sampled request's last row: its index for a one-token one, else its chunk's last
            last = {i: q0 + lens[i] - 1 for i, q0 in starts.items()}
            flat_rows = torch.tensor([last.get(i, i) for i in batch.sample_indices], dtype=torch.int64)
        else:
            flat_rows = batch.logits_indices()
        s = flat_rows.numel()
        picks.zero_()
        picks[:s] = flat_rows
        return s

    def run(self, batch: ForwardBatch, prev, stager) -> torch.Tensor:
        """Replay the bucket's graph for a step ``can_run`` takes whose table writes are
        done; returns the sampled requests' logits (in ``sample_indices`` order), on the
        shared buffer. ``prev``, ``stager``: as ``DecodeGraphs.run``'s."""
        t = batch.num_tokens
        bs = self.buckets[bisect.bisect_left(self.buckets, t)]
        flat = self.inputs[bs]
        staged = stager.host(tuple(flat.shape), torch.int64)
        if staged is None:
            staged = torch.empty(flat.shape, dtype=torch.int64)
        s = self._stage(*self._views(staged, bs), batch, self.decode_rows[bs])
        flat.copy_(staged, non_blocking=True)
        fill_placeholders(self._views(flat, bs)[0][IDS], batch, prev, stager)
        if self.captured:
            self.graphs[bs].replay()
        else:
            with torch.inference_mode():
                self._forward(bs)
        return self.logits[:s]
