"""OLMo 2 (AI2): norms after each block instead of before, and q/k norms over the whole q and
k projections (not per head):

    embed -> [ h = x + norm(attn(x)) ; h + norm(mlp(h)) ] x L -> norm -> lm_head

with attention's q = norm(q_proj(x)), k = norm(k_proj(x)) before rotary. Tensor parallelism
is refused: a q/k norm over the whole projection would need every shard's heads.
"""

from __future__ import annotations

import torch
from torch import nn

from radixd.core.models.config import ModelConfig
from radixd.core.models.layers import Attention, GatedMLP, RMSNorm
from radixd.core.models.llama import LlamaForCausalLM
from radixd.core.triton_ops import KernelChoice


class Olmo2ForCausalLM(LlamaForCausalLM):
    tensor_parallel = False

    def make_layer(self, cfg: ModelConfig, layer: int) -> nn.Module:
        return Olmo2DecoderLayer(cfg, layer, self.kernels)


class Olmo2DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, kernels: KernelChoice):
        super().__init__()
        self.self_attn = Attention(cfg, layer, qkv_bias=False, qk_norm=False, kernels=kernels)
        self.self_attn.q_norm = ProjectionNorm(cfg.num_heads * cfg.head_dim, cfg.rms_norm_eps)
        self.self_attn.k_norm = ProjectionNorm(cfg.num_kv_heads * cfg.head_dim, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, kernels=kernels)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, residual, positions, rotary, attn):
        """``DecoderLayer``'s contract: the stream is ``x + residual``; this block's output
        (normed) comes back as ``x``, the stream it joins as ``residual``."""
        stream = x if residual is None else x + residual
        stream = stream + self.post_attention_layernorm(self.self_attn(stream, positions, rotary, attn))
        return self.post_feedforward_layernorm(self.mlp(stream)), stream

    def add_norm(self, x, residual, norm: RMSNorm):
        return norm.forward_add(x, residual)


class ProjectionNorm(RMSNorm):
    """RMSNorm of [T, heads, head_dim] over all heads of a token together."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.flatten(-2)).view_as(x)
