"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (q/k norms, no QKV bias);
each layer's MLP a sparse block of ``num_experts`` experts, ``num_experts_per_tok`` per token
(softmax, top-k, renormalised when ``norm_topk_prob``), no shared expert; the layers in
``mlp_only_layers`` or off ``decoder_sparse_step`` keep a dense MLP."""

from torch import nn

from radixd.core.models.config import ModelConfig
from radixd.core.models.moe import moe_mlp
from radixd.core.models.qwen3 import Qwen3ForCausalLM


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    def make_mlp(self, cfg: ModelConfig, layer: int) -> nn.Module | None:
        return moe_mlp(cfg, layer, self.kernels)
