"""Quantized checkpoint formats -> the ops' canonical layouts (``radixd.core.quant.ops``).

``read_scheme`` reads a checkpoint's ``quantization_config`` (config.json) against the
``[model] quantization`` option into a ``Scheme``: the layout every quantized projection
takes (``Fp8Layout`` or ``IntLayout``) and the converter of that format's tensors. Formats:

=====================  =====================================================================
compressed-tensors     ``float-quantized`` / ``naive-quantized`` fp8 (llmcompressor's FP8 /
                       FP8_DYNAMIC: ``weight`` e4m3 [N, K], ``weight_scale`` [1] per tensor,
                       [N, 1] per channel, [N/bn, K/bk] per block); ``pack-quantized`` int4
                       / int8 (W4A16 / W8A16: ``weight_packed`` int32 [N, K*bits/32] packed
                       along K low bits first, values offset by 2**(bits-1); ``weight_scale``
                       [N, K/g]; ``weight_zero_point`` packed along N when asymmetric;
                       ``weight_g_idx`` with act-order)
fp8                    block fp8 (DeepSeek-V3, Qwen3-FP8: ``weight_block_size: [128, 128]``,
                       ``weight_scale_inv`` [N/bn, K/bk], the dequantization multiplier)
gptq                   ``qweight`` int32 [K*bits/32, N] packed along K, ``qzeros`` [G, N*bits/32]
                       packed along N (``checkpoint_format`` "gptq": zero point minus one,
                       "gptq_v2": as is), ``scales`` [G, N], ``g_idx`` [K] (``desc_act``)
awq                    GEMM: ``qweight`` int32 [K, N/8] and ``qzeros`` [G, N/8] packed along N
                       in the interleaved nibble order 0 2 4 6 1 3 5 7, ``scales`` [G, N]
=====================  =====================================================================

Canonical tensors of one projection (what ``QuantLinear`` holds): ``weight`` (fp8 [N, K]; int4
int32 [N, K/8]; int8 uint8 [N, K]), ``weight_scale`` (fp8: fp32 [N] or block [N/bn, K/bk];
int: [N, K/g] in the model dtype), ``weight_zeros`` ([N, K/g] zero points, asymmetric int
only) and ``weight_perm`` (int64 [K], act-order only). A per-tensor fp8 scale becomes a
per-channel one (fused q/k/v rows each keep their own).

Contract: ``Scheme.convert(weights)`` is a stream filter: checkpoint tensors in, canonical
tensors out, under the projection's checkpoint name (``...q_proj.weight_scale``). Every
tensor of a quantized projection is checked against the config (dtype, packed shape, group
size) and a missing one is an error naming it; nothing is ever dequantized. A projection is
quantized when the checkpoint has its ``Scheme.marker`` tensor (so ``ignore`` lists and an
unquantized ``lm_head`` load as plain weights); a quantized tensor (fp8, int) reaching an
unquantized parameter is refused by the loader.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from radixd.core.config import QUANTIZATION
from radixd.core.errors import ConfigError
from radixd.core.quant.ops import FP8, pack_int4, unpack_int4

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AWQ GEMM: nibble i of a word holds column AWQ_ORDER[i]
CANONICAL = ("weight", "weight_scale", "weight_zeros", "weight_perm")


class QuantFormatError(ValueError):
    """A checkpoint whose quantization radixd cannot read as declared (names what and why)."""


@dataclass(frozen=True)
class Fp8Layout:
    """fp8 e4m3 weights, dynamic per-token fp8 activations; ``block`` (bn, bk) or None (per channel)."""

    block: tuple[int, int] | None = None


@dataclass(frozen=True)
class IntLayout:
    """Weight-only int4/int8 in groups of ``group_size`` input columns (None: one per row)."""

    bits: int
    group_size: int | None
    symmetric: bool
    act_order: bool = False

    def groups(self, k: int) -> int:
        return 1 if self.group_size is None else k // self.group_size

    def group_of(self, k: int) -> int:
        return k if self.group_size is None else self.group_size


Layout = Fp8Layout | IntLayout
Tensors = dict[str, Tensor]


@dataclass(frozen=True)
class Scheme:
    """One checkpoint's quantization: its format name, the projections' layout, the suffix
    that marks a quantized projection, the suffixes each must have, and the converter."""

    name: str                    # "compressed-tensors", "fp8", "gptq", "awq"
    layout: Layout
    marker: str                  # e.g. "weight_packed"
    required: tuple[str, ...]    # suffixes every quantized projection has (marker included)
    optional: tuple[str, ...]    # suffixes it may have (read when present)
    to_canonical: Callable[[str, Tensors, Layout], Tensors]

    @property
    def description(self) -> str:
        lay = self.layout
        if isinstance(lay, Fp8Layout):
            return f"{self.name} fp8 " + (f"blocks {list(lay.block)}" if lay.block else "per channel")
        group = f"group {lay.group_size}" if lay.group_size else "per channel"
        return f"{self.name} int{lay.bits} {group}{'' if lay.symmetric else ' asymmetric'}" + \
            (" act-order" if lay.act_order else "")

    def quantized(self, keys: Iterable[str]) -> set[str]:
        """The checkpoint names of the quantized projections (``model.layers.0.mlp.up_proj``)."""
        end = "." + self.marker
        return {k.removesuffix(end) for k in keys if k.endswith(end)}

    def convert(self, weights: Iterable[tuple[str, Tensor]], quantized: set[str]) -> Iterator[tuple[str, Tensor]]:
        """The stream filter of the module docstring: a quantized projection's tensors are
        held until all of its ``required`` ones (and any ``optional`` ones it is known to
        have) arrived, then come out canonical; other tensors pass as they are."""
        pending: dict[str, Tensors] = {}
        want = self.required + self.optional
        for name, tensor in weights:
            prefix, _, suffix = name.rpartition(".")
            if prefix not in quantized or suffix not in want:
                if tensor.dtype == FP8 and prefix not in quantized:
                    raise QuantFormatError(f"tensor {name!r} is fp8, but {prefix + '.' + self.marker!r} is missing "
                                           f"({self.description} has one for every quantized projection)")
                yield name, tensor
                continue
            parts = pending.setdefault(prefix, {})
            parts[suffix] = tensor
            if all(s in parts for s in want):
                yield from self._emit(prefix, pending.pop(prefix))
        for prefix, parts in pending.items():
            missing = [s for s in self.required if s not in parts]
            if missing:
                raise QuantFormatError(f"tensor {prefix + '.' + missing[0]!r} is missing: {self.description} "
                                       f"expects {', '.join(self.required)} for every quantized projection")
            yield from self._emit(prefix, parts)

    def _emit(self, prefix: str, parts: Tensors) -> Iterator[tuple[str, Tensor]]:
        for suffix, t in self.to_canonical(prefix, parts, self.layout).items():
            yield f"{prefix}.{suffix}", t


# ----------------------------------------------------------------------------- reading the config


def read_scheme(hf: dict[str, Any], option: str = "auto") -> Scheme | None:
    """The checkpoint's ``Scheme`` (None: unquantized) under ``[model] quantization``:
    ``"auto"`` what the checkpoint declares; ``"none"`` only an unquantized checkpoint; a
    format's name only that format (so a changed checkpoint cannot slip in another)."""
    if option not in QUANTIZATION:
        raise ConfigError("quantization", option, "one of " + ", ".join(map(repr, QUANTIZATION)))
    qc = hf.get("quantization_config")
    if qc is None:
        if option not in ("auto", "none"):
            raise ConfigError("quantization", option, "'auto' or 'none': the checkpoint is not quantized "
                              "(its config.json has no quantization_config)")
        return None
    method = qc.get("quant_method")
    if method == "gguf":  # a GGUF file converted by transformers (model_loader): its weights are floats
        return None
    readers = {"compressed-tensors": _compressed_tensors, "fp8": _fp8_block, "gptq": _gptq, "awq": _awq}
    if method not in readers:
        raise QuantFormatError(f"quantization_config.quant_method {method!r} is not supported; radixd reads "
                               f"{', '.join(readers)}")
    if option not in ("auto", method):
        raise ConfigError("quantization", option, f"'auto' or {method!r}: the checkpoint's "
                          "quantization_config.quant_method")
    return readers[method](qc)


def _unsupported(field: str, value: Any, allowed: str) -> QuantFormatError:
    return QuantFormatError(f"quantization_config.{field} = {value!r} is not supported; radixd reads {allowed}")


def _compressed_tensors(qc: dict[str, Any]) -> Scheme:
    fmt = qc.get("format")
    groups = qc.get("config_groups") or {}
    weights = [g.get("weights") for g in groups.values()]
    if not weights or any(w != weights[0] for w in weights) or weights[0] is None:
        raise _unsupported("config_groups", list(groups), "one weight scheme for every quantized layer")
    w = weights[0]
    acts = [g.get("input_activations") for g in groups.values()]
    for i, a in enumerate(acts):
        if a is not None and not a.get("dynamic"):
            raise _unsupported(f"config_groups.{list(groups)[i]}.input_activations.dynamic", a.get("dynamic"),
                               "dynamic activations (static input scales are not implemented)")
    strategy, bits, kind = w.get("strategy"), w.get("num_bits"), w.get("type")
    if fmt in ("float-quantized", "naive-quantized") and kind == "float":
        if bits != 8:
            raise _unsupported("config_groups.*.weights.num_bits", bits, "8 (fp8 e4m3)")
        if strategy == "block":
            block = tuple(w.get("block_structure") or ())
            if len(block) != 2:
                raise _unsupported("config_groups.*.weights.block_structure", list(block), "[rows, columns]")
            layout = Fp8Layout(block)  # type: ignore[arg-type]
        elif strategy in ("tensor", "channel"):
            layout = Fp8Layout()
        else:
            raise _unsupported("config_groups.*.weights.strategy", strategy, "'tensor', 'channel' or 'block'")
        _fp8_activations(acts, layout)
        return Scheme("compressed-tensors", layout, "weight_scale", ("weight", "weight_scale"), (), _ct_fp8)
    if fmt == "pack-quantized" and kind == "int":
        if bits not in (4, 8):
            raise _unsupported("config_groups.*.weights.num_bits", bits, "4 or 8")
        if strategy not in ("group", "channel"):
            raise _unsupported("config_groups.*.weights.strategy", strategy, "'group' or 'channel'")
        # "weight" / "static" ordered the calibration only: the layout is the plain one; "group"
        # (alias "dynamic") stores each column's group (weight_g_idx)
        if w.get("actorder") not in (None, False, "weight", "static", "group", "dynamic"):
            raise _unsupported("config_groups.*.weights.actorder", w.get("actorder"),
                               "null, 'weight', 'static', 'group' or 'dynamic'")
        act_order = w.get("actorder") in ("group", "dynamic")
        layout = IntLayout(bits, w.get("group_size") if strategy == "group" else None, bool(w.get("symmetric")),
                           act_order)
        if layout.group_size is not None and layout.group_size <= 0:
            raise _unsupported("config_groups.*.weights.group_size", layout.group_size, "a positive group size")
        required = ("weight_packed", "weight_scale", "weight_shape") + \
            (() if layout.symmetric else ("weight_zero_point",)) + (("weight_g_idx",) if act_order else ())
        return Scheme("compressed-tensors", layout, "weight_packed", required, (), _ct_packed)
    raise _unsupported("format", fmt, "'float-quantized' / 'naive-quantized' (fp8) and 'pack-quantized' "
                       f"(int4, int8) of compressed-tensors (weights of type {kind!r})")


def _fp8_activations(acts: list[dict[str, Any] | None], layout: Fp8Layout) -> None:
    """fp8 weights are served with dynamic fp8 activations (per token; per token and group
    of the weight block's columns for block weights, as FP8_DYNAMIC / FP8_BLOCK declare):
    a checkpoint that declares other activations would compute something else."""
    want = ("group", layout.block[1]) if layout.block else ("token", None)
    for a in acts:
        got = None if a is None else (a.get("strategy"), a.get("group_size") if layout.block else None)
        if a is None or a.get("type") != "float" or a.get("num_bits") != 8 or got != want:
            raise _unsupported("config_groups.*.input_activations", a,
                               f"dynamic fp8 activations per {want[0]}" + (f" of {want[1]}" if want[1] else "")
                               + " with fp8 weights (weight-only fp8 is not implemented)")


def _fp8_block(qc: dict[str, Any]) -> Scheme:
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        raise _unsupported("activation_scheme", qc.get("activation_scheme"), "'dynamic'")
    if qc.get("fmt", "e4m3") != "e4m3":
        raise _unsupported("fmt", qc.get("fmt"), "'e4m3'")
    block = qc.get("weight_block_size")
    if block is None:  # per-tensor fp8 (vLLM's Fp8Config): one weight_scale per projection
        return Scheme("fp8", Fp8Layout(), "weight_scale", ("weight", "weight_scale"), (), _ct_fp8)
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise _unsupported("weight_block_size", block, "[rows, columns], e.g. [128, 128]")
    return Scheme("fp8", Fp8Layout(tuple(block)), "weight_scale_inv", ("weight", "weight_scale_inv"), (),  # type: ignore[arg-type]
                  _fp8_inv)


def _gptq(qc: dict[str, Any]) -> Scheme:
    bits, group = qc.get("bits"), qc.get("group_size", -1)
    if bits not in (4, 8):
        raise _unsupported("bits", bits, "4 or 8")
    fmt = qc.get("checkpoint_format", qc.get("format", "gptq"))
    if fmt not in ("gptq", "gptq_v2"):
        raise _unsupported("checkpoint_format", fmt, "'gptq' or 'gptq_v2'")
    if not isinstance(group, int) or (group <= 0 and group != -1):
        raise _unsupported("group_size", group, "a positive group size or -1 (per channel)")
    layout = IntLayout(bits, None if group == -1 else group, bool(qc.get("sym", True)), bool(qc.get("desc_act")))
    v2 = fmt == "gptq_v2"
    return Scheme("gptq", layout, "qweight", ("qweight", "qzeros", "scales") + (("g_idx",) if layout.act_order else ()),
                  () if layout.act_order else ("g_idx",), lambda p, t, lay: _gptq_tensors(p, t, lay, v2))


def _awq(qc: dict[str, Any]) -> Scheme:
    bits, group = qc.get("bits", qc.get("w_bit")), qc.get("group_size", qc.get("q_group_size"))
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise _unsupported("version", qc.get("version"), "'gemm'")
    if bits != 4:
        raise _unsupported("bits", bits, "4")
    if not isinstance(group, int) or group <= 0:
        raise _unsupported("group_size", group, "a positive group size")
    layout = IntLayout(4, group, symmetric=False)
    if not qc.get("zero_point", True):
        raise _unsupported("zero_point", qc.get("zero_point"), "true")
    return Scheme("awq", layout, "qweight", ("qweight", "qzeros", "scales"), (), _awq_tensors)


# ----------------------------------------------------------------------------- converters


def _expect(name: str, t: Tensor, dtype: torch.dtype | tuple[torch.dtype, ...], shape: tuple[int, ...] | None,
            why: str) -> None:
    dtypes = dtype if isinstance(dtype, tuple) else (dtype,)
    if t.dtype not in dtypes or (shape is not None and tuple(t.shape) != shape):
        want = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise QuantFormatError(f"tensor {name!r}: {str(t.dtype).removeprefix('torch.')} {list(t.shape)}, expected "
                               f"{want}{'' if shape is None else ' ' + str(list(shape))} ({why})")


FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _fp8_weight(prefix: str, t: Tensors) -> tuple[int, int]:
    w = t["weight"]
    if w.dim() != 2:
        raise QuantFormatError(f"tensor {prefix + '.weight'!r}: shape {list(w.shape)}, expected [N, K]")
    _expect(f"{prefix}.weight", w, FP8, None, "fp8 e4m3 weights")
    return w.shape[0], w.shape[1]


def _fp8_scale(prefix: str, suffix: str, scale: Tensor, n: int, k: int, layout: Layout) -> Tensor:
    block = layout.block if isinstance(layout, Fp8Layout) else None
    if block:
        want = (math.ceil(n / block[0]), math.ceil(k / block[1]))
        _expect(f"{prefix}.{suffix}", scale, FLOATS, want, f"one scale per {block[0]}x{block[1]} block of [{n}, {k}]")
        return scale.float()
    if scale.numel() == 1 and scale.dim() <= 1:
        return scale.float().reshape(1).expand(n).contiguous()
    _expect(f"{prefix}.{suffix}", scale, FLOATS, (n, 1), f"one scale per tensor [1] or per output row [{n}, 1]")
    return scale.float().reshape(n)


def _ct_fp8(prefix: str, t: Tensors, layout: Layout) -> Tensors:
    n, k = _fp8_weight(prefix, t)
    return {"weight": t["weight"], "weight_scale": _fp8_scale(prefix, "weight_scale", t["weight_scale"], n, k, layout)}


def _fp8_inv(prefix: str, t: Tensors, layout: Layout) -> Tensors:
    n, k = _fp8_weight(prefix, t)
    return {"weight": t["weight"],
            "weight_scale": _fp8_scale(prefix, "weight_scale_inv", t["weight_scale_inv"], n, k, layout)}


def _groups(prefix: str, layout: IntLayout, k: int) -> int:
    g = layout.group_of(k)
    if k % g:
        raise QuantFormatError(f"projection {prefix!r}: its {k} input columns are not whole groups of "
                               f"group_size {g} (quantization_config)")
    return k // g


def _unpack_rows(words: Tensor, bits: int) -> Tensor:
    """int32 [R, C] packed low bits first along the last dim -> uint8 [R, C * 32 / bits]."""
    if bits == 4:
        return unpack_int4(words)
    return words.contiguous().view(torch.uint8).view(words.shape[0], -1)  # (little-endian bytes)


def _pack(q: Tensor, bits: int) -> Tensor:
    """uint8 [N, K] -> the canonical qweight (int4: ``pack_int4``'s int32 [N, K/8]; int8: as is)."""
    return pack_int4(q) if bits == 4 else q.contiguous()


def _perm(prefix: str, suffix: str, g_idx: Tensor, k: int, layout: IntLayout) -> Tensor | None:
    """The act-order permutation of a ``g_idx`` (group of each input column), None where
    it is the plain order; every group must have ``group_size`` columns."""
    _expect(f"{prefix}.{suffix}", g_idx, (torch.int32, torch.int64), (k,), "the group of each input column")
    g = layout.group_of(k)
    perm = torch.argsort(g_idx.long(), stable=True)
    if not torch.equal(g_idx.long()[perm], torch.arange(k) // g):
        raise QuantFormatError(f"tensor {prefix + '.' + suffix!r}: groups of other than group_size {g} columns")
    if torch.equal(perm, torch.arange(k)):
        return None
    if not layout.act_order:
        raise QuantFormatError(f"tensor {prefix + '.' + suffix!r}: columns out of order, but the config "
                               "declares no act-order (desc_act / actorder)")
    return perm


def _int_out(q: Tensor, scales: Tensor, zeros: Tensor | None, perm: Tensor | None, layout: IntLayout) -> Tensors:
    """Canonical tensors of a uint8 [N, K] weight in the original column order (permuted here)."""
    if perm is not None:
        q = q[:, perm]
    out = {"weight": _pack(q, layout.bits), "weight_scale": scales.contiguous()}
    if zeros is not None:
        out["weight_zeros"] = zeros.to(scales.dtype).contiguous()
    if perm is not None:
        out["weight_perm"] = perm
    return out


def _ct_packed(prefix: str, t: Tensors, layout: Layout) -> Tensors:
    assert isinstance(layout, IntLayout)
    bits = layout.bits
    shape = t["weight_shape"]
    if shape.numel() != 2:
        raise QuantFormatError(f"tensor {prefix + '.weight_shape'!r}: {shape.tolist()}, expected [N, K]")
    n, k = (int(v) for v in shape.tolist())
    per = 32 // bits
    if k % per:
        raise QuantFormatError(f"projection {prefix!r}: K={k} is not a multiple of {per} (int{bits} packing)")
    _expect(f"{prefix}.weight_packed", t["weight_packed"], torch.int32, (n, k // per),
            f"int{bits} packed {per} per int32 along K of weight_shape [{n}, {k}]")
    groups = _groups(prefix, layout, k)
    _expect(f"{prefix}.weight_scale", t["weight_scale"], FLOATS, (n, groups),
            f"one scale per row and group of {layout.group_of(k)} columns")
    q = _unpack_rows(t["weight_packed"], bits)
    zeros = None
    if not layout.symmetric:
        zp = t["weight_zero_point"]
        if bits == 4:
            _expect(f"{prefix}.weight_zero_point", zp, torch.int32, (math.ceil(n / 8), groups),
                    "int4 zero points packed 8 per int32 along N")
            zeros = _unpack_rows(zp.t().contiguous(), 4)[:, :n].t()
        else:
            _expect(f"{prefix}.weight_zero_point", zp, torch.int32, (math.ceil(n / 4), groups),
                    "int8 zero points packed 4 per int32 along N")
            zeros = _unpack_rows(zp.t().contiguous(), 8)[:, :n].t()
        zeros = zeros.float()
    perm = _perm(prefix, "weight_g_idx", t["weight_g_idx"], k, layout) if "weight_g_idx" in t else None
    return _int_out(q, t["weight_scale"], zeros, perm, layout)


def _gptq_tensors(prefix: str, t: Tensors, layout: Layout, v2: bool) -> Tensors:
    assert isinstance(layout, IntLayout)
    bits, per = layout.bits, 32 // layout.bits
    qw = t["qweight"]
    if qw.dim() != 2:
        raise QuantFormatError(f"tensor {prefix + '.qweight'!r}: shape {list(qw.shape)}, expected [K*{bits}/32, N]")
    k, n = qw.shape[0] * per, qw.shape[1]
    _expect(f"{prefix}.qweight", qw, torch.int32, None, f"int{bits} packed along K")
    groups = _groups(prefix, layout, k)
    _expect(f"{prefix}.scales", t["scales"], FLOATS, (groups, n),
            f"one scale per group of {layout.group_of(k)} input columns and output column, for K={k}")
    _expect(f"{prefix}.qzeros", t["qzeros"], torch.int32, (groups, math.ceil(n / per)),
            f"int{bits} zero points packed {per} per int32 along N")
    q = _unpack_rows(qw.t().contiguous(), bits)                 # [N, K]
    z = _unpack_rows(t["qzeros"], bits)[:, :n].t().float()      # [N, G]
    if not v2:  # GPTQ v1 stores each zero point minus one (wrapping)
        z = (z + 1).remainder(2**bits)
    if layout.symmetric:
        if not bool((z == 2 ** (bits - 1)).all()):
            raise QuantFormatError(f"tensor {prefix + '.qzeros'!r}: zero points other than {2 ** (bits - 1)} in a "
                                   "symmetric (sym: true) checkpoint")
        z = None
    g_idx = t.get("g_idx")
    perm = _perm(prefix, "g_idx", g_idx, k, layout) if g_idx is not None else None
    return _int_out(q, t["scales"].t(), z, perm, layout)


def _awq_tensors(prefix: str, t: Tensors, layout: Layout) -> Tensors:
    assert isinstance(layout, IntLayout)
    qw = t["qweight"]
    if qw.dim() != 2:
        raise QuantFormatError(f"tensor {prefix + '.qweight'!r}: shape {list(qw.shape)}, expected [K, N/8]")
    k, n = qw.shape[0], qw.shape[1] * 8
    _expect(f"{prefix}.qweight", qw, torch.int32, None, "int4 packed 8 per int32 along N")
    groups = _groups(prefix, layout, k)
    _expect(f"{prefix}.scales", t["scales"], FLOATS, (groups, n),
            f"one scale per group of {layout.group_of(k)} input columns and output column, for K={k}")
    _expect(f"{prefix}.qzeros", t["qzeros"], torch.int32, (groups, n // 8), "int4 zero points packed 8 per int32 along N")
    undo = torch.tensor(AWQ_ORDER).argsort()  # nibble order -> column order

    def columns(words: Tensor) -> Tensor:
        nib = unpack_int4(words).view(words.shape[0], -1, 8)  # [R, N/8, nibble]
        return nib[:, :, undo].reshape(words.shape[0], -1)

    q = columns(qw).t()                  # [N, K]
    z = columns(t["qzeros"]).t().float()  # [N, G]
    return _int_out(q, t["scales"].t(), z, None, layout)

