"""Mixtral (8x7B, 8x22B): Mistral's attention; every layer's MLP a sparse block of
``num_local_experts`` experts, ``num_experts_per_tok`` per token, weighted by a softmax over
the chosen experts' logits. Checkpoint names: ``block_sparse_moe`` for the block and
``w1`` / ``w3`` / ``w2`` for an expert's gate / up / down projections."""

from torch import nn

from radixd.core.models.config import ModelConfig
from radixd.core.models.llama import LlamaForCausalLM
from radixd.core.models.moe import moe_mlp


class MixtralForCausalLM(LlamaForCausalLM):
    checkpoint_renames = (
        (r"\.block_sparse_moe\.", ".mlp."),
        (r"(\.experts\.\d+)\.w1\.", r"\1.gate_proj."),
        (r"(\.experts\.\d+)\.w3\.", r"\1.up_proj."),
        (r"(\.experts\.\d+)\.w2\.", r"\1.down_proj."),
    )

    def make_mlp(self, cfg: ModelConfig, layer: int) -> nn.Module | None:
        return moe_mlp(cfg, layer, self.kernels)
