"""CUDA graphs of the decode forward pass, one per batch-size bucket.

Each graph reads static device buffers (token ids, positions, output slots, table rows,
sequence lengths); a replay copies the batch into them, pads the bucket with dummy requests
(row 0, length 1, writing into the pool's padding slot 0) and returns the real rows' logits.
"""

from __future__ import annotations

import bisect

import torch

from radixd.core.forward_batch import ForwardBatch


def buckets_up_to(max_batch: int) -> list[int]:
    sizes = [1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 448, 512]
    out = [b for b in sizes if b < max_batch]
    return out + [max_batch]


class DecodeGraphs:
    def __init__(self, model, attn, pool, *, max_batch: int, capture_error_mode: str = "global",
                 deferred: bool = False):
        """``deferred``: only the buffers; the caller runs ``warm_up`` and ``capture`` (tensor-
        parallel shards warm up together, then capture, so no shard's capture, which
        synchronizes and frees cached memory, overlaps another's collective kernels)."""
        self.capture_error_mode = capture_error_mode
        self.model = model
        self.attn = attn
        self.pool = pool
        self.buckets = buckets_up_to(max_batch)
        dev = pool.device
        n = self.buckets[-1]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.out_cache_loc = torch.zeros(n, dtype=torch.int64, device=dev)
        self.rows = torch.zeros(n, dtype=torch.int64, device=dev)
        self.seq_lens = torch.ones(n, dtype=torch.int64, device=dev)
        self.logits_idx = torch.arange(n, dtype=torch.int64, device=dev)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        if not deferred:
            self.warm_up()
            self.capture()

    def _bucket_args(self, bs: int) -> tuple:
        self.attn.set_decode(self.rows[:bs], self.seq_lens[:bs], self.out_cache_loc[:bs])
        return (self.input_ids[:bs], self.positions[:bs], self.attn, self.logits_idx[:bs])

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Every bucket's forward twice outside capture (autotuning, lazy initialisation),
        largest first so scratch buffers never regrow; returns with the device idle."""
        dev = self.pool.device
        stream = torch.cuda.Stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):
            for bs in reversed(self.buckets):
                args = self._bucket_args(bs)
                for _ in range(2):
                    self.model(*args)
        torch.cuda.current_stream(dev).wait_stream(stream)
        torch.cuda.synchronize(dev)

    @torch.inference_mode()
    def capture(self) -> None:
        dev = self.pool.device
        mempool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):
            for bs in reversed(self.buckets):
                args = self._bucket_args(bs)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=mempool, stream=stream, capture_error_mode=self.capture_error_mode):
                    out = self.model(*args)
                self.graphs[bs] = (graph, out)
        torch.cuda.current_stream(dev).wait_stream(stream)
        torch.cuda.synchronize(dev)

    def can_run(self, batch: ForwardBatch) -> bool:
        return (batch.batch_size <= self.buckets[-1] and all(e == 1 for e in batch.extend_lens)
                and not batch.prompt_lp_pos)

    def run(self, batch: ForwardBatch, input_ids: torch.Tensor, stage) -> torch.Tensor:
        """Replay the bucket's graph; ``stage`` copies host tensors without blocking."""
        b = batch.batch_size
        bs = self.buckets[bisect.bisect_left(self.buckets, b)]
        self.input_ids[:b].copy_(input_ids, non_blocking=True)
        self.positions[:b].copy_(stage(batch.positions), non_blocking=True)
        self.out_cache_loc[:b].copy_(stage(batch.out_cache_loc), non_blocking=True)
        self.rows[:b].copy_(stage(batch.rows), non_blocking=True)
        self.seq_lens[:b].copy_(stage(batch.seq_lens), non_blocking=True)
        if bs > b:
            self.input_ids[b:bs].zero_()
            self.positions[b:bs].zero_()
            self.out_cache_loc[b:bs].zero_()
            self.rows[b:bs].zero_()
            self.seq_lens[b:bs].fill_(1)
        graph, out = self.graphs[bs]
        graph.replay()
        if len(batch.sample_indices) == b:
            return out[:b]
        return out[:b].index_select(0, stage(batch.sample_indices))
