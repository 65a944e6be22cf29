"""Dense families beyond Llama/Qwen (OLMo 2, Granite 3, Phi-3 / Phi-4 with longrope, Gemma 2
and Gemma 3 with sliding-window layers and soft-capping, Mistral / Ministral / Qwen2 with windows): greedy tokens equal transformers'
(fp32, CPU, the torch backend; the triton one in test_window_attention) under batching, mid-flight arrivals with small chunked prefill, cache hits and
preemption; what a family's config asks for that radixd lacks is refused at load, naming
the field."""

from __future__ import annotations

import json

import pytest
from conftest import DENSE_ARCHS
from test_engine import (
    check_greedy_matches_transformers,
    check_mid_flight_small_chunks,
    check_preemption_keeps_tokens,
    check_prefix_served_from_cache,
    collect,
    make_engine,
    prompts,
)

from radixd.core.models.config import ModelConfig


@pytest.mark.parametrize("arch", DENSE_ARCHS)
async def test_greedy_matches_transformers(tiny_dense_models, arch):
    await check_greedy_matches_transformers(tiny_dense_models[arch])


@pytest.mark.parametrize("arch", DENSE_ARCHS)
async def test_mid_flight_arrivals_and_small_chunks(tiny_dense_models, arch):
    await check_mid_flight_small_chunks(tiny_dense_models[arch], [16, 8, 8], min_steps=15)


@pytest.mark.parametrize("arch", DENSE_ARCHS)
async def test_prefix_served_from_cache(tiny_dense_models, arch):
    await check_prefix_served_from_cache(tiny_dense_models[arch])


@pytest.mark.parametrize("arch", DENSE_ARCHS)
async def test_preemption_keeps_tokens(tiny_dense_models, arch):
    await check_preemption_keeps_tokens(tiny_dense_models[arch], radix=True)


@pytest.mark.parametrize("arch", ["granite", "mistral-swa"])
async def test_tp2_gives_the_tp1_tokens(tiny_dense_models, arch):
    """Granite's folded residual multiplier and scalings, Mistral's windows, hold on each shard."""
    path = tiny_dense_models[arch]
    p = prompts(1, 20, seed=4)[0]
    runs = []
    for tp in (1, 2):
        eng = make_engine(path, tp_size=tp)
        try:
            runs.append(await collect(eng, p, 8))
        finally:
            await eng.stop()
    assert runs[0] == runs[1]


@pytest.mark.parametrize("arch, over, field", [
    ("olmo2", {"mlp_bias": True}, "'mlp_bias' = True"),
    ("granite", {"attention_bias": True}, "'attention_bias' = True"),
    ("gemma2", {"hidden_activation": "gelu"}, "'hidden_activation' = 'gelu'"),
    ("gemma3", {"layer_types": ["chunked_attention"] * 3}, "'layer_types' = 'chunked_attention'"),
    ("gemma3", {"use_bidirectional_attention": True}, "'use_bidirectional_attention' = True"),
    ("gemma3", {"rope_parameters": {"sliding_attention": {"rope_type": "yarn", "rope_theta": 1e4},
                                    "full_attention": {"rope_type": "default", "rope_theta": 1e6}}},
     "'rope_parameters.sliding_attention.rope_type' = 'yarn'"),
])
def test_refused_configs(tiny_dense_models, arch, over, field):
    hf = json.loads((tiny_dense_models[arch] / "config.json").read_text())
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        ModelConfig.from_hf({**hf, **over})


def test_window_configs(tiny_dense_models):
    """Windows on the sliding layers only; the context is the global layers' (no cap); a
    window as wide as the context is none."""
    cfg = ModelConfig.from_hf(json.loads((tiny_dense_models["gemma3"] / "config.json").read_text()))
    assert cfg.layer_windows == (8, 8, 0) and cfg.context_len == 512
    assert (cfg.local_rope_theta, cfg.rope_theta, cfg.rope_scaling["factor"]) == (1e4, 1e6, 2.0)
    assert cfg.attention_scale == 16**-0.5 and cfg.tie_word_embeddings
    hf = json.loads((tiny_dense_models["ministral"] / "config.json").read_text())
    assert ModelConfig.from_hf(hf).layer_windows == (8, 0)
    assert ModelConfig.from_hf({**hf, "sliding_window": 512}).layer_windows == ()
    assert ModelConfig.from_hf({**hf, "layer_types": None}).layer_windows == (8, 8)
    hf = json.loads((tiny_dense_models["qwen2-swa"] / "config.json").read_text())
    assert ModelConfig.from_hf({**hf, "layer_types": None}).layer_windows == (0, 8)
    assert ModelConfig.from_hf({**hf, "use_sliding_window": False}).layer_windows == ()


@pytest.mark.parametrize("arch", ["olmo2", "gemma2"])
async def test_refuses_tensor_parallel(tiny_dense_models, arch):
    with pytest.raises(ValueError, match="ForCausalLM.*tensor parallel"):
        make_engine(tiny_dense_models[arch], tp_size=2)
