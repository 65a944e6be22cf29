"""Tensor parallelism in one process: one replica's model split over ``tp`` devices.

A shard is radixd's own model built for a narrower shape (``num_heads / tp`` heads,
``num_kv_heads / tp`` KV heads, ``intermediate_size / tp`` MLP columns, and of a
mixture-of-experts MLP every expert's and the shared expert's intermediate columns / tp):
its fused q/k/v and gate/up projections hold the rows of its heads and columns (column
parallel), its o_proj and down_proj the matching input columns (row parallel), so their
outputs are partial sums that an all-reduce completes (``DecoderLayer.all_reduce``). lm_head
is split by vocabulary rows (``VocabParallelHead``: each shard computes its rows' logits, an
all-gather joins them; the first shard's are sampled). Embedding, norms, the MoE router and
the shared expert's gate are replicated (so every shard routes each token alike).

Each shard has its own worker thread, KV pool (its KV heads) and attention backend; the
scheduler's slots index every shard's pool alike. The all-reduce:

* CUDA: one NCCL communicator per shard (``radixd.core.nccl``, NCCL called through ctypes),
  each used by its shard's thread only, so threads queue their kernels independently and the GPUs meet in
  the NCCL kernels; decode steps replay per-shard CUDA graphs that contain them.
* CUDA, small messages (decode steps): ``radixd.core.peer_allreduce``, a one-shot kernel
  that writes each partial straight into the other GPUs' memory (``peer_all_reduce``).
* CPU: the shards' threads meet at a barrier whose last arrival sums the partials (in a fixed
  order, so every shard gets the same bits) and writes the sum back into each.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from dataclasses import replace

import torch

from radixd.core.errors import ConfigError
from radixd.core.forward_batch import ForwardBatch, StepOutput
from radixd.core.model_loader import load_model
from radixd.core.models.config import ModelConfig
from radixd.core.quant.linear import mirror_projections, shard_quantized
from radixd.core.sampler import SampledTokens
from radixd.core.triton_ops import ALL_KERNELS, KernelChoice, linear_weight
from radixd.core.worker import ModelWorker, bind_device, on_device

log = logging.getLogger("radixd.tp")


def shard_config(cfg: ModelConfig, tp: int) -> ModelConfig:
    moe = cfg.moe and replace(cfg.moe, intermediate_size=cfg.moe.intermediate_size // tp,
                              shared_intermediate_size=cfg.moe.shared_intermediate_size // tp)
    return replace(cfg, num_heads=cfg.num_heads // tp, num_kv_heads=cfg.num_kv_heads // tp,
                   intermediate_size=cfg.intermediate_size // tp, moe=moe)


def shard_tensor(name: str, w: torch.Tensor, cfg: ModelConfig, rank: int, tp: int) -> torch.Tensor:
    """Shard ``rank``'s part of the full model's parameter ``name``."""
    d = cfg.head_dim
    if ".qkv_proj." in name:  # rows: [q heads | k heads | v heads], each split by head
        q, k, v = w.split((cfg.num_heads * d, cfg.num_kv_heads * d, cfg.num_kv_heads * d), dim=0)
        return torch.cat([part.chunk(tp, dim=0)[rank] for part in (q, k, v)], dim=0)
    if ".gate_up_proj." in name or name.endswith(".experts.gate_up_proj"):
        # rows (of each expert's [2I, H]): [gate | up], each split by column
        gate, up = w.chunk(2, dim=-2)
        return torch.cat((gate.chunk(tp, dim=-2)[rank], up.chunk(tp, dim=-2)[rank]), dim=-2)
    if name.endswith(".experts.gate_up_proj_scale"):  # fp8 experts: as their rows (blocks of rows, or one each)
        dim = -2 if w.dim() == 3 else -1
        gate, up = w.chunk(2, dim=dim)
        return torch.cat((gate.chunk(tp, dim=dim)[rank], up.chunk(tp, dim=dim)[rank]), dim=dim)
    if name.endswith(".experts.down_proj_scale"):  # blocks of input columns; per output row: whole
        return w.chunk(tp, dim=-1)[rank] if w.dim() == 3 else w
    if name.endswith((".o_proj.weight", ".down_proj.weight", ".experts.down_proj")):  # input columns
        return w.chunk(tp, dim=-1)[rank]
    if name == "lm_head.weight":  # rows: the vocabulary, padded to a multiple of tp
        part = -(-w.shape[0] // tp)
        rows = w[rank * part:(rank + 1) * part]
        return torch.cat((rows, rows.new_zeros(part - rows.shape[0], w.shape[1]))) if rows.shape[0] < part else rows
    return w  # embedding, norms, q/k norms, MoE router and shared-expert gate: every shard has them whole


def shard_model(full: torch.nn.Module, cfg: ModelConfig, rank: int, tp: int, device: torch.device,
                dtype: torch.dtype) -> torch.nn.Module:
    """Shard ``rank`` of ``full`` (built for ``cfg``) as a model of its own on ``device``."""
    if not type(full).tensor_parallel:
        raise ValueError(f"architecture {cfg.architecture!r} does not support tensor parallelism (tp_size = 1)")
    part_cfg = shard_config(cfg, tp)
    with torch.device("meta"):
        model = type(full)(part_cfg, kernels=full.kernels)
    model = model.to(dtype)
    _mirror_fp8_experts(full, model, part_cfg, tp)
    quantized = mirror_projections(full, model, torch.device("meta"), dtype)  # (before any allocation)
    model = model.to_empty(device=device)
    whole = dict(full.named_parameters())
    whole["lm_head.weight"] = full.lm_head.weight  # (tied: the embedding, which named_parameters lists once)
    head = shard_tensor("lm_head.weight", whole["lm_head.weight"], cfg, rank, tp)
    model.lm_head = VocabParallelHead(head.to(device=device, dtype=dtype), cfg.vocab_size, full.kernels)
    with torch.no_grad():
        for name, p in model.named_parameters():
            proj = name.rpartition(".")[0]
            if proj in quantized:
                p.copy_(shard_quantized(name, whole[name], full.get_submodule(proj), _sections(proj, cfg), rank, tp))
            elif name != "lm_head.weight":
                p.copy_(shard_tensor(name, whole[name], cfg, rank, tp))
    model.rotary = model.make_rotary(cfg).to(device)
    return model.eval()


def _mirror_fp8_experts(full: torch.nn.Module, shard: torch.nn.Module, part_cfg: ModelConfig, tp: int) -> None:
    """Make ``shard``'s experts fp8 (empty, on "meta") wherever ``full``'s are
    (``moe.Experts.make_fp8``); a shard's intermediate columns must hold whole scale blocks."""
    for name, experts in full.named_modules():
        layout = getattr(experts, "fp8", None)  # (moe.Experts)
        if layout is None:
            continue
        inter = part_cfg.moe.intermediate_size
        if layout.block and (inter % layout.block[0] or inter % layout.block[1]):
            raise ConfigError("tp_size", tp, f"a divisor that keeps {name}'s fp8 blocks of {list(layout.block)} "
                              f"whole ({inter * tp} intermediate columns)")
        shard.get_submodule(name).make_fp8(layout, torch.device("meta"), name)


def _sections(proj: str, cfg: ModelConfig) -> list[int]:
    """The rows of a fused projection's parts (q, k, v or gate, up), each split by the shards."""
    if proj.endswith(".qkv_proj"):
        return [cfg.num_heads * cfg.head_dim] + [cfg.num_kv_heads * cfg.head_dim] * 2
    return [cfg.intermediate_size] * 2


class VocabParallelHead(torch.nn.Module):
    """A shard's lm_head: its rows of the vocabulary; ``gather`` (set by ``TPWorker``) joins
    the shards' logits into ``[rows, tp, part]``, cut back to the vocabulary."""

    def __init__(self, weight: torch.Tensor, vocab_size: int, kernels: KernelChoice):
        super().__init__()
        self.weight = torch.nn.Parameter(weight.detach().clone(), requires_grad=False)  # (not a view of the whole)
        self.vocab_size = vocab_size
        self.kernels = kernels
        self.gather = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        part = linear_weight(x, self.weight, None, self.kernels)
        parts = self.gather(part)  # [tp, rows, part]
        return parts.permute(1, 0, 2).reshape(x.shape[0], -1)[:, : self.vocab_size]


class ThreadSum:
    """All-reduce of CPU tensors among ``n`` threads of this process (a barrier).

    A shard that fails releases the others (``abort``); ``timeout`` bounds the wait should a
    shard thread vanish without doing so (no half of a layer takes minutes)."""

    def __init__(self, n: int, timeout: float | None = 300.0):
        self._parts: list[torch.Tensor | None] = [None] * n
        self._barrier = threading.Barrier(n, action=self._sum, timeout=timeout)
        self._barrier_gather = threading.Barrier(n, timeout=timeout)

    def _sum(self) -> None:
        total = self._parts[0].clone()
        for p in self._parts[1:]:
            total += p
        for p in self._parts:
            p.copy_(total)

    def reduce(self, rank: int, t: torch.Tensor) -> torch.Tensor:
        self._parts[rank] = t
        self._barrier.wait()
        return t

    def gather(self, rank: int, t: torch.Tensor) -> torch.Tensor:
        """Every rank's ``t`` stacked (``[n, *t.shape]``): a copy per rank."""
        self._parts[rank] = t
        self._barrier_gather.wait()  # all parts in place
        out = torch.stack(self._parts)
        self._barrier_gather.wait()  # all read before any rank's next call overwrites its part
        return out

    def abort(self) -> None:
        """Release the other threads (they raise ``BrokenBarrierError``)."""
        self._barrier.abort()
        self._barrier_gather.abort()

    def reset(self) -> None:
        self._barrier.reset()
        self._barrier_gather.reset()


class _RankReduce:
    """``DecoderLayer.all_reduce`` of one shard: the peer-to-peer kernel for messages it
    takes, else NCCL (CUDA) or the thread barrier (CPU)."""

    def __init__(self, rank: int, world: int, group: ThreadSum | None, comm=None, peer=None):
        self.rank, self.world, self.group, self.comm, self.peer = rank, world, group, comm, peer

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        if self.peer is not None and self.peer.fits(t):
            return self.peer.all_reduce(self.rank, t)  # in place, on this shard's current stream
        if self.comm is not None:
            return self.comm.all_reduce(t)
        return self.group.reduce(self.rank, t)

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """Every shard's ``t`` stacked (``[tp, *t.shape]``): NCCL on CUDA."""
        if self.comm is not None:
            out = t.new_empty((self.world, *t.shape))
            return self.comm.all_gather(t.contiguous(), out)
        return self.group.gather(self.rank, t)

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor, norm) -> tuple[torch.Tensor, torch.Tensor]:
        """``norm.forward_add`` of the summed ``x``: one fused kernel where the peer-to-peer
        path takes the rows, else the all-reduce and then the norm."""
        if self.peer is not None and self.peer.fits_rows(x, residual):
            return self.peer.all_reduce_add_rmsnorm(self.rank, x, residual, norm.weight, norm.eps)
        return norm.forward_add(self(x), residual)


class TPWorker:
    """The ``Worker`` of ``len(devices)`` shards of one model."""

    def __init__(self, *, devices: list[torch.device], model_path, model_cfg: ModelConfig, dtype: torch.dtype,
                 attention_backend: str, load_format: str, kv_slots, max_rows: int, max_context_len: int,
                 cuda_graphs: bool = False, cascade_attention: bool = False, peer_all_reduce: bool = True,
                 kernels: KernelChoice = ALL_KERNELS, head: bool = True, kv_format=None, window_slots=None,
                 tree_graphs: bool = False, prefill_limits: tuple[int, int] = (2048, 4096)):
        tp = len(devices)
        self.devices = devices
        self.device = devices[0]
        self.tp = tp
        self.cuda = devices[0].type == "cuda"
        self.model_cfg = model_cfg
        self.executors = [concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"radixd-tp{r}-{dev}",
                                                                initializer=bind_device, initargs=(dev,))
                          for r, dev in enumerate(devices)]
        # The whole model once (the same weights as tp_size = 1 would load), then its shards.
        staging = devices[0] if (self.cuda and load_format == "dummy") else torch.device("cpu")
        full = load_model(model_path, model_cfg, dtype, staging, random_weights=load_format == "dummy", kernels=kernels,
                          head=head)
        models = [shard_model(full, model_cfg, r, tp, dev, dtype) for r, dev in enumerate(devices)]
        del full
        free = None
        if self.cuda:
            torch.cuda.empty_cache()
            frees = []
            for dev in devices:
                torch.cuda.synchronize(dev)
                frees.append(torch.cuda.mem_get_info(dev)[0])
            free = min(frees)
        num_slots = kv_slots(free)
        part_cfg = shard_config(model_cfg, tp)
        self.shards = []
        for dev, model in zip(devices, models, strict=True):
            with on_device(dev):
                self.shards.append(ModelWorker(model_path=None, model=model, model_cfg=part_cfg, device=dev,
                                               dtype=dtype, attention_backend=attention_backend,
                                               kv_slots=lambda _free: num_slots, max_rows=max_rows,
                                               max_context_len=max_context_len, cuda_graphs=cuda_graphs,
                                               cascade_attention=cascade_attention, kernels=kernels,
                                               kv_format=kv_format, window_slots=window_slots,
                                               tree_graphs=tree_graphs, prefill_limits=prefill_limits))
        self.pool = self.shards[0].pool
        self.cascade_members = self.shards[0].cascade_members
        self.model = self.shards[0].model
        self.group = None if self.cuda else ThreadSum(tp)
        comms = self._init_nccl() if self.cuda else [None] * tp
        self.peer = None
        self._resolved = 0
        if self.cuda and peer_all_reduce:
            from radixd.core.peer_allreduce import PeerAllReduce, enable_peer_access

            if enable_peer_access(devices):
                self.peer = PeerAllReduce(devices, dtype)
                self._peer_errors = (torch.zeros(tp, dtype=torch.int64).pin_memory(), None)
            else:
                log.info("tensor parallel: the GPUs cannot address each other's memory; NCCL for every all-reduce")
        for r, shard in enumerate(self.shards):
            reduce = _RankReduce(r, tp, self.group, comms[r], self.peer)
            for layer in shard.model.layers:
                layer.all_reduce = reduce
            shard.model.lm_head.gather = reduce.gather
        self.graphs = False
        if self.shards[0].graphs_wanted:
            self._capture_graphs()

    # ------------------------------------------------------------------ set-up

    def _on_all(self, fn) -> list:
        """``fn(rank)`` on every shard's thread at once; their results in rank order."""
        futures = [ex.submit(fn, r) for r, ex in enumerate(self.executors)]
        return [f.result() for f in futures]

    def _init_nccl(self) -> list:
        from radixd.core.nccl import Nccl

        nccl = Nccl()
        uid = nccl.unique_id()
        return self._on_all(lambda r: nccl.init_rank(self.tp, uid, r))

    def _capture_graphs(self) -> None:
        """Each shard captures its decode graphs in its own thread, all at once (the
        all-reduce kernels of the warm-up runs need every shard). A failure leaves all
        shards eager."""
        try:
            self._on_all(lambda r: self.shards[r].capture_graphs(capture_error_mode="thread_local", deferred=True))
            # Warm-ups run the collectives (every shard at once); captures run nothing, but
            # each synchronizes and frees cached memory, which must not overlap a shard's
            # warm-up kernels waiting for another shard: warm all up, then capture all.
            self._on_all(lambda r: self.shards[r].graphs.warm_up())
            self._on_all(lambda r: self.shards[r].graphs.capture())
            self.graphs = True
        except Exception:
            log.exception("tensor parallel: capturing CUDA graphs failed; decoding without them")
            for shard in self.shards:
                shard.graphs = None

    def close(self) -> None:
        for ex in self.executors:
            ex.shutdown(wait=True)

    # ------------------------------------------------------------------ steps

    def _run(self, batch: ForwardBatch, prev: SampledTokens | None, work) -> list:
        """``work(rank, picks)`` for every shard, shard 0's on this thread and the others' on
        theirs; the results in rank order.

        ``picks``: the previous step's picks on the shard's device. Where every shard
        sampled them (``prev.shard_tokens``) each reads its own; else shard 0's are copied
        to the others here, before shard 0 queues this step: queued later, the copy would
        sit behind shard 0's all-reduce kernels, which wait for the other shards, which
        wait for the copy."""
        picks = [prev] + [None] * (self.tp - 1)
        if prev is not None and batch.placeholder_pos:
            if prev.shard_tokens is not None:
                picks = [SampledTokens(tokens=t) for t in prev.shard_tokens]
            else:
                picks = [prev] + [SampledTokens(tokens=prev.tokens.to(shard.device)) for shard in self.shards[1:]]
        futures = [self.executors[r].submit(self._guarded, work, r, picks[r]) for r in range(1, self.tp)]
        errors = []
        outs = [None] * self.tp
        try:
            outs[0] = self._guarded(work, 0, picks[0])
        except Exception as exc:
            errors.append(exc)
        for r, f in enumerate(futures, start=1):
            try:
                outs[r] = f.result()
            except Exception as exc:
                errors.append(exc)
        if errors:
            if self.group is not None:
                self.group.reset()
            real = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
            raise (real or errors)[0]
        return outs

    def _guarded(self, fn, *args):
        try:
            return fn(*args)
        except BaseException:
            if self.group is not None:
                self.group.abort()  # the other shards wait at the barrier: let them go
            raise

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, prev: SampledTokens | None = None) -> torch.Tensor:
        return self._run(batch, prev, lambda r, picks: self.shards[r].forward(batch, picks))[0]

    @torch.inference_mode()
    def launch(self, batch: ForwardBatch, prev: SampledTokens | None = None) -> SampledTokens | None:
        """Every shard runs the forward pass (they meet in the all-reduces). Shard 0 samples;
        for an all-greedy batch every shard takes the same argmax of the same gathered
        logits, so the next step's tokens are on each device without a copy between them."""
        if batch.sampling is None or not batch.sampling.all_greedy or batch.prompt_lp_pos:
            return self._run(batch, prev, lambda r, picks: (self.shards[r].launch(batch, picks) if r == 0 else
                                                            self.shards[r].forward(batch, picks)))[0]
        outs = self._run(batch, prev, lambda r, picks: self.shards[r].launch(batch, picks, to_host=r == 0))
        if outs[0] is not None:
            outs[0].shard_tokens = [o.tokens for o in outs]
        return outs[0]

    def resolve(self, picks: SampledTokens | None) -> StepOutput:
        out = ModelWorker.resolve(picks)
        if self.peer is not None:
            self._resolved += 1
            if self._resolved % 256 == 0:
                self._check_peer()
        return out

    def _check_peer(self) -> None:
        """Raise if a peer-to-peer wait timed out (a shard went missing for minutes: sums
        since then are wrong). Reads the counters copied at the previous check, without
        waiting for the device, and queues the next copy."""
        seen, done = self._peer_errors
        if done is not None and all(ev.query() for ev in done) and int(seen.sum()) > 0:
            raise RuntimeError("tensor parallel: a peer-to-peer all-reduce timed out waiting for a shard; "
                               "set [parallel] peer_all_reduce = false to use NCCL")
        done = []
        for i, e in enumerate(self.peer.errors):
            seen[i].copy_(e[0], non_blocking=True)
            done.append(torch.cuda.Event())
            done[-1].record(torch.cuda.current_stream(e.device))
        self._peer_errors = (seen, done)

    def step(self, batch: ForwardBatch) -> StepOutput:
        return self.resolve(self.launch(batch))

    def warm_up(self) -> None:
        """Each shard's on the thread that runs its forwards: shard 0's on this (the replica's)
        thread, the others' on their own."""
        futures = [self.executors[r].submit(self.shards[r].warm_up) for r in range(1, self.tp)]
        self.shards[0].warm_up()
        for f in futures:
            f.result()
