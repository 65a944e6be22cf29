"""The model worker: owns one device's model, KV pool and attention backend.

``Worker`` is the interface a replica drives (``ModelWorker`` here, ``TPWorker`` in
``tensor_parallel``): the event loop hands it a ``ForwardBatch`` in the replica's worker
thread and gets a ``StepOutput`` back. A worker never touches scheduler state.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import torch

from radixd.core.attention import AttentionBackend, make_backend
from radixd.core.cpu_setup import step_threads
from radixd.core.forward_batch import ForwardBatch, StepOutput
from radixd.core.kv_pool import KVPool
from radixd.core.kv_quant import KVFormat
from radixd.core.model_loader import load_model
from radixd.core.models.config import ModelConfig
from radixd.core.sampler import SampledTokens, sample_on_device
from radixd.core.staging import Stager
from radixd.core.triton_ops import ALL_KERNELS, KernelChoice

log = logging.getLogger("radixd.worker")


class Worker(Protocol):
    """One replica's device side: its model (whole or in shards), KV pool and sampling.

    Contract: ``launch`` and ``resolve`` run on the replica's worker thread, one call at a
    time, except that while a ``launch`` waits for deferred grammar masks
    (``SamplingBatch.allowed_future``) ``resolve`` of the step before runs on the engine's
    reader thread. ``launch`` queues the step on the device and returns at once; ``resolve``
    waits for those picks. ``close`` is called once, from the event loop, after the worker
    thread has stopped. The scheduler's slots index ``pool`` (every shard's pool alike).
    """

    device: torch.device   # where the replica's picks land (the first shard's device)
    pool: KVPool
    # requests per shared-prefix item of a decode batch (cascade attention); 0: the
    # scheduler plans no items
    cascade_members: int

    def launch(self, batch: ForwardBatch, prev: SampledTokens | None = None) -> SampledTokens | None:
        """Queue the forward pass and sampling; ``prev``: the picks of the step launched
        before, for the batch's placeholders. None if the batch samples nothing."""

    def resolve(self, picks: SampledTokens | None) -> StepOutput:
        """Wait for a launched step and read its picks."""

    def step(self, batch: ForwardBatch) -> StepOutput:
        """``resolve(launch(batch))``."""

    def warm_up(self) -> None:
        """Build what the first steps would build (the attention backend's ``warm_up``): on
        the replica's worker thread, once, before the first ``launch``."""

    def close(self) -> None:
        """Release the worker's own threads (its devices' memory goes with the object)."""


class ModelWorker:
    """The ``Worker`` of one device."""

    def __init__(
        self,
        *,
        model_path: Path | None,
        model_cfg: ModelConfig,
        device: torch.device,
        dtype: torch.dtype,
        attention_backend: str,
        load_format: str = "auto",
        kv_slots: Callable[[int | None], int],
        max_rows: int,
        max_context_len: int,
        cuda_graphs: bool = False,
        cascade_attention: bool = False,
        kernels: KernelChoice = ALL_KERNELS,
        model: torch.nn.Module | None = None,
        head: bool = True,
        kv_format: KVFormat | None = None,
        window_slots: Callable[[int], int] | None = None,
        tree_graphs: bool = False,
        aux_layers: tuple[int, ...] = (),
        prefill_limits: tuple[int, int] = (2048, 4096),
        mixed_graph_tokens: int = 0,
    ):
        """``model``: already built on ``device`` (a tensor-parallel shard; ``model_cfg`` is
        then the shard's shape); otherwise loaded from ``model_path``. ``kernels``: the
        optional kernels the model and attention take; ``head`` False (an embedding engine,
        which never samples): the checkpoint may lack the LM head. ``kv_format``: what the
        pool stores K/V in (None: ``dtype``). ``window_slots`` (a model with sliding windows):
        the window layers' KV in a region of its own, of ``window_slots(pool slots)`` slots
        (``swa_pool``); None: no region. ``tree_graphs``: the decode graphs also replay verify
        steps with token trees (speculative decoding that drafts them). ``aux_layers``: the
        target layers an EAGLE-3 drafter reads (``speculative.drafter.ReadsTarget``): every step
        but embedding ones also hands back the residual stream after them at each of its tokens
        (``StepOutput.aux``); (): none. ``prefill_limits``: the most new tokens of one extend
        and of a step (the scheduler's chunk and budget), for ``dense_prefill``'s plans.
        ``mixed_graph_tokens`` > 0 (with CUDA graphs, one device, no ``aux_layers``): steps
        that decode and prefill together of up to ``max_rows`` + this many tokens replay
        ``cuda_graph.MixedGraphs``; 0: they run eagerly."""
        self.device = device
        self.aux_layers = aux_layers
        self.model_cfg = model_cfg
        prebuilt = model is not None
        if model is None:
            model = load_model(model_path, model_cfg, dtype, device, random_weights=load_format == "dummy",
                               kernels=kernels, head=head)
        self.model = model
        free = None
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            free, _ = torch.cuda.mem_get_info(device)
        num_slots = kv_slots(free)
        windows = model_cfg.layer_windows
        self.pool = KVPool(
            num_layers=model_cfg.num_layers,
            num_slots=num_slots,
            num_kv_heads=model_cfg.num_kv_heads,
            head_dim=model_cfg.head_dim,
            max_rows=max_rows,
            max_context_len=max_context_len,
            dtype=dtype,
            device=device,
            kv_format=kv_format,
            windows=windows,
            window_slots=window_slots(num_slots) if window_slots is not None and any(windows) else 0,
        )
        self.attn = make_backend(
            attention_backend,
            self.pool,
            num_heads=model_cfg.num_heads,
            head_dim=model_cfg.head_dim,
            scale=model_cfg.attention_scale,
            cascade=cascade_attention,
            fuse_one_row=kernels.fuse_one_row,
            dense_prefill=kernels.dense_prefill,
            windows=windows,
            softcap=model_cfg.attn_softcap,
            prefill_limits=prefill_limits,
            pdl=kernels.pdl,
            merge_in_kernel=kernels.merge_in_kernel,
        )
        self.cascade_members = self.attn.cascade_members
        self.stager = Stager(device)
        self.graphs = None
        self.mixed_graphs = None
        self.mixed_graph_tokens = mixed_graph_tokens
        self.tree_graphs = tree_graphs
        self.max_rows = max_rows
        self.graphs_wanted = cuda_graphs and device.type == "cuda" and attention_backend == "triton"
        if self.graphs_wanted and not prebuilt:  # shards capture together, see TPWorker
            self.capture_graphs()

    def capture_graphs(self, capture_error_mode: str = "global", deferred: bool = False) -> None:
        """Capture the decode graphs (tensor-parallel shards: ``deferred``, each in its own
        thread with ``capture_error_mode="thread_local"``, then ``graphs.warm_up()`` on all
        shards together and ``graphs.capture()`` on all)."""
        from radixd.core.cuda_graph import DecodeGraphs

        self.graphs = DecodeGraphs(self.model, self.attn, self.pool, max_batch=self.max_rows,
                                   capture_error_mode=capture_error_mode, deferred=deferred, trees=self.tree_graphs,
                                   aux_layers=self.aux_layers)
        if self.mixed_graph_tokens and not deferred:  # (not over tensor parallel: see MixedGraphs)
            from radixd.core.cuda_graph import MixedGraphs

            try:
                self.mixed_graphs = MixedGraphs(self.model, self.attn, self.pool, max_rows=self.max_rows,
                                                max_tokens=self.max_rows + self.mixed_graph_tokens,
                                                capture_error_mode=capture_error_mode)
            except Exception:
                log.exception("capturing the mixed steps' CUDA graphs failed; those steps run eagerly")
                self.mixed_graphs = None

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, prev: SampledTokens | None = None) -> torch.Tensor:
        """Run the batch; return float32 logits of the sampled requests' last tokens (on a
        CUDA graph's output buffer: valid until the next forward, clone to keep); with pooled
        positions (``batch.pool_pos``) the model's ``(logits or None, hidden states)``; else,
        with ``aux_layers``, ``(logits, aux)`` (``aux``: [tokens, streams * hidden], a graph's
        copied out of its buffer).

        Tokens the scheduler did not know yet (``batch.placeholder_pos``: picks of the step
        before, still on the device) are filled in from ``prev`` here, on the device."""
        assert prev is not None or not batch.placeholder_pos, "a batch with placeholders needs the previous step's picks"
        if self.device.type == "cpu":
            step_threads(batch.num_tokens)
        stage = self.stager.to_device
        self.stager.next_step()
        graphs = self.graphs if self.graphs is not None and self.graphs.can_run(batch) else None
        # (a decode graph's replay stages its inputs in one copy and writes the new slots itself)
        self._write_table(batch, stage, new_slots=graphs is None)
        if graphs is None and self.mixed_graphs is not None and self.mixed_graphs.can_run(batch):
            graphs = self.mixed_graphs
        if graphs is not None:
            for ev in (e for events in batch.wait_events for e in events):  # pages from lower tiers
                torch.cuda.current_stream(self.device).wait_event(ev)
            return graphs.run(batch, prev, self.stager)
        input_ids = stage(batch.input_ids)
        if batch.placeholder_pos:
            input_ids[stage(batch.placeholder_pos)] = prev.tokens[stage(batch.placeholder_src)]
        # Pages loaded from lower tiers, still arriving on a side stream: each layer waits for its part.
        attn = LayerWait(self.attn, batch.wait_events) if batch.wait_events else self.attn
        attn.begin(batch, stage)
        if batch.pool_pos:
            return self.model(input_ids, stage(batch.positions), attn, stage(batch.logits_indices()),
                              stage(batch.pool_pos))
        if self.aux_layers:
            return self.model(input_ids, stage(batch.positions), attn, stage(batch.logits_indices()),
                              aux_layers=self.aux_layers)
        return self.model(input_ids, stage(batch.positions), attn, stage(batch.logits_indices()))

    def _write_table(self, batch: ForwardBatch, stage, *, new_slots: bool) -> None:
        """The batch's ``table_writes`` (and, with ``new_slots``, each new token's slot at
        its request's row and position) in one scatter."""
        rows, cols, vals = [], [], []
        if new_slots and batch.write_new_slots and batch.rows:
            r = torch.tensor(batch.rows, dtype=torch.int64)
            if len(batch.extend_lens) != batch.num_tokens:  # not one token per request
                r = r.repeat_interleave(torch.tensor(batch.extend_lens, dtype=torch.int64))
            rows.append(r)
            cols.append(batch.positions if batch.trees is None else batch.trees.table_positions(batch.positions))
            vals.append(batch.out_cache_loc)
        for row, start, slots in batch.table_writes:
            n = slots.numel()
            rows.append(torch.full((n,), row, dtype=torch.int64))
            cols.append(torch.arange(start, start + n, dtype=torch.int64))
            vals.append(slots)
        if rows:
            cat = torch.cat if len(rows) > 1 else (lambda parts: parts[0])
            self.pool.req_to_token[stage(cat(rows)), stage(cat(cols))] = stage(cat(vals))
        if batch.window_map is not None:
            slots, window = batch.window_map
            self.pool.to_window[stage(slots)] = stage(window)

    @torch.inference_mode()
    def launch(self, batch: ForwardBatch, prev: SampledTokens | None = None, *,
               to_host: bool = True) -> SampledTokens | None:
        """Queue the forward pass and sampling on the device; returns without waiting.
        ``to_host``: also queue the picks' copy to the host (a tensor-parallel shard other
        than the first keeps its own copy of the picks on its device only)."""
        out = self.forward(batch, prev)
        aux = None
        if batch.pool_pos:
            logits, hidden = out
        elif self.aux_layers:
            (logits, aux), hidden = out, None
        else:
            logits, hidden = out, None
        pooled = self._pool(batch, hidden) if batch.pool_rows else None
        s = len(batch.sample_indices)
        prompt_lp = prompt_rank = top = None
        if batch.prompt_lp_pos:
            target = self.stager.to_device(torch.tensor(batch.prompt_lp_target, dtype=torch.int64))
            every = torch.log_softmax(logits[s:].float(), dim=-1)
            prompt_lp = every.gather(1, target[:, None])[:, 0]
            prompt_rank = (every > prompt_lp[:, None]).sum(1) + 1
            if batch.prompt_lp_top:
                top = every.topk(batch.prompt_lp_top, dim=-1)
            logits = logits[:s]
        if s:
            assert batch.sampling is not None
            picks = sample_on_device(logits, _to_device(batch.sampling, self.stager.to_device))
        elif prompt_lp is not None or pooled is not None or aux is not None:
            picks = SampledTokens(tokens=torch.empty(0, dtype=torch.int64, device=self.device))
        else:
            return None
        picks.aux = aux
        picks.prompt_logprobs, picks.prompt_ranks = prompt_lp, prompt_rank
        if top is not None:
            picks.prompt_top_vals, picks.prompt_top_ids = top.values, top.indices
        picks.pooled = pooled
        if to_host:
            picks.start_copy()
        return picks

    def _pool(self, batch: ForwardBatch, hidden: torch.Tensor | None) -> torch.Tensor:
        """[pool_rows, hidden size] float32: each embedding request's pooled positions summed
        into its row (a row with none this step stays zero)."""
        rows = torch.zeros(batch.pool_rows, self.model_cfg.hidden_size, dtype=torch.float32, device=self.device)
        if hidden is not None:
            rows.index_add_(0, self.stager.to_device(batch.pool_row), hidden.float())
        return rows

    @staticmethod
    def resolve(picks: SampledTokens | None) -> StepOutput:
        """Wait for a launched step and read its picks."""
        return picks.to_output() if picks is not None else StepOutput(next_tokens=[])

    def step(self, batch: ForwardBatch) -> StepOutput:
        return self.resolve(self.launch(batch))

    def warm_up(self) -> None:
        with torch.inference_mode():
            self.attn.warm_up()

    def close(self) -> None:
        """Nothing of its own: it computes on the replica's thread."""


class LayerWait:
    """An attention backend that, before layer l attends, makes the compute stream wait for
    layer l's part of the KV loaded from lower tiers: the copy of later layers overlaps the
    compute of earlier ones (eager steps only: graph replays wait for all layers first)."""

    def __init__(self, attn: AttentionBackend, loads: list[list]):
        self.attn = attn
        self.loads = loads
        self.cascade_members = attn.cascade_members

    def begin(self, batch, stage=None) -> None:
        self.attn.begin(batch, stage)

    def _wait(self, layer: int, device: torch.device) -> None:
        stream = torch.cuda.current_stream(device)
        for events in self.loads:
            stream.wait_event(events[layer])

    def forward(self, q, k, v, layer: int, positions, rotary):
        self._wait(layer, q.device)
        return self.attn.forward(q, k, v, layer, positions, rotary)

    def project_forward(self, x, proj, layer: int, positions, rotary):
        self._wait(layer, x.device)
        return self.attn.project_forward(x, proj, layer, positions, rotary)

    def __getattr__(self, name: str):
        if name == "forward_qk_norm" and hasattr(self.attn, name):  # (the backend's, after the wait)
            def forward_qk_norm(q, k, v, layer: int, positions, rotary, qk_norm):
                self._wait(layer, q.device)
                return self.attn.forward_qk_norm(q, k, v, layer, positions, rotary, qk_norm)
            return forward_qk_norm
        raise AttributeError(name)


_DRAW_FIELDS = frozenset(("temperature", "top_p", "top_k", "min_p", "seeds", "steps"))


def _to_device(sb, stage):
    """``sb`` with its tensors on the device; an all-greedy batch leaves the random draw's
    inputs behind (the sampler does not read them)."""
    from dataclasses import fields, replace

    moved = {f.name: stage(getattr(sb, f.name)) for f in fields(sb)
             if isinstance(getattr(sb, f.name), torch.Tensor) and not (sb.all_greedy and f.name in _DRAW_FIELDS)}
    return replace(sb, **moved)


def bind_device(device: torch.device) -> None:
    """Make ``device`` the current CUDA device of the calling (worker) thread: Triton kernels
    and CUDA graphs launch on the current device."""
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)


def on_device(device: torch.device):
    """A context with ``device`` current (model loading and graph capture outside a worker
    thread)."""
    if device.type == "cuda" and device.index is not None:
        return torch.cuda.device(device)
    return contextlib.nullcontext()
