"""Llama family: Llama 2/3 (incl. llama3 rope scaling), SmolLM2, Mistral-style GQA.

    embed -> [ x + attn(norm(x)) ; h + mlp(norm(h)) ] x L -> norm -> lm_head (maybe tied)

Checkpoint names follow Hugging Face; q/k/v and gate/up are fused on load.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from radixd.core.attention import AttentionBackend
from radixd.core.models.config import ModelConfig
from radixd.core.models.layers import DecoderLayer, RMSNorm, Rotary
from radixd.core.triton_ops import ALL_KERNELS, KernelChoice, linear

# checkpoint suffix -> (fused parameter suffix, shard index)
FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class LlamaForCausalLM(nn.Module):
    qkv_bias = False
    qk_norm = False

    def __init__(self, cfg: ModelConfig, *, kernels: KernelChoice = ALL_KERNELS):
        super().__init__()
        self.cfg = cfg
        self.kernels = kernels
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        bias = self.qkv_bias or cfg.attention_bias
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, qkv_bias=bias, qk_norm=self.qk_norm, kernels=kernels) for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = Rotary(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionBackend,
        logits_indices: torch.Tensor,
        hidden_indices: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor | None, torch.Tensor]:
        """Logits (float32) at ``logits_indices`` of the flat token axis; with
        ``hidden_indices`` (embeddings) also the final hidden states there, after the last norm:
        ``(logits or None when there are none, hidden)``."""
        x = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, positions, self.rotary, attn)
        idx = logits_indices if hidden_indices is None else torch.cat((logits_indices, hidden_indices))
        x, _ = self.layers[-1].add_norm(x[idx], residual[idx], self.norm)
        if hidden_indices is None:
            return linear(x, self.lm_head, self.kernels).float()
        n = logits_indices.numel()
        return (linear(x[:n], self.lm_head, self.kernels).float() if n else None), x[n:]

    # ------------------------------------------------------------------ weights

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *, head: bool = True) -> None:
        """Copy Hugging Face-named tensors into the fused parameters; every parameter must
        be covered (a missing tensor is an error, not random weights), but for an untied LM
        head with ``head`` False (an embedding engine never reads it: zeros)."""
        params = dict(self.named_parameters())
        sizes = self._fused_sizes()
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and self.cfg.tie_word_embeddings:
                continue
            target, shard = name, None
            for ckpt, (fused, idx) in FUSED.items():
                if f".{ckpt}." in name:
                    target, shard = name.replace(ckpt, fused), idx
                    break
            param = params.get(target)
            if param is None:
                raise KeyError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
            with torch.no_grad():
                if shard is None:
                    _copy(param, tensor, name)
                else:
                    kind = target.rsplit(".", 2)[-2]
                    start = sum(sizes[kind][:shard])
                    _copy(param.narrow(0, start, sizes[kind][shard]), tensor, name)
            loaded.add(target if shard is None else f"{target}#{shard}")
        missing = []
        for pname in params:
            if pname == "lm_head.weight" and self.cfg.tie_word_embeddings:
                continue
            kind = pname.rsplit(".", 2)[-2] if "." in pname else ""
            if kind in sizes:
                missing += [f"{pname}#{i}" for i in range(len(sizes[kind])) if f"{pname}#{i}" not in loaded]
            elif pname not in loaded:
                missing.append(pname)
        if not head and "lm_head.weight" in missing:
            missing.remove("lm_head.weight")
            with torch.no_grad():
                self.lm_head.weight.zero_()
        if missing:
            raise KeyError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")

    def _fused_sizes(self) -> dict[str, list[int]]:
        c = self.cfg
        kv = c.num_kv_heads * c.head_dim
        return {"qkv_proj": [c.num_heads * c.head_dim, kv, kv], "gate_up_proj": [c.intermediate_size] * 2}


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"tensor {name!r}: checkpoint shape {tuple(src.shape)} != model shape {tuple(dst.shape)}")
    dst.copy_(src)
