"""The extend kernel's inputs, as the backends and ``cuda_graph.MixedGraphs`` pass them."""

from __future__ import annotations

from typing import NamedTuple

import torch


class Extends(NamedTuple):
    """The extend kernel's inputs for some of a step's extends (device tensors; ``max_extend``
    sizes its grid)."""

    rows: torch.Tensor
    prefix_lens: torch.Tensor
    extend_lens: torch.Tensor
    q_starts: torch.Tensor
    max_extend: int
