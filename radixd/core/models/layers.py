"""Building blocks shared by the model files: norm, rotary embedding, gated MLP, attention."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from radixd.core import cpu_kernels
from radixd.core.attention import AttentionBackend
from radixd.core.models.rope import rope_tables
from radixd.core.triton_ops import (
    ALL_KERNELS,
    KernelChoice,
    add_rmsnorm,
    gate_up_silu,
    linear,
    silu_mul,
)


class RMSNorm(nn.Module):
    """``pdl``: its CUDA kernel launched for programmatic dependent launch
    (``KernelChoice.pdl``)."""

    def __init__(self, dim: int, eps: float, *, pdl: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.pdl = pdl

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return add_rmsnorm(x, self.weight, self.eps, pdl=self.pdl)[0]

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``residual += x`` (in place), then normalise it: one fused kernel on CUDA."""
        return add_rmsnorm(x, self.weight, self.eps, residual, pdl=self.pdl)


class Rotary(nn.Module):
    """Neox-style rotary embedding (rotate halves), as Hugging Face Llama/Qwen checkpoints use;
    its tables (``rope.rope_tables``) carry the rope scaling."""

    def __init__(self, head_dim: int, max_pos: int, theta: float, scaling: dict | None):
        super().__init__()
        cos, sin = rope_tables(head_dim, max_pos, theta, scaling)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if (q.device.type == "cpu" and positions.dtype == torch.int64 and 2 * self.cos.shape[-1] == q.shape[-1]
                and q.stride(1) == q.shape[-1] and k.stride(1) == k.shape[-1] and cpu_kernels.rows_take(q, k)):
            return (cpu_kernels.rotary(q, self.cos, self.sin, positions),
                    cpu_kernels.rotary(k, self.cos, self.sin, positions))
        cos = self.cos[positions][:, None, :]
        sin = self.sin[positions][:, None, :]
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(dtype)


class GatedMLP(nn.Module):
    """act(gate) * up -> down, with gate and up fused into one matmul: SiLU (SwiGLU, one
    fused kernel on CUDA) or ``gelu_pytorch_tanh`` (Gemma's GeGLU)."""

    def __init__(self, hidden: int, inter: int, *, kernels: KernelChoice = ALL_KERNELS, act: str = "silu"):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.kernels = kernels
        self.gelu = act == "gelu_pytorch_tanh"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gelu:
            gate, up = linear(x, self.gate_up_proj, self.kernels).chunk(2, dim=-1)
            h = F.gelu(gate, approximate="tanh") * up
        elif not x.is_cuda and (down := getattr(self.down_proj, "forward_of_silu", None)) is not None:
            # (CPU: SiLU(gate) * up formed inside the down projection's int kernel, where it has one)
            gate_up = linear(x, self.gate_up_proj, self.kernels)
            y = down(gate_up)
            return y if y is not None else linear(silu_mul(gate_up), self.down_proj, self.kernels)
        else:
            h = gate_up_silu(x, self.gate_up_proj, self.kernels)
        return linear(h, self.down_proj, self.kernels)


class Attention(nn.Module):
    """Multi-head attention with GQA, fused QKV, optional QKV bias and per-head q/k norm."""

    def __init__(self, cfg, layer: int, *, qkv_bias: bool, qk_norm: bool, kernels: KernelChoice = ALL_KERNELS):
        super().__init__()
        self.layer = layer
        self.kernels = kernels
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        self.split = (q_size, kv_size, kv_size)
        self.qkv_proj = nn.Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=qkv_bias)
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if qk_norm else None

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rotary: Rotary, attn: AttentionBackend) -> torch.Tensor:
        # The backend may project, rotate and store in one kernel (not with q/k norms between).
        o = attn.project_forward(x, self.qkv_proj, self.layer, positions, rotary) if self.q_norm is None else None
        if o is None:
            o = self._project_attend(x, positions, rotary, attn)
        return linear(o.reshape(-1, self.num_heads * self.head_dim), self.o_proj, self.kernels)

    def _project_attend(self, x, positions, rotary, attn) -> torch.Tensor:
        q, k, v = linear(x, self.qkv_proj, self.kernels).split(self.split, dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            fused = getattr(attn, "forward_qk_norm", None) if self.kernels.fuse_one_row else None
            if fused is not None:  # (the norms in the backend's rotary kernel)
                return fused(q, k, v, self.layer, positions, rotary,
                             (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps))
            q, k = self.q_norm(q), self.k_norm(k)
        return attn.forward(q, k, v, self.layer, positions, rotary)


class DecoderLayer(nn.Module):
    def __init__(self, cfg, layer: int, *, qkv_bias: bool = False, qk_norm: bool = False,
                 kernels: KernelChoice = ALL_KERNELS, mlp: nn.Module | None = None):
        """``mlp``: the block's MLP (a mixture of experts), else a dense ``GatedMLP``."""
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, pdl=kernels.pdl)
        self.self_attn = Attention(cfg, layer, qkv_bias=qkv_bias, qk_norm=qk_norm, kernels=kernels)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, pdl=kernels.pdl)
        self.mlp = mlp if mlp is not None else GatedMLP(cfg.hidden_size, cfg.intermediate_size, kernels=kernels)
        # Tensor parallel: sums the shards' partial o_proj / down_proj outputs before the add
        # and norm that follow each (``all_reduce.add_norm``, fused where it can be).
        self.all_reduce = None

    def forward(self, x, residual, positions, rotary, attn):
        """Pre-norm block with the residual carried separately (so each norm fuses the add):
        returns the block's output and the running residual stream. Under tensor
        parallelism the output is this shard's partial sum: the next ``add_norm`` (the next
        layer's, or the model's final norm) completes it."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.add_norm(x, residual, self.input_layernorm)
        h = self.self_attn(h, positions, rotary, attn)
        fused = getattr(self.mlp, "forward_add_norm", None) if self.all_reduce is None else None
        out = fused(h, residual, self.post_attention_layernorm) if fused is not None else None
        if out is not None:  # (the MLP's own add and norm: a mixture of experts' with its router)
            return out
        h, residual = self.add_norm(h, residual, self.post_attention_layernorm)
        return self.mlp(h), residual

    def add_norm(self, x, residual, norm: RMSNorm):
        """``residual += x; return norm(residual), residual``, with ``x`` summed over the
        shards first under tensor parallelism."""
        if self.all_reduce is None:
            return norm.forward_add(x, residual)
        return self.all_reduce.add_norm(x, residual, norm)
