"""The sparse mixture-of-experts MLP block the MoE families share:

    logits = router(x); weights, ids = top-k of softmax(logits) (renormalised or not)
    y = sum over the k chosen experts of weight * expert(x)      (``moe_ops.fused_experts``)
      [+ sigmoid(shared_gate(x)) * shared_expert(x)]              (Qwen2-MoE)

(decode at batch 1 on CUDA: the softmax and top-k inside the experts' first kernel,
``moe_ops.experts_gemv``, and the router's GEMV in the kernel of the residual add and norm
before the block, ``forward_add_norm``: the block is three kernels)

Parameter names follow the Hugging Face checkpoints (``gate`` the router, ``experts``,
``shared_expert``, ``shared_expert_gate``); the experts' projections are stacked per layer
(``weights`` fills them from the per-expert tensors).
"""

from __future__ import annotations

import torch
from torch import nn

from radixd.core.models.config import ModelConfig, MoEConfig
from radixd.core.models.layers import GatedMLP
from radixd.core.moe_ops import GEMV_MAX_TOKENS, add_rmsnorm_router, experts_gemv, fused_experts
from radixd.core.quant.formats import Fp8Layout, QuantFormatError
from radixd.core.quant.ops import FP8, quantize_fp8
from radixd.core.triton_ops import ALL_KERNELS, KernelChoice, linear


def moe_mlp(cfg: ModelConfig, layer: int, kernels: KernelChoice) -> nn.Module | None:
    """Layer ``layer``'s MLP: the sparse block, or None (the dense MLP) on a dense layer."""
    if cfg.moe is None or layer in cfg.moe.dense_layers:
        return None
    return SparseMoE(cfg.hidden_size, cfg.moe, kernels=kernels)


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights float32 [T, k], expert ids [T, k]): the top-k of the softmax over all experts,
    rescaled to sum to 1 if ``renormalize`` (then equal to a softmax over the top-k logits)."""
    weights, ids = torch.softmax(logits, dim=-1, dtype=torch.float32).topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class Experts(nn.Module):
    """A layer's experts, stacked: ``gate_up_proj`` [E, 2I, H] (gate rows, then up rows) and
    ``down_proj`` [E, H, I]; in fp8 (``make_fp8``, a quantized checkpoint's experts) with
    ``gate_up_proj_scale`` / ``down_proj_scale`` per expert: [E, N] per output row, or
    [E, ceil(N / bn), ceil(K / bk)] per ``block`` of weights (``moe_ops.fused_experts``)."""

    def __init__(self, num_experts: int, hidden: int, inter: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, inter))
        self.fp8: Fp8Layout | None = None

    def make_fp8(self, layout: Fp8Layout, device: torch.device, name: str) -> None:
        """Hold the experts in fp8 with ``layout``'s scales: empty parameters of the fp8 shapes
        (after the model's dtype cast; filled once by the loader or ``quantize``). ``name``:
        what an error names (the checkpoint's experts)."""
        e, two_i, h = self.gate_up_proj.shape
        if layout.block and (two_i // 2) % layout.block[0]:
            raise QuantFormatError(f"{name}: fp8 blocks of {layout.block[0]} rows straddle the gate and up "
                                   f"projections ({two_i // 2} rows each) once stacked")

        def param(shape: tuple[int, ...], dt: torch.dtype) -> nn.Parameter:
            return nn.Parameter(torch.empty(shape, dtype=dt, device=device), requires_grad=False)

        for attr, (n, k) in (("gate_up_proj", (two_i, h)), ("down_proj", (h, two_i // 2))):
            setattr(self, attr, param((e, n, k), FP8))
            blocks = (-(-n // layout.block[0]), -(-k // layout.block[1])) if layout.block else (n,)
            setattr(self, f"{attr}_scale", param((e, *blocks), torch.float32))
        self.fp8 = layout

    def quantize(self, full: dict[str, torch.Tensor]) -> None:
        """Fill the fp8 experts from 16-bit ``full`` ({"gate_up_proj", "down_proj"} stacked
        weights) by round-to-nearest (random weights of a quantized checkpoint's shape)."""
        gran = "block" if self.fp8.block else "channel"
        with torch.no_grad():
            for attr, w in full.items():
                for e in range(w.shape[0]):
                    q, s = quantize_fp8(w[e], gran, self.fp8.block or (128, 128))
                    getattr(self, attr)[e].copy_(q)
                    getattr(self, f"{attr}_scale")[e].copy_(s)

    def _scales(self) -> dict:
        if self.fp8 is None:
            return {}
        return {"scales": (self.gate_up_proj_scale, self.down_proj_scale), "block": self.fp8.block}

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return fused_experts(x, self.gate_up_proj, self.down_proj, weights, ids, **self._scales())

    def forward_routed(self, x: torch.Tensor, logits: torch.Tensor, top_k: int, renormalize: bool,
                       pdl: bool = False) -> torch.Tensor:
        """The experts of ``route(logits, top_k, renormalize)``'s choice, the routing done
        inside the gate/up kernel (``moe_ops.experts_gemv``: a few CUDA tokens; ``pdl``: its)."""
        return experts_gemv(x, self.gate_up_proj, self.down_proj, logits=logits, top_k=top_k,
                            renormalize=renormalize, pdl=pdl, **self._scales())


def routed_in_kernel(x: torch.Tensor, kernels: KernelChoice) -> bool:
    """Whether ``SparseMoE`` routes inside the experts' GEMV kernels (``experts_gemv``): up to
    ``GEMV_MAX_TOKENS`` CUDA tokens (decode at batch 1), with the one-row fusions on."""
    return kernels.fuse_one_row and x.is_cuda and x.shape[0] <= GEMV_MAX_TOKENS


class SparseMoE(nn.Module):
    """Router, experts and (if ``moe.shared_intermediate_size``) the gated shared expert.

    Under tensor parallelism each shard holds every expert's slice of the intermediate
    columns (and the shared expert's): its output is a partial sum like a dense MLP's; the
    router and the shared expert's gate are replicated, so every shard routes alike."""

    def __init__(self, hidden: int, moe: MoEConfig, *, kernels: KernelChoice = ALL_KERNELS):
        super().__init__()
        self.top_k = moe.top_k
        self.renormalize = moe.renormalize
        self.kernels = kernels
        self.gate = nn.Linear(hidden, moe.num_experts, bias=False)
        self.experts = Experts(moe.num_experts, hidden, moe.intermediate_size)
        self.shared_expert = None
        if moe.shared_intermediate_size:
            self.shared_expert = GatedMLP(hidden, moe.shared_intermediate_size, kernels=kernels)
            self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)

    def forward_add_norm(self, x: torch.Tensor, residual: torch.Tensor,
                         norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(self(norm(residual + x)), residual + x)`` for one token routed in the experts'
        kernel (``routed_in_kernel``): the add, the norm and the router's GEMV in one kernel
        (``moe_ops.add_rmsnorm_router``), then the two expert kernels; None otherwise (the
        caller adds, normalises and calls ``forward``)."""
        if not (routed_in_kernel(x, self.kernels) and isinstance(self.gate, nn.Linear) and x.dim() == 2
                and x.shape[0] == 1 and x.is_contiguous() and residual.is_contiguous()
                and self.gate.weight.stride(1) == 1 and self.gate.bias is None):
            return None
        h, residual, logits = add_rmsnorm_router(x, residual, norm.weight, norm.eps, self.gate.weight,
                                                 pdl=self.kernels.pdl)
        return self._experts_of(h, logits), residual

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._experts_of(x, linear(x, self.gate, self.kernels))

    def _experts_of(self, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        if routed_in_kernel(x, self.kernels):  # (router's softmax and top-k in the experts' kernel)
            y = self.experts.forward_routed(x, logits, self.top_k, self.renormalize, self.kernels.pdl)
        else:
            y = self.experts(x, *route(logits, self.top_k, self.renormalize))
        if self.shared_expert is not None:
            y = y + torch.sigmoid(linear(x, self.shared_expert_gate, self.kernels)) * self.shared_expert(x)
        return y
