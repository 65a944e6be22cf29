"""Phi-3 and Phi-4 (Microsoft): the Llama block, with checkpoints that already fuse q/k/v
(``qkv_proj``: [q | k | v] rows) and gate/up (``gate_up_proj``: [gate | up]) in radixd's
layout, so each loads whole. Long-context checkpoints scale rope by ``longrope`` (``rope``)."""

from radixd.core.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    pass
