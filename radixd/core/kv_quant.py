"""What the KV pool stores K and V in: the model's dtype, or fp8 with per-layer scales.

``kv_cache_dtype`` "auto" keeps K/V in the model's dtype. "bfloat16" and "float16" name a
16-bit dtype: the model's own (the same as "auto"), or on the CPU a float32 model's K/V
stored in half the bytes, rounded to nearest even when stored and read back exactly (the CPU
decode kernels read them in float32, ``cpu_kernels``; a step's fresh prompt attends to its
K/V rounded alike). "fp8_e4m3" (``float8_e4m3fn``,
finite range +-448) and "fp8_e5m2" (``float8_e5m2``, +-57344) store each with one scale per
layer for K and one for V: a write stores ``value / scale`` saturated to the format's finite
range, a read gives ``fp8 * scale``. The scales come from the checkpoint where it has them
(per attention layer, as compressed-tensors ``kv_cache_scheme`` checkpoints and vLLM/SGLang fp8
checkpoints name them: ``layers.N.self_attn.k_scale``/``v_scale``, ModelOpt's
``k_proj.k_scale``/``v_proj.v_scale``, compressed-tensors' older ``k_proj.output_scale``/
``v_proj.output_scale``, and the deprecated single ``kv_scale`` for both), else 1.0.

Contract: a ``KVFormat`` is made once at start-up (``kv_format``, from the checkpoint's
tensors that ``is_scale_name`` picks; model loading skips them) and never changes (CUDA
graphs bake the scales in). The pool quantizes and dequantizes with ``quantize``/
``dequantize`` (the torch path); the Triton kernels do the same arithmetic in their loads and
stores (``radixd.core.attention.triton_kernels``, ``triton_ops.rope_store``). Stored pages
(cache tiers) are the pool's bytes as they are: fp8 pages stay fp8, and ``identity`` keys them
apart from pages of another format or other scales.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from radixd.core.config import KV_CACHE_DTYPES
from radixd.core.errors import ConfigError

FP8_DTYPES: dict[str, torch.dtype] = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
HALF_DTYPES: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "float16": torch.float16}
MANTISSA_BITS: dict[torch.dtype, int] = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}

# A checkpoint tensor holding a KV scale: (layer, which of "k", "v", "kv").
SCALE_NAME = re.compile(r"^(?:model\.)?layers\.(\d+)\.self_attn\.(?:attn\.)?"
                        r"(?:(k|v|kv)_scale|(k|v)_proj\.(?:k_scale|v_scale|output_scale))$")


@dataclass(frozen=True)
class KVFormat:
    """The pool's storage dtype and, for fp8, each layer's K and V scale."""

    dtype: torch.dtype
    k_scales: tuple[float, ...] = ()  # per layer; empty unless ``quantized``
    v_scales: tuple[float, ...] = ()

    @property
    def quantized(self) -> bool:
        return self.dtype in FP8_DTYPES.values()

    @property
    def identity(self) -> str:
        """What stored pages of this format must agree on (dtype and every scale)."""
        return f"{self.dtype}|{','.join(map(repr, self.k_scales))}|{','.join(map(repr, self.v_scales))}"


def kv_format(name: str, model_dtype: torch.dtype, num_layers: int,
              tensors: Iterable[tuple[str, torch.Tensor]] = (), device: str = "cpu",
              backend: str = "torch") -> KVFormat:
    """The format ``kv_cache_dtype = name`` gives a model of ``num_layers`` layers in
    ``model_dtype`` on ``device`` (its type) under the attention ``backend``; fp8 scales from
    the checkpoint's KV-scale ``tensors`` (``is_scale_name``; none: 1.0). A 16-bit pool under
    another dtype is read only by the torch backend on the CPU (its reads convert; the Triton
    kernels read the pool in the queries' dtype)."""
    if name == "auto":
        return KVFormat(model_dtype)
    if name in HALF_DTYPES:
        dtype = HALF_DTYPES[name]
        if dtype != model_dtype and not (device == "cpu" and model_dtype == torch.float32 and backend == "torch"):
            own = str(model_dtype).removeprefix("torch.")
            raise ConfigError("kv_cache_dtype", name,
                              f"'auto' or {own!r} for a {own} model on {device} with the {backend} backend (a "
                              "16-bit pool under another dtype: a float32 model on the CPU with the torch "
                              "backend), or an fp8 format")
        return KVFormat(dtype)
    if name not in FP8_DTYPES:
        raise ConfigError("kv_cache_dtype", name, "one of " + ", ".join(map(repr, KV_CACHE_DTYPES)))
    ks, vs = read_scales(tensors, num_layers)
    return KVFormat(FP8_DTYPES[name], ks or (1.0,) * num_layers, vs or (1.0,) * num_layers)


def is_scale_name(name: str) -> bool:
    """Whether a checkpoint tensor is a KV scale (not a weight of the model's layers)."""
    return SCALE_NAME.match(name) is not None


def read_scales(tensors: Iterable[tuple[str, torch.Tensor]],
                num_layers: int) -> tuple[tuple[float, ...] | None, tuple[float, ...] | None]:
    """(K scales, V scales) per layer from the checkpoint's KV-scale ``tensors``; (None, None)
    where there are none. A scale that is not one positive finite number, a layer index past
    the model's, or scales for some layers only are refused naming the tensor."""
    found: dict[str, dict[int, tuple[float, str]]] = {"k": {}, "v": {}}
    for name, t in tensors:
        m = SCALE_NAME.match(name)
        layer = int(m.group(1))
        which = m.group(2) or m.group(3)
        if layer >= num_layers:
            raise ValueError(f"checkpoint tensor {name!r}: layer {layer} of a model with {num_layers} layers")
        if t.numel() != 1:
            raise ValueError(f"checkpoint tensor {name!r}: one per-tensor KV scale expected, got shape "
                             f"{tuple(t.shape)} (per-head or per-channel KV scales are not supported)")
        value = float(t.float().reshape(()))
        if not (value > 0 and value != float("inf")):
            raise ValueError(f"checkpoint tensor {name!r}: a KV scale must be a positive finite number, got {value}")
        for kind in ("k", "v") if which == "kv" else (which,):
            found[kind][layer] = (value, name)
    if not found["k"] and not found["v"]:
        return None, None
    out = []
    for kind in ("k", "v"):
        missing = [i for i in range(num_layers) if i not in found[kind]]
        if missing:
            example = next(iter((found["k"] or found["v"]).values()))[1]
            raise ValueError(f"checkpoint has KV scales (e.g. {example!r}) but no {kind}_scale for "
                             f"layer(s) {missing[:8]}: each attention layer needs its k_scale and v_scale")
        out.append(tuple(found[kind][i][0] for i in range(num_layers)))
    return out[0], out[1]


def quantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """``x / scale`` in ``dtype`` (fp8), saturated to its finite range (no inf, no NaN)."""
    top = torch.finfo(dtype).max
    return (x.float() / scale).clamp_(-top, top).to(dtype)


def dequantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """``x * scale`` (``x`` fp8) in ``dtype``."""
    return (x.float() * scale).to(dtype)
