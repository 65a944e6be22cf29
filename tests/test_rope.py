"""Rope scalings: radixd's rotary tables against transformers' rotary embedding for the same
config (each position's cos and sin, the attention factor folded in), and a yarn model's
greedy tokens; types radixd lacks refused at load, naming the field."""

from __future__ import annotations

import asyncio

import pytest
import torch
from conftest import make_tiny_checkpoint
from test_engine import assert_greedy_matches, assert_idle, collect, make_engine, prompts

from radixd.core.models.config import ModelConfig
from radixd.core.models.layers import Rotary

HEAD_DIM, THETA = 32, 10000.0
HALF = HEAD_DIM // 2
LONG = [1.0 + 0.5 * i for i in range(HALF)]
SHORT = [1.0 + 0.05 * i for i in range(HALF)]


def hf_tables(config_cls, rotary_cls, positions: int, **cfg) -> tuple[torch.Tensor, torch.Tensor]:
    c = config_cls(hidden_size=4 * HEAD_DIM, num_attention_heads=4, head_dim=HEAD_DIM, **cfg)
    rot = rotary_cls(c)
    x = torch.zeros(1, positions, HEAD_DIM)
    cos, sin = rot(x, torch.arange(positions)[None])
    return cos[0, :, :HALF], sin[0, :, :HALF]


def radixd_tables(hf_cfg: dict) -> tuple[ModelConfig, Rotary]:
    cfg = ModelConfig.from_hf(dict(hidden_size=4 * HEAD_DIM, num_attention_heads=4, head_dim=HEAD_DIM,
                                   num_hidden_layers=1, intermediate_size=8, vocab_size=8, **hf_cfg))
    return cfg, Rotary(HEAD_DIM, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)


def assert_tables_match(rot: Rotary, want: tuple[torch.Tensor, torch.Tensor]):
    n = want[0].shape[0]
    torch.testing.assert_close(rot.cos[:n], want[0], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(rot.sin[:n], want[1], atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("params", [
    dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64),
    dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=64, beta_fast=16, beta_slow=2,
         mscale=1.0, mscale_all_dim=0.5),
    dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64, attention_factor=1.3, truncate=False),
])
def test_yarn_matches_transformers(params):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rope = dict(params, rope_theta=THETA)
    want = hf_tables(LlamaConfig, LlamaRotaryEmbedding, 256, max_position_embeddings=256, rope_parameters=rope)
    cfg, rot = radixd_tables(dict(max_position_embeddings=256, rope_parameters=rope))
    assert_tables_match(rot, want)
    assert cfg.context_len == 256


def test_dynamic_matches_transformers_at_the_served_length():
    """radixd serves ``factor`` x the context with the base transformers takes at that length."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rope = dict(rope_type="dynamic", factor=3.0, rope_theta=THETA)
    want = hf_tables(LlamaConfig, LlamaRotaryEmbedding, 192, max_position_embeddings=64, rope_parameters=rope)
    cfg, rot = radixd_tables(dict(max_position_embeddings=64, rope_parameters=rope))
    assert cfg.context_len == 192 and rot.cos.shape[0] == 192
    assert_tables_match(rot, want)


@pytest.mark.parametrize("max_pos", [256, 64])  # past the original context (long factors), within it (short)
def test_longrope_matches_transformers(max_pos):
    """Phi-3's layout: ``rope_scaling`` with the factors, ``original_max_position_embeddings``
    at the top level."""
    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    rope = dict(rope_type="longrope", long_factor=LONG, short_factor=SHORT, rope_theta=THETA)
    want = hf_tables(Phi3Config, Phi3RotaryEmbedding, max_pos, max_position_embeddings=max_pos,
                     original_max_position_embeddings=64, rope_parameters=rope)
    _, rot = radixd_tables(dict(max_position_embeddings=max_pos, original_max_position_embeddings=64,
                                rope_scaling=dict(type="longrope", long_factor=LONG, short_factor=SHORT),
                                rope_theta=THETA))
    assert_tables_match(rot, want)
    if max_pos > 64:
        assert not torch.allclose(rot.cos[:8], hf_tables(
            Phi3Config, Phi3RotaryEmbedding, 8, max_position_embeddings=max_pos,
            original_max_position_embeddings=64, rope_parameters=rope)[0])  # (the short ones differ)


@pytest.mark.parametrize("hf, field", [
    (dict(rope_scaling=dict(rope_type="mrope", factor=2.0)), "'rope_scaling.rope_type' = 'mrope'"),
    (dict(partial_rotary_factor=0.75), "'partial_rotary_factor' = 0.75"),
    (dict(rope_scaling=dict(rope_type="yarn", factor=2.0)), "'rope_scaling.original_max_position_embeddings'"),
])
def test_unsupported_rope_refused(hf, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        radixd_tables(hf)


async def test_yarn_model_greedy_matches_transformers(tmp_path):
    """A Qwen2.5-style checkpoint with yarn: the engine's tokens are transformers'."""
    path = make_tiny_checkpoint(tmp_path / "qwen2-yarn", "qwen2-yarn")
    eng = make_engine(path, chunked_prefill_size=16)
    try:
        ps = prompts(2, 40, seed=6)
        outs = await asyncio.gather(*(collect(eng, p, 10) for p in ps))
        for p, got in zip(ps, outs, strict=True):
            assert_greedy_matches(path, p, got, 10)
        await assert_idle(eng)
    finally:
        await eng.stop()
