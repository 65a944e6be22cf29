"""Attention backends: they read K and V through the request-to-token table.

``AttentionBackend`` is the interface: ``begin`` builds the batch's metadata once, ``forward``
stores the new tokens' K/V in the pool and attends (extend over the cached prefix plus the new
tokens, causally; decode is extend with one token), ``project_forward`` may do the same from
the layer's input. ``torch`` is the reference and CPU path.
"""

from __future__ import annotations

from typing import Protocol

import torch

from radixd.core.forward_batch import ForwardBatch
from radixd.core.kv_pool import KVPool


class AttentionBackend(Protocol):
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


def make_backend(name: str, pool: KVPool, *, num_heads: int, head_dim: int, scale: float,
                 cascade: bool = False) -> AttentionBackend:
    """``cascade``: decode batches whose requests share a cached prefix read it once per
    item (``ForwardBatch.shared``; the ``triton`` backend; ``torch`` attends per request)."""
    if name == "torch":
        from radixd.core.attention.torch_backend import TorchAttention

        return TorchAttention(pool, num_heads=num_heads, head_dim=head_dim, scale=scale)
    if name == "triton":
        from radixd.core.attention.triton_backend import TritonAttention

        return TritonAttention(pool, num_heads=num_heads, head_dim=head_dim, scale=scale, cascade=cascade)
    raise ValueError(f"attention backend {name!r} is not available (available: 'torch', 'triton')")
