"""Qwen3: the Llama block with per-head RMSNorm on q and k before rotary (no QKV bias)."""

from radixd.core.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
