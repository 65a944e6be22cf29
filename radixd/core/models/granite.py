"""Granite 3 (IBM): Llama's blocks with four scalings from the config (``ModelConfig``'s
``attention_multiplier`` and the rest):

    embed * embedding_multiplier -> [ x + rm * attn(norm(x)) ; h + rm * mlp(norm(h)) ] x L
      -> norm -> lm_head / logits_scaling

with softmax(q.k * attention_multiplier) in attention (the backend's scale) and rm the
``residual_multiplier``, folded into o_proj and down_proj on load: a block's output is linear
in their weights, so scaling them scales it, at no cost per step (and a shard of them under
tensor parallelism is scaled alike).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from radixd.core.models.llama import LlamaForCausalLM


class GraniteForCausalLM(LlamaForCausalLM):
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.cfg.embedding_multiplier

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return super().logits(x) / self.cfg.logits_scaling

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *, head: bool = True) -> None:
        super().load_weights(weights, head=head)
        with torch.no_grad():
            for layer in self.layers:
                layer.self_attn.o_proj.weight.mul_(self.cfg.residual_multiplier)
                layer.mlp.down_proj.weight.mul_(self.cfg.residual_multiplier)
