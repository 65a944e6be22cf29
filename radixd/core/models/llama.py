"""Llama family: Llama 2/3 (incl. llama3 rope scaling), SmolLM2, Mistral-style GQA.

    embed -> [ x + attn(norm(x)) ; h + mlp(norm(h)) ] x L -> norm -> lm_head (maybe tied)

Checkpoint names follow Hugging Face; q/k/v and gate/up are fused on load (``weights``).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from radixd.core import cpu_decode
from radixd.core.attention import AttentionBackend
from radixd.core.models.config import ModelConfig
from radixd.core.models.layers import DecoderLayer, RMSNorm, Rotary
from radixd.core.models.weights import load_hf_weights
from radixd.core.triton_ops import ALL_KERNELS, KernelChoice, linear


class LlamaForCausalLM(nn.Module):
    qkv_bias = False
    qk_norm = False
    checkpoint_renames: tuple[tuple[str, str], ...] = ()  # (regex, replacement) on checkpoint names
    tensor_parallel = True  # False: a family whose layers cannot be split by heads and columns

    def __init__(self, cfg: ModelConfig, *, kernels: KernelChoice = ALL_KERNELS):
        super().__init__()
        self.cfg = cfg
        self.kernels = kernels
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(self.make_layer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, pdl=kernels.pdl)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = self.make_rotary(cfg)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionBackend,
        logits_indices: torch.Tensor,
        hidden_indices: torch.Tensor | None = None,
        aux_layers: tuple[int, ...] = (),
    ) -> torch.Tensor | tuple[torch.Tensor | None, torch.Tensor]:
        """Logits (float32) at ``logits_indices`` of the flat token axis; with
        ``hidden_indices`` (embeddings) also the final hidden states there, after the last norm:
        ``(logits or None when there are none, hidden)``; with ``aux_layers`` (an EAGLE-3
        drafter's, ascending; not with ``hidden_indices``) also the residual stream after each
        of those layers at every token, side by side: ``(logits, [T, len(aux_layers) * hidden])``."""
        x = self.embed(input_ids)
        residual = None
        if aux_layers:
            x, residual, aux = self.run_layers_reading(x, positions, attn, aux_layers)
            x, _ = self.layers[-1].add_norm(x[logits_indices], residual[logits_indices], self.norm)
            return self.logits(x), aux
        fused = cpu_decode.runner(self, attn, x) if x.device.type == "cpu" else None
        if fused is not None:  # a CPU decode step: all layers in one C call
            x, residual = fused(x, positions)
        else:
            for layer in self.layers:
                x, residual = layer(x, residual, positions, self.rotary, attn)
        idx = logits_indices if hidden_indices is None else torch.cat((logits_indices, hidden_indices))
        x, _ = self.layers[-1].add_norm(x[idx], residual[idx], self.norm)
        if hidden_indices is None:
            return self.logits(x)
        n = logits_indices.numel()
        return (self.logits(x[:n]) if n else None), x[n:]

    def run_layers_reading(self, x: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend,
                           layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The decoder layers over the embeddings ``x``, reading the residual stream after
        ``layers``: ``(x, residual, [T, len(layers) * hidden])`` (the stream is ``x + residual``,
        every layer's contract; the plain forward's loop, apart so that it checks nothing)."""
        residual = None
        read = []
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, positions, self.rotary, attn)
            if i in layers:
                read.append(x + residual)
        return x, residual, torch.cat(read, dim=-1)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The residual stream's start (families that scale their embeddings override this)."""
        return self.embed_tokens(input_ids)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """float32 logits of final hidden states (families that scale or cap them override this)."""
        return linear(x, self.lm_head, self.kernels).float()

    def make_rotary(self, cfg: ModelConfig) -> nn.Module:
        """The rotary embedding the layers are given (float32 tables, rebuilt after loading)."""
        return Rotary(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)

    def make_layer(self, cfg: ModelConfig, layer: int) -> nn.Module:
        """Decoder layer ``layer``: ``forward(x, residual, positions, rotary, attn) -> (x,
        residual)`` with the stream carried as their sum, and ``add_norm`` (``DecoderLayer``'s
        contract; families with other norm placements override this)."""
        return DecoderLayer(cfg, layer, qkv_bias=self.qkv_bias or cfg.attention_bias, qk_norm=self.qk_norm,
                            kernels=self.kernels, mlp=self.make_mlp(cfg, layer))

    def make_mlp(self, cfg: ModelConfig, layer: int) -> nn.Module | None:
        """Layer ``layer``'s MLP; None: the dense ``GatedMLP`` (mixture-of-experts families
        override this)."""
        return None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *, head: bool = True) -> None:
        """Copy Hugging Face-named tensors into the fused parameters; every parameter must
        be covered (a missing tensor is an error, not random weights), but for an untied LM
        head with ``head`` False (an embedding engine never reads it: zeros)."""
        c = self.cfg
        kv = c.num_kv_heads * c.head_dim
        load_hf_weights(self, weights, qkv_sizes=[c.num_heads * c.head_dim, kv, kv], renames=self.checkpoint_renames,
                        head=head)
