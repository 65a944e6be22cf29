"""Rotary embedding tables: each position's cos and sin, for every rope scaling radixd
implements (``ROPE_TYPES``), computed as transformers computes its inverse frequencies and
attention factor (``modeling_rope_utils``) for the same config.

Every position is rotated by one table for the model's whole context, since KV, once cached,
is never re-rotated. Where transformers picks frequencies by the current sequence length,
radixd takes the ones for the longest sequence the model serves:

* ``longrope`` (Phi-3 / Phi-4): the long factors and their attention factor where the model's
  context exceeds ``original_max_position_embeddings`` (transformers rotates a sequence
  within the original context by the short ones); the short ones where it does not.
* ``dynamic`` (NTK-aware): the base stretched for ``factor`` times the configured context,
  which is what the model then serves (``served_positions``); transformers stretches it for
  the sequence at hand, and not at all within ``max_position_embeddings``.
"""

from __future__ import annotations

import math

import torch

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "dynamic")


def rope_type(scaling: dict | None) -> str:
    return (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))


def served_positions(max_pos: int, scaling: dict | None) -> int:
    """Positions the table covers: ``max_position_embeddings``, times ``factor`` for ``dynamic``."""
    return int(max_pos * scaling["factor"]) if rope_type(scaling) == "dynamic" else max_pos


def rope_tables(head_dim: int, max_pos: int, theta: float, scaling: dict | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [served_positions, head_dim / 2] in float32, the attention factor folded in."""
    inv, factor = _inv_freq(head_dim, max_pos, theta, scaling)
    freqs = torch.outer(torch.arange(served_positions(max_pos, scaling), dtype=torch.float32), inv)
    return freqs.cos() * factor, freqs.sin() * factor


def _inv_freq(dim: int, max_pos: int, theta: float, scaling: dict | None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [dim / 2] and the factor cos and sin are scaled by."""
    kind = rope_type(scaling)
    if kind in ("yarn", "longrope"):
        pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
        return (_yarn if kind == "yarn" else _longrope)(pos_freqs, dim, max_pos, theta, scaling)
    if kind == "dynamic":  # the base stretched for the served context, factor x max_pos
        factor = scaling["factor"]
        theta = theta * (factor * factor - (factor - 1)) ** (dim / (dim - 2))
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    if kind in ("default", "dynamic"):
        return inv.float(), 1.0
    if kind == "linear":
        return (inv / scaling["factor"]).float(), 1.0
    if kind == "llama3":
        return _llama3(inv, scaling), 1.0
    raise ValueError(f"rope type {kind!r} is not one of {ROPE_TYPES}")


def _llama3(inv: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_ctx = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_mid, mid, scaled).float()


def _mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(pos_freqs: torch.Tensor, dim: int, max_pos: int, theta: float, scaling: dict) -> tuple[torch.Tensor, float]:
    """Interpolate the low frequencies by ``factor``, keep the high ones, ramp between the
    dimensions that turn ``beta_slow`` and ``beta_fast`` times over the original context."""
    orig = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or max_pos / orig
    attention = scaling.get("attention_factor")
    if attention is None:
        mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = _mscale(factor, mscale) / _mscale(factor, mscale_all) if mscale and mscale_all else _mscale(factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(scaling.get("beta_fast") or 32), correction_dim(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / ((high - low) or 0.001), 0, 1)
    keep = 1 - ramp  # 1: extrapolate (the frequency as is), 0: interpolate
    inv = (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep
    return inv, float(attention)


def _longrope(pos_freqs: torch.Tensor, dim: int, max_pos: int, theta: float,
              scaling: dict) -> tuple[torch.Tensor, float]:
    """Each frequency divided by its own factor: the long ones past the original context."""
    orig = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or max_pos / orig
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    ext = torch.tensor(scaling["long_factor" if max_pos > orig else "short_factor"], dtype=torch.float32)
    return 1.0 / (ext * pos_freqs), float(attention)
