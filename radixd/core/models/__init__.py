"""Model registry: Hugging Face architecture name -> radixd's own implementation."""

from __future__ import annotations

import importlib

from torch import nn

from radixd.core.models.config import ModelConfig

ARCHITECTURES = {
    "LlamaForCausalLM": "radixd.core.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "radixd.core.models.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "radixd.core.models.qwen2:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "radixd.core.models.qwen3:Qwen3ForCausalLM",
}


def model_class(cfg: ModelConfig) -> type[nn.Module]:
    path = ARCHITECTURES.get(cfg.architecture)
    if path is None:
        raise ValueError(
            f"architecture {cfg.architecture!r} is not supported; supported: {', '.join(ARCHITECTURES)}"
        )
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)
