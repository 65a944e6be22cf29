"""Model registry: Hugging Face architecture name -> radixd's own implementation."""

from __future__ import annotations

import importlib

from torch import nn

from radixd.core.models.config import ModelConfig

ARCHITECTURES = {
    "Gemma2ForCausalLM": "radixd.core.models.gemma:GemmaForCausalLM",
    "Gemma3ForCausalLM": "radixd.core.models.gemma:GemmaForCausalLM",
    "GraniteForCausalLM": "radixd.core.models.granite:GraniteForCausalLM",
    "LlamaForCausalLM": "radixd.core.models.llama:LlamaForCausalLM",
    "MinistralForCausalLM": "radixd.core.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "radixd.core.models.llama:LlamaForCausalLM",
    "MixtralForCausalLM": "radixd.core.models.mixtral:MixtralForCausalLM",
    "Olmo2ForCausalLM": "radixd.core.models.olmo2:Olmo2ForCausalLM",
    "Phi3ForCausalLM": "radixd.core.models.phi3:Phi3ForCausalLM",
    "Qwen2ForCausalLM": "radixd.core.models.qwen2:Qwen2ForCausalLM",
    "Qwen2MoeForCausalLM": "radixd.core.models.qwen2_moe:Qwen2MoeForCausalLM",
    "Qwen3ForCausalLM": "radixd.core.models.qwen3:Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM": "radixd.core.models.qwen3_moe:Qwen3MoeForCausalLM",
}


def model_class(cfg: ModelConfig) -> type[nn.Module]:
    path = ARCHITECTURES.get(cfg.architecture)
    if path is None:
        raise ValueError(
            f"architecture {cfg.architecture!r} is not supported; supported: {', '.join(ARCHITECTURES)}"
        )
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)
