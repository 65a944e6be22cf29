"""Qwen2 / Qwen2.5: the Llama block with a bias on the fused QKV projection."""

from radixd.core.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True
