"""Quantized projections in a model: ``QuantLinear`` (a projection whose weight is in one of
the ops' canonical layouts, ``formats``' module docstring) and the three ways a model gets
them: ``swap_projections`` (empty, to be filled from a quantized checkpoint),
``quantize_projections`` (from the model's own float weights, round-to-nearest: random
weights of a quantized checkpoint's shape for benchmarks) and ``shard_quantized`` (a tensor
parallel shard's part of a canonical tensor).

``QuantEmbedding`` is an embedding table kept in int8 for the CPU (a GGUF's Q8_0
``token_embd``, ``radixd.core.gguf``).

Which modules may be quantized: the dense projections of the decoder layers (``qkv_proj``,
``o_proj``, ``gate_up_proj``, ``down_proj``), and in fp8 a mixture of experts' experts (held by
``moe.Experts.make_fp8``, not as ``QuantLinear``). The LM head, embeddings, the router, a
shared expert and int experts stay in the model dtype: a checkpoint that quantizes any of
them is refused by name (``swap_projections``).

Contract: a ``QuantLinear`` is built with empty tensors of the layout's shapes after the
model's ``.to(dtype)`` (which would otherwise cast fp8 weights and fp32 scales), on "meta"
before the model's ``to_empty`` where it replaces a projection (so the 16-bit weights are never
allocated); its parameters are filled once by the loader or ``shard_model`` and never change.
"""

from __future__ import annotations

import logging
import math

import torch
from torch import nn

from radixd.core import cpu_kernels
from radixd.core.errors import ConfigError
from radixd.core.quant import fp8_rows, ops
from radixd.core.quant.cpu_int import (
    CpuIntWeight,
    cpu_int_linear,
    pack_cpu,
    records_linear,
    rows,
    with_prefill_copies,
)
from radixd.core.quant.formats import Fp8Layout, IntLayout, Layout, QuantFormatError
from radixd.core.quant.gemv import RopeStore, fp8_gemv, int_gemv

log = logging.getLogger(__name__)

PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
EXPERTS = ("gate_up_proj", "down_proj")  # a mixture of experts' stacked projections (``moe.Experts``)
COLUMN_PARALLEL = ("qkv_proj", "gate_up_proj")  # output rows split over the shards


class QuantLinear(nn.Module):
    """``x @ W.T + bias`` with ``W`` quantized in ``layout`` (``[N, K]`` = out, in features).
    ``pdl`` (set by the loader from ``KernelChoice.pdl``): its one-row GEMVs launched for
    programmatic dependent launch."""

    pdl = False

    def __init__(self, in_features: int, out_features: int, layout: Layout, *, bias: bool, dtype: torch.dtype,
                 device: torch.device, name: str = "a projection"):
        """``name``: what a layout error names (the checkpoint's projection)."""
        super().__init__()
        self.in_features, self.out_features, self.layout = in_features, out_features, layout
        n, k = out_features, in_features

        def param(shape: tuple[int, ...], dt: torch.dtype) -> nn.Parameter:
            return nn.Parameter(torch.empty(shape, dtype=dt, device=device), requires_grad=False)

        if isinstance(layout, Fp8Layout):
            self.weight = param((n, k), ops.FP8)
            scale = (math.ceil(n / layout.block[0]), math.ceil(k / layout.block[1])) if layout.block else (n,)
            self.weight_scale = param(scale, torch.float32)
        else:
            g = layout.group_of(k)
            if k % g or (layout.bits == 4 and k % 8):
                raise QuantFormatError(f"{name}: its {k} input columns are not whole groups of group_size {g} "
                                       f"(int{layout.bits})")
            self.weight = param((n, k // 8) if layout.bits == 4 else (n, k), ops.INT_DTYPES[layout.bits])
            self.weight_scale = param((n, k // g), dtype)
            self.weight_zeros = None if layout.symmetric else param((n, k // g), dtype)
            self.weight_perm = param((k,), torch.int64) if layout.act_order else None
        self.bias = param((n,), dtype) if bias else None
        self.cpu: CpuIntWeight | None = None

    def pack_for_cpu(self) -> bool:
        """Serve this int weight through the CPU kernels (``cpu_int``): packs it once and drops
        the canonical tensors; False (kept as it is) where the kernels lack its shape."""
        lay = self.layout
        if not isinstance(lay, IntLayout) or lay.act_order or self.weight.device.type != "cpu":
            return False
        self.cpu = pack_cpu(self.weight, self.weight_scale, self.weight_zeros, lay.bits, lay.group_of(self.in_features))
        if self.cpu is None:
            return False
        del self.weight, self.weight_scale, self.weight_zeros, self.weight_perm
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        lay = self.layout
        if self.cpu is not None:
            y = cpu_int_linear(flat, self.cpu, self.bias)
        elif isinstance(lay, Fp8Layout):
            y = ops.fp8_linear(flat, self.weight, self.weight_scale, block=lay.block, bias=self.bias)
        else:
            y = ops.int_weight_linear(flat, self.weight, self.weight_scale, self.weight_zeros, bits=lay.bits,
                                      group_size=lay.group_of(self.in_features), perm=self.weight_perm, bias=self.bias)
        return y.view(*x.shape[:-1], self.out_features)

    def forward_of_silu(self, gate_up: torch.Tensor) -> torch.Tensor | None:
        """This projection of SiLU(gate) * up, the product formed as the CPU kernel quantizes
        its input (``cpu_kernels.qmm``); None where that path does not apply (not a "records"
        CPU weight, a bias)."""
        flat = gate_up.reshape(-1, 2 * self.in_features)
        if self.cpu is None or self.cpu.kind != "records" or self.bias is not None:
            return None
        return records_linear(flat, self.cpu, silu=True).view(*gate_up.shape[:-1], self.out_features)

    def forward_silu(self, x: torch.Tensor) -> torch.Tensor | None:
        """SiLU(gate) * up of this (gate | up) projection in one kernel, the activation in its
        epilogue: one CUDA row through the GEMV, a decode batch of a per-channel fp8 weight
        through ``fp8_rows`` where that was measured fastest for the shape; None where no such
        path applies (the CPU, a bias, ...): the caller then takes ``forward`` and its own
        activation."""
        if self.bias is not None:
            return None
        if self._one_gemv_row(x):
            return self._gemv(x.reshape(1, -1), silu=True).view(*x.shape[:-1], self.out_features // 2)
        lay = self.layout
        if (self.cpu is not None or not x.is_cuda or not isinstance(lay, Fp8Layout) or lay.block
                or self.weight_scale.dim() != 1):
            return None
        flat = x.reshape(-1, self.in_features)
        if not 1 < flat.shape[0] <= fp8_rows.ROWS_MAX_M:
            return None
        choice = fp8_rows.choose(flat.shape[0], self.out_features // 2, self.in_features, True, x.device)
        if not choice or choice[0] != "rows":
            return None
        flat = flat if flat.stride(1) == 1 else flat.contiguous()
        y = fp8_rows.run_choice(choice, flat, self.weight, self.weight_scale, silu=True)
        return y.view(*x.shape[:-1], self.out_features // 2)

    def forward_rope(self, x: torch.Tensor, rope: RopeStore) -> torch.Tensor | None:
        """This q/k/v projection of one CUDA row with ``rope``'s epilogue (rotary, the K/V
        store) in the same GEMV kernel: q [1, H, D]; None where that path does not apply."""
        return self._gemv(x.reshape(1, -1), rope=rope) if self._one_gemv_row(x) else None

    def _one_gemv_row(self, x: torch.Tensor) -> bool:
        return self.cpu is None and x.is_cuda and x.numel() == self.in_features

    def _gemv(self, x: torch.Tensor, **epilogue) -> torch.Tensor:
        lay = self.layout
        if isinstance(lay, Fp8Layout):
            return fp8_gemv(x, self.weight, self.weight_scale, lay.block, self.bias, pdl=self.pdl, **epilogue)
        return int_gemv(x, self.weight, self.weight_scale, self.weight_zeros, lay.bits, lay.group_of(self.in_features),
                        self.weight_perm, self.bias, pdl=self.pdl, **epilogue)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, layout={self.layout}"


class QuantEmbedding(nn.Module):
    """An embedding table held as an int8 ``CpuIntWeight`` (``table``, set once by the loader;
    a tied LM head's own): a lookup dequantizes only the rows it reads, to ``dtype``."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype
        self.table: CpuIntWeight | None = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return rows(self.table, ids, self.dtype)


def _parent(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    owner, _, attr = name.rpartition(".")
    return (model.get_submodule(owner) if owner else model), attr


def _quantizable(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in PROJECTIONS and ".experts." not in name and "shared_expert" not in name


def swap_projections(model: nn.Module, layout: Layout, modules: dict[str, str], dtype: torch.dtype,
                     device: torch.device) -> None:
    """Replace the ``nn.Linear`` named by each key of ``modules`` (radixd names) by an empty
    ``QuantLinear``; each value is the checkpoint tensor that made it quantized (named in
    the error when the module cannot be)."""
    for name, tensor in sorted(modules.items()):
        owner_name, _, attr = name.rpartition(".")
        experts = model.get_submodule(owner_name) if attr in EXPERTS and _has(model, owner_name) else None
        if experts is not None and hasattr(experts, "make_fp8") and isinstance(layout, Fp8Layout):
            if experts.fp8 is None:  # (gate_up and down both come here)
                experts.make_fp8(layout, device, repr(tensor.rpartition(".experts.")[0] + ".experts"))
            continue
        layer = model.get_submodule(name) if _has(model, name) else None
        if not isinstance(layer, nn.Linear) or not _quantizable(name):
            raise QuantFormatError(f"tensor {tensor!r} is quantized, but radixd quantizes only the decoder "
                                   f"layers' dense projections ({', '.join(PROJECTIONS)}) and, in fp8, a mixture "
                                   "of experts' experts; leave the rest (LM head, MoE router, int experts) "
                                   "unquantized (the quantizer's ignore list)")
        owner, attr = _parent(model, name)
        setattr(owner, attr, QuantLinear(layer.in_features, layer.out_features, layout, bias=layer.bias is not None,
                                         dtype=dtype, device=device, name=repr(tensor.rpartition(".")[0])))


def _has(model: nn.Module, name: str) -> bool:
    try:
        model.get_submodule(name)
    except AttributeError:
        return False
    return True


def quantize_projections(model: nn.Module, layout: Layout) -> None:
    """Replace every quantizable ``nn.Linear`` by a ``QuantLinear`` of its own weight,
    quantized by round-to-nearest (``ops.quantize_fp8`` / ``ops.quantize_int``); with an fp8
    ``layout`` a mixture of experts' experts too (``moe.Experts.make_fp8``)."""
    for name, layer in list(model.named_modules()):
        if hasattr(layer, "make_fp8") and isinstance(layout, Fp8Layout):
            full = {attr: getattr(layer, attr).detach() for attr in EXPERTS}
            layer.make_fp8(layout, full["down_proj"].device, repr(name))
            layer.quantize(full)
            continue
        if not (isinstance(layer, nn.Linear) and _quantizable(name)):
            continue
        w = layer.weight.detach()
        q = QuantLinear(layer.in_features, layer.out_features, layout, bias=layer.bias is not None, dtype=w.dtype,
                        device=w.device)
        with torch.no_grad():
            if isinstance(layout, Fp8Layout):
                qw, scale = ops.quantize_fp8(w, "block" if layout.block else "channel", layout.block or (128, 128))
            else:
                qw, scale, zeros = ops.quantize_int(w, layout.bits, layout.group_of(w.shape[1]), layout.symmetric)
                if zeros is not None:
                    q.weight_zeros.copy_(zeros)
                if q.weight_perm is not None:
                    q.weight_perm.copy_(torch.arange(w.shape[1]))
            q.weight.copy_(qw)
            q.weight_scale.copy_(scale)
            if layer.bias is not None:
                q.bias.copy_(layer.bias)
        owner, attr = _parent(model, name)
        setattr(owner, attr, q)


def pack_cpu_projections(model: nn.Module) -> int:
    """``pack_for_cpu`` on every ``QuantLinear`` of ``model``; returns how many were packed.
    Where ``RADIXD_CPU_ACT_BITS=8`` asks for int8 activations that no kernel here takes (no
    AVX512-VNNI or AVX2 kernels: torch's int kernels on bf16 activations), says so."""
    packed = sum(m.pack_for_cpu() for m in model.modules() if isinstance(m, QuantLinear))
    if packed and cpu_kernels.act_planes() == 1 and not cpu_kernels.records():
        log.warning("%s=8 has no effect here: this CPU runs neither radixd's AVX512-VNNI nor its AVX2 int "
                    "kernels (or %s=baseline), so native weights multiply bf16 activations through torch",
                    cpu_kernels.ACT_ENV, cpu_kernels.ISA_ENV)
    return packed


def keep_cpu_prefill_copies(model: nn.Module, prefill_weights: str) -> int:
    """The packed int4 projections' bf16 copies for prefill, as ``prefill_weights`` says
    (``cpu_int.with_prefill_copies``); returns their bytes (0: none kept)."""
    packed = [m for m in model.modules() if isinstance(m, QuantLinear) and m.cpu is not None]
    for m, w in zip(packed, with_prefill_copies([m.cpu for m in packed], prefill_weights), strict=True):
        m.cpu = w
    return sum(m.cpu.dense_bytes for m in packed if m.cpu.dense is not None)


def mirror_projections(full: nn.Module, shard: nn.Module, device: torch.device, dtype: torch.dtype) -> set[str]:
    """Give ``shard`` (a tensor-parallel shard of ``full``) an empty ``QuantLinear`` of its own
    shape wherever ``full`` has one; returns their names."""
    names = {n: m.layout for n, m in full.named_modules() if isinstance(m, QuantLinear)}
    for name, layout in names.items():
        layer = shard.get_submodule(name)
        whole = full.get_submodule(name).in_features
        if isinstance(layout, IntLayout) and layout.group_size and layer.in_features % layout.group_size:
            raise ConfigError("tp_size", whole // layer.in_features, f"a divisor that keeps {name}'s groups of "
                              f"{layout.group_size} input columns whole ({whole} columns)")
        owner, attr = _parent(shard, name)
        setattr(owner, attr, QuantLinear(layer.in_features, layer.out_features, layout, bias=layer.bias is not None,
                                         dtype=dtype, device=device))
    return set(names)


def shard_quantized(name: str, t: torch.Tensor, module: QuantLinear, sections: list[int], rank: int,
                    tp: int) -> torch.Tensor:
    """Shard ``rank``'s part of ``t``, the full model's canonical tensor ``name`` of the
    quantized projection ``module``. Column-parallel projections (``sections``: the rows of
    q/k/v or gate/up) split each section's rows; row-parallel ones split the input columns,
    which must fall on whole groups (int), blocks (fp8) and packed words (int4): a ``tp_size``
    that cuts one is a ``ConfigError`` naming the projection."""
    proj, _, suffix = name.rpartition(".")
    lay = module.layout
    if suffix == "bias" and proj.rsplit(".", 1)[-1] not in COLUMN_PARALLEL:
        return t
    if proj.rsplit(".", 1)[-1] in COLUMN_PARALLEL:
        if suffix == "weight_perm":
            return t  # (every shard reads the whole input)
        unit = lay.block[0] if isinstance(lay, Fp8Layout) and lay.block and suffix == "weight_scale" else 1
        parts = []
        start = 0
        for rows in sections:
            if rows % (tp * unit):
                raise ConfigError("tp_size", tp, f"a divisor that keeps {proj}'s fp8 blocks of {unit} rows whole "
                                  f"(a section of {rows} rows)")
            part = rows // unit // tp
            parts.append(t[start // unit + rank * part:start // unit + (rank + 1) * part])
            start += rows
        return torch.cat(parts)
    k = module.in_features
    if suffix == "weight_perm":
        if not torch.equal(t, torch.arange(k, device=t.device)):
            raise ConfigError("tp_size", tp, f"1 for act-order (desc_act) checkpoints: {proj}'s input columns are "
                              "permuted across the shards' inputs")
        return t[: k // tp]
    # ``whole``: columns a shard boundary must not cut; ``unit``: input columns per column of ``t``
    scales = suffix in ("weight_scale", "weight_zeros")
    if isinstance(lay, Fp8Layout):
        if scales and not lay.block:
            return t  # one scale per output row: every shard has all rows
        whole = lay.block[1] if lay.block else 1
        unit = whole if scales else 1
    else:
        if scales and lay.group_size is None:
            return t  # per output row: every shard has all rows
        packed = 8 if lay.bits == 4 else 1
        whole = math.lcm(lay.group_size or 1, packed)
        unit = lay.group_of(k) if scales else packed
    if k % tp or (k // tp) % whole:
        raise ConfigError("tp_size", tp, f"a divisor that keeps {proj}'s {'blocks' if whole > 1 else 'columns'} of "
                          f"{whole} input columns whole ({k} columns)")
    cols = k // tp // unit
    return t[:, rank * cols:(rank + 1) * cols]
