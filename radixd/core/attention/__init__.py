"""Attention backends: they read K and V through the request-to-token table.

``AttentionBackend`` is the interface: ``begin`` builds the batch's metadata once, ``forward``
stores the new tokens' K/V in the pool and attends (extend over the cached prefix plus the new
tokens, causally; decode is extend with one token), ``project_forward`` may do the same from
the layer's input. ``torch`` is the reference and CPU path. Per layer, a backend may be given
a sliding window (a query sees only the newest ``window`` keys, itself included) and, for all
layers, a soft-cap on the attention scores (``cap * tanh(score / cap)``, before the mask).

``GraphAttention`` is what ``cuda_graph.DecodeGraphs`` needs on top to capture decode steps:
``set_decode`` points the backend at device tensors the graph owns (its replays refill them),
and with cascade attention ``item_rows`` gives the shared-prefix items' kernel inputs;
``cuda_graph.MixedGraphs`` adds ``set_decode``'s extends (prompt chunks among the rows) and
keeps split-KV scratch of its own (``decode_scratch``).
"""

from __future__ import annotations

from typing import Protocol

import torch

from radixd.core.attention.extends import Extends
from radixd.core.forward_batch import ForwardBatch
from radixd.core.kv_pool import KVPool


class AttentionBackend(Protocol):
    # Requests per shared-prefix item when decoding in cascade (``ForwardBatch.shared``);
    # 0: no cascade (the scheduler then plans no items).
    cascade_members: int

    def begin(self, batch: ForwardBatch, stage=None) -> None:
        """Prepare per-batch metadata (index arrays, masks) shared by all layers. ``stage``
        copies a host tensor or int list to the device without blocking the host."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                positions: torch.Tensor, rotary) -> torch.Tensor:
        """``q`` [T, H, D], ``k``/``v`` [T, Hkv, D] for the batch's new tokens, before rotary:
        apply ``rotary`` at ``positions``, store K/V in the pool, attend -> [T, H, D]."""

    def project_forward(self, x: torch.Tensor, proj: torch.nn.Linear, layer: int, positions: torch.Tensor,
                        rotary) -> torch.Tensor | None:
        """``forward`` from the layer's input ``x`` [T, hidden] and its fused q/k/v projection,
        where the backend has a faster way (projection, rotary and store in one kernel); None
        where it has not: the caller projects and calls ``forward``."""

    def warm_up(self) -> None:
        """Build what the first steps would otherwise build on the thread that runs them
        (cuDNN's attention plans): called once on that thread, before the first step, with
        the pool idle."""


class GraphAttention(AttentionBackend, Protocol):
    def set_decode(self, rows: torch.Tensor, seq_lens: torch.Tensor, out_cache_loc: torch.Tensor,
                   shared: tuple[torch.Tensor, ...] | None = None,
                   tree: tuple[torch.Tensor, torch.Tensor] | None = None,
                   extends: Extends | None = None,
                   scratch: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Decode steps from now on read these device tensors ([B] each; ``shared``: the
        cascade items' (shares [B], prefix parts [B], item rows [N], item lengths [N],
        members [M, N]), or None for plain decode; ``tree``: (base [B], bits [B]), the
        token-tree mask of a verify step's rows (``decode_attention``'s), or None;
        ``extends``: prompt chunks among the rows, attended causally over their prefixes,
        their rows' decode outputs replaced (not with ``shared`` or ``tree``; ``rows`` and
        ``seq_lens`` may then cover only the first rows of ``out_cache_loc``'s, every later
        one an extend's), and then ``scratch``: ``decode_scratch(len(rows))``'s buffers)."""

    def decode_scratch(self, rows: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Split-KV buffers for a decode step of ``rows`` rows that the caller keeps (its
        graphs read them), or None where such a step needs none."""

    def item_rows(self, shared) -> tuple[list[int], list[int], list[int], list[int]]:
        """The host values of ``shared``'s first four tensors for a ``SharedPrefixes``."""


def make_backend(name: str, pool: KVPool, *, num_heads: int, head_dim: int, scale: float,
                 cascade: bool = False, fuse_one_row: bool = True, dense_prefill: bool = False,
                 windows: tuple[int, ...] = (), softcap: float = 0.0,
                 prefill_limits: tuple[int, int] = (2048, 4096), pdl: bool = False,
                 merge_in_kernel: bool = False) -> AttentionBackend:
    """``cascade``: decode batches whose requests share a cached prefix read it once per
    item (``ForwardBatch.shared``; the ``triton`` backend; ``torch`` attends per request;
    not with windows). ``fuse_one_row``: one-request decode steps project, rotate and store
    K/V in one kernel (``triton``). ``dense_prefill``: long extends attend in cuDNN's fused
    kernels (``triton``; ``triton_backend``'s docstring says when), of up to
    ``prefill_limits`` (new tokens of one extend, of a step) tokens; ``pdl``: its decode
    kernels launched for programmatic dependent launch (``triton``); ``merge_in_kernel``: its
    decode attention merges the splits in its first kernel (``triton``). ``windows``: each layer's
    sliding window (0: none; empty: no layer has one); ``softcap``: the score soft-cap (0:
    none)."""
    if name == "torch":
        from radixd.core.attention.torch_backend import TorchAttention

        return TorchAttention(pool, num_heads=num_heads, head_dim=head_dim, scale=scale, windows=windows,
                              softcap=softcap)
    if name == "triton":
        from radixd.core.attention.triton_backend import TritonAttention

        return TritonAttention(pool, num_heads=num_heads, head_dim=head_dim, scale=scale,
                               cascade=cascade and not any(windows), fuse_one_row=fuse_one_row,
                               dense_prefill=dense_prefill, windows=windows,
                               softcap=softcap, prefill_limits=prefill_limits, pdl=pdl,
                               merge_in_kernel=merge_in_kernel)
    raise ValueError(f"attention backend {name!r} is not available (available: 'torch', 'triton')")
