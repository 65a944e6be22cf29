"""Gemma 2 and Gemma 3 (text): a norm before and after each block, GeGLU MLPs, embeddings
scaled by sqrt(hidden), and attention that alternates sliding-window and global layers:

    embed * sqrt(H) -> [ h = x + post(attn(pre(x))) ; h + post(mlp(pre(h))) ] x L
      -> norm -> lm_head -> cap * tanh(logits / cap)

* Scores: q.k * query_pre_attn_scalar ** -0.5, soft-capped by ``attn_logit_softcapping``
  (Gemma 2) before the mask; a sliding layer's query sees the ``sliding_window`` newest keys
  (itself included). Both are the attention backend's per-layer parameters
  (``ModelConfig.layer_windows``, ``attn_softcap``).
* Gemma 3: per-head q/k norms; its sliding layers rotate by their own base
  (``rope_local_base_freq``), its global ones by ``rope_theta`` with its scaling.
* Norms scale by (1 + w): the checkpoint's w plus one is stored on load, so radixd's RMSNorm
  (and its fused kernels) serve them as they are.

The KV of every layer stays allocated for the whole sequence: a sliding layer reads only its
window, but keys that fell out of every window are not freed, nor does the radix cache know
about windows (it serves a prefix's KV as for a global model).
Tensor parallelism is refused (the post-norms would need each block's sum first).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from radixd.core.models.config import ModelConfig
from radixd.core.models.layers import DecoderLayer, GatedMLP, RMSNorm, Rotary
from radixd.core.models.llama import LlamaForCausalLM
from radixd.core.triton_ops import KernelChoice


class GemmaForCausalLM(LlamaForCausalLM):
    tensor_parallel = False

    def make_layer(self, cfg: ModelConfig, layer: int) -> nn.Module:
        return GemmaDecoderLayer(cfg, layer, qk_norm=cfg.architecture == "Gemma3ForCausalLM", kernels=self.kernels)

    def make_rotary(self, cfg: ModelConfig) -> nn.Module:
        return LayerRotaries(cfg)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        # (the multiplier rounded to the weights' dtype first, as the checkpoints were trained)
        return x * torch.tensor(self.cfg.embedding_multiplier, dtype=x.dtype)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        logits = super().logits(x)
        cap = self.cfg.final_softcap
        return torch.tanh(logits / cap) * cap if cap else logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *, head: bool = True) -> None:
        super().load_weights(weights, head=head)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight"):
                    p.add_(1.0)


class LayerRotaries(nn.Module):
    """The global layers' rotary embedding and the sliding layers' (Gemma 3's local base)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.full = Rotary(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        self.sliding = self.full if cfg.local_rope_theta is None else Rotary(
            cfg.head_dim, cfg.max_position_embeddings, cfg.local_rope_theta, None)


class GemmaDecoderLayer(DecoderLayer):
    def __init__(self, cfg: ModelConfig, layer: int, *, qk_norm: bool, kernels: KernelChoice):
        mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, kernels=kernels, act=cfg.hidden_act)
        super().__init__(cfg, layer, qk_norm=qk_norm, kernels=kernels, mlp=mlp)
        self.sliding = bool(cfg.layer_windows[layer])
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, residual, positions, rotary: LayerRotaries, attn):
        """``DecoderLayer``'s contract; ``post_attention_layernorm`` is the attention block's
        post-norm here (``pre_feedforward_layernorm`` the MLP's pre-norm)."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.add_norm(x, residual, self.input_layernorm)
        h = self.self_attn(h, positions, rotary.sliding if self.sliding else rotary.full, attn)
        h, residual = self.add_norm(self.post_attention_layernorm(h), residual, self.pre_feedforward_layernorm)
        return self.post_feedforward_layernorm(self.mlp(h)), residual
