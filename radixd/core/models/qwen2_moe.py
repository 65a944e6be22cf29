"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's attention (a QKV bias unless the
config's ``qkv_bias`` is false); each layer's MLP a sparse block (softmax, top-k,
renormalised when ``norm_topk_prob``) plus a shared expert every token goes through, scaled
by ``sigmoid(shared_expert_gate(x))``; the layers in ``mlp_only_layers`` or off
``decoder_sparse_step`` keep a dense MLP."""

from torch import nn

from radixd.core.models.config import ModelConfig
from radixd.core.models.llama import LlamaForCausalLM
from radixd.core.models.moe import moe_mlp


class Qwen2MoeForCausalLM(LlamaForCausalLM):
    def make_mlp(self, cfg: ModelConfig, layer: int) -> nn.Module | None:
        return moe_mlp(cfg, layer, self.kernels)
