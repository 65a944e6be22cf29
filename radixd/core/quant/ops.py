"""The quantized linear ops: ``y = x @ dequant(weight).T (+ bias)`` for fp8 and int4/int8
weights, the one interface layers and loaders call, and the helpers that make and read the
layouts.

Layouts (N output features, K input features; a row of ``weight`` is one output feature)
-----------------------------------------------------------------------------------------
``fp8_linear(x, weight, weight_scale, *, block=None, bias=None)``

* ``x`` [M, K] bf16/fp16/fp32; ``weight`` [N, K] ``torch.float8_e4m3fn``; ``weight_scale``
  fp32, one of
    - ``[]``: per tensor, ``W = weight * s``;
    - ``[N]``: per output channel, ``W[n] = weight[n] * s[n]``;
    - ``[ceil(N / bn), ceil(K / bk)]`` with ``block=(bn, bk)``: DeepSeek-style block fp8,
      ``W[n, k] = weight[n, k] * s[n // bn, k // bk]``.
* Activations are quantized dynamically to fp8 e4m3 (``quantize_act_fp8``): per token
  (``scale = max(amax(row), AMAX_EPS) / FP8_MAX``; compressed-tensors' FP8_DYNAMIC) for
  per-tensor and per-channel weights, per token and group of ``bk`` columns for block weights;
  ``q = round_to_fp8(clamp(x / scale, -FP8_MAX, FP8_MAX))``, the division in fp32.
* Output [M, N] in ``x.dtype``; ``bias`` [N] added in ``x.dtype``.

``int_weight_linear(x, qweight, scales, zeros, *, bits, group_size, perm=None, bias=None)``

* Weight-only int4/int8 (W4A16 / W8A16), groups of ``group_size`` consecutive columns along K
  (``group_size >= K``: per channel); where ``group_size`` does not divide K the last group is
  the shorter remainder (``G = ceil(K / group_size)`` groups).
* ``bits=4``: ``qweight`` int32 [N, K // 8]; column k of row n is nibble ``k % 8`` of word
  ``k // 8``, the low nibble first (``pack_int4``). ``bits=8``: ``qweight`` uint8 [N, K].
  Values are unsigned, 0 .. 2**bits - 1.
* ``scales`` [N, G] in ``x.dtype`` (or fp16/fp32); ``zeros`` None (symmetric:
  ``W = (q - 2**(bits - 1)) * s``) or [N, G] in ``scales.dtype`` holding the zero point as a
  number (``W = (q - z) * s``).
* ``perm`` None or int64 [K] (GPTQ act-order): ``y = x[:, perm] @ W.T``; the weights are stored
  already permuted, so each group is contiguous in ``qweight``.
* Output [M, N] in ``x.dtype``; ``bias`` [N] added in ``x.dtype``.

Dispatch (``use_triton``, as ``radixd.core.triton_ops``): CUDA tensors take the Triton
kernels, others the references; up to ``GEMV_MAX_M`` rows a weight-streaming GEMV
(``gemv``; its fp8 path multiplies the unquantized x), more rows a tensor-core GEMM
(``fp8_gemm``, ``int_gemm``). A per-channel fp8 weight at a decode batch's rows takes what
was measured fastest for its shape on the GPU model (``fp8_rows.choose``: the few-rows
kernel ``fp8_rows``, in one of its two modes, ``torch._scaled_mm``, or ``fp8_gemm``); the
few-rows kernel's W8A16 mode, like the GEMV, leaves x unquantized.

The references here (``*_reference``) dequantize the weight and the fake-quantized
activation to ``x.dtype`` and multiply in ``x.dtype``: they are the CPU path and what the
kernels are tested against. ``quantize_fp8`` and ``quantize_int`` quantize a float weight by
round-to-nearest (benchmarks and tests quantize random weights in-process with them).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from radixd.core.quant import AMAX_EPS, FP8, FP8_MAX, fp8_rows
from radixd.core.quant.fp8_gemm import fp8_gemm
from radixd.core.quant.gemv import GEMV_MAX_M, fp8_gemv, int_gemv
from radixd.core.quant.int_gemm import int_gemm

INT_DTYPES = {4: torch.int32, 8: torch.uint8}


# ----------------------------------------------------------------------------- layouts


def pack_int4(q: Tensor) -> Tensor:
    """uint8 [N, K] of values 0..15 -> int32 [N, K // 8], nibble i of word j is column 8j + i."""
    n, k = q.shape
    if k % 8:
        raise ValueError(f"pack_int4: K={k} is not a multiple of 8")
    nib = q.to(torch.int32).view(n, k // 8, 8)
    # the nibbles' bits are disjoint: the int32 sum is their OR (the top one wraps to the sign)
    return (nib << (4 * torch.arange(8, dtype=torch.int32, device=q.device))).sum(-1, dtype=torch.int32)


def unpack_int4(qweight: Tensor) -> Tensor:
    """int32 [N, K // 8] -> uint8 [N, K] (``pack_int4``'s inverse)."""
    n, w = qweight.shape
    shifts = 4 * torch.arange(8, dtype=torch.int32, device=qweight.device)
    return ((qweight[:, :, None] >> shifts) & 0xF).to(torch.uint8).view(n, w * 8)


def _amax_scale(amax: Tensor, qmax: float) -> Tensor:
    return amax.float().clamp(min=AMAX_EPS) / qmax


def _to_fp8(x: Tensor, scale: Tensor) -> Tensor:
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def quantize_fp8(w: Tensor, granularity: str = "tensor", block: tuple[int, int] = (128, 128)) -> tuple[Tensor, Tensor]:
    """A float weight [N, K] -> (fp8 weight, fp32 scale) in ``fp8_linear``'s layout: scale
    ``[]`` ("tensor"), ``[N]`` ("channel") or ``[ceil(N/bn), ceil(K/bk)]`` ("block")."""
    n, k = w.shape
    wf = w.float()
    if granularity == "tensor":
        scale = _amax_scale(wf.abs().amax(), FP8_MAX)
        return _to_fp8(wf, scale), scale
    if granularity == "channel":
        scale = _amax_scale(wf.abs().amax(1), FP8_MAX)
        return _to_fp8(wf, scale[:, None]), scale
    if granularity == "block":
        bn, bk = block
        gn, gk = math.ceil(n / bn), math.ceil(k / bk)
        padded = torch.zeros(gn * bn, gk * bk, device=w.device)
        padded[:n, :k] = wf
        scale = _amax_scale(padded.view(gn, bn, gk, bk).abs().amax((1, 3)), FP8_MAX)
        return _to_fp8(wf, expand_block_scale(scale, block, n, k)), scale
    raise ValueError(f"quantize_fp8: granularity must be 'tensor', 'channel' or 'block', not {granularity!r}")


def expand_block_scale(scale: Tensor, block: tuple[int, int], n: int, k: int) -> Tensor:
    """[ceil(N/bn), ceil(K/bk)] block scales -> one per weight element [N, K]."""
    bn, bk = block
    return scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]


def quantize_int(w: Tensor, bits: int, group_size: int, symmetric: bool) -> tuple[Tensor, Tensor, Tensor | None]:
    """A float weight [N, K] -> (qweight, scales, zeros) in ``int_weight_linear``'s layout by
    round-to-nearest per group: symmetric ``s = amax / (2**(bits-1) - 1)``, zeros None;
    else ``s = (max - min) / (2**bits - 1)``, ``z = round(-min / s)``. Scales and zeros in
    ``w.dtype``."""
    _check_bits_group(bits, group_size)
    n, k = w.shape
    groups = math.ceil(k / group_size)
    g = torch.zeros(n, groups * group_size, device=w.device)  # (zero columns change no group's range)
    g[:, :k] = w.float()
    g = g.view(n, groups, group_size)
    qmax = 2**bits - 1
    if symmetric:
        half = 2 ** (bits - 1)
        s = _amax_scale(g.abs().amax(-1), half - 1).to(w.dtype)
        q = (g / s.float()[..., None]).round().clamp(-half, half - 1) + half
        z = None
    else:
        lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
        exact = _amax_scale(hi - lo, qmax)
        s = exact.to(w.dtype)  # rounded up where it rounded down, so that max - min still fits
        s = torch.where(s.float() < exact, torch.nextafter(s, torch.full_like(s, math.inf)), s)
        z = (-lo / s.float()).round().clamp(0, qmax)
        q = ((g / s.float()[..., None]).round() + z[..., None]).clamp(0, qmax)
        z = z.to(w.dtype)
    q = q.view(n, groups * group_size)[:, :k].to(torch.uint8)
    return (pack_int4(q) if bits == 4 else q), s, z


def dequantize_int(qweight: Tensor, scales: Tensor, zeros: Tensor | None, bits: int, group_size: int) -> Tensor:
    """``int_weight_linear``'s weight as fp32 [N, K]."""
    q = (unpack_int4(qweight) if bits == 4 else qweight).float()
    n, k = q.shape
    z = zeros.float() if zeros is not None else torch.full_like(scales, 2 ** (bits - 1), dtype=torch.float32)
    return (q - z.repeat_interleave(group_size, 1)[:, :k]) * scales.float().repeat_interleave(group_size, 1)[:, :k]


def dequantize_fp8(weight: Tensor, weight_scale: Tensor, block: tuple[int, int] | None = None) -> Tensor:
    """``fp8_linear``'s weight as fp32 [N, K]."""
    n, k = weight.shape
    if block is not None:
        return weight.float() * expand_block_scale(weight_scale.float(), block, n, k)
    s = weight_scale.float()
    return weight.float() * (s[:, None] if s.dim() == 1 else s)


def quantize_act_fp8(x: Tensor, group: int | None = None) -> tuple[Tensor, Tensor]:
    """Dynamic fp8 activations: x [M, K] -> (fp8 [M, K], fp32 scales [M, 1] per token, or
    [M, ceil(K / group)] per token and group of ``group`` columns)."""
    m, k = x.shape
    if group is None:
        scale = _amax_scale(x.abs().amax(1, keepdim=True), FP8_MAX)
        return _to_fp8(x, scale), scale
    gk = math.ceil(k / group)
    padded = torch.zeros(m, gk * group, dtype=torch.float32, device=x.device)
    padded[:, :k] = x.float()
    scale = _amax_scale(padded.view(m, gk, group).abs().amax(-1), FP8_MAX)
    return _to_fp8(x, scale.repeat_interleave(group, 1)[:, :k]), scale


# ----------------------------------------------------------------------------- checks


def _check_bits_group(bits: int, group_size: int) -> None:
    if bits not in INT_DTYPES:
        raise ValueError(f"bits must be 4 or 8, not {bits}")
    if group_size <= 0:
        raise ValueError(f"group_size must be positive, not {group_size}")


def check_fp8(x: Tensor, weight: Tensor, weight_scale: Tensor, block: tuple[int, int] | None) -> None:
    """Raises ValueError naming the tensor whose shape or dtype breaks ``fp8_linear``'s layout."""
    n, k = weight.shape
    if weight.dtype != FP8:
        raise ValueError(f"fp8 weight: dtype {weight.dtype}, expected {FP8}")
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"fp8_linear: x {tuple(x.shape)} does not match weight [{n}, {k}]")
    if weight_scale.dtype != torch.float32:
        raise ValueError(f"fp8 weight_scale: dtype {weight_scale.dtype}, expected torch.float32")
    if block is not None:
        want = (math.ceil(n / block[0]), math.ceil(k / block[1]))
        if tuple(weight_scale.shape) != want:
            raise ValueError(f"fp8 weight_scale: shape {tuple(weight_scale.shape)}, expected {list(want)} "
                             f"for [{n}, {k}] in blocks {list(block)}")
    elif tuple(weight_scale.shape) not in ((), (n,)):
        raise ValueError(f"fp8 weight_scale: shape {tuple(weight_scale.shape)}, expected [] or [{n}]")


def check_int(x: Tensor, qweight: Tensor, scales: Tensor, zeros: Tensor | None, bits: int, group_size: int,
              perm: Tensor | None) -> None:
    """Raises ValueError naming the tensor whose shape or dtype breaks ``int_weight_linear``'s layout."""
    if x.dim() != 2:
        raise ValueError(f"int_weight_linear: x must be [M, K], got {tuple(x.shape)}")
    k = x.shape[1]
    _check_bits_group(bits, group_size)
    n = qweight.shape[0]
    want = (n, k // 8) if bits == 4 else (n, k)
    if qweight.dtype != INT_DTYPES[bits] or tuple(qweight.shape) != want:
        raise ValueError(f"qweight: {qweight.dtype} {tuple(qweight.shape)}, expected {INT_DTYPES[bits]} "
                         f"{list(want)} for int{bits} with K={k}")
    groups = (n, math.ceil(k / group_size))
    if tuple(scales.shape) != groups:
        raise ValueError(f"scales: shape {tuple(scales.shape)}, expected {list(groups)} (group_size {group_size})")
    if zeros is not None and (tuple(zeros.shape) != groups or zeros.dtype != scales.dtype):
        raise ValueError(f"zeros: {zeros.dtype} {tuple(zeros.shape)}, expected {scales.dtype} {list(groups)}")
    if perm is not None and (perm.dtype != torch.int64 or tuple(perm.shape) != (k,)):
        raise ValueError(f"perm: {perm.dtype} {tuple(perm.shape)}, expected torch.int64 [{k}]")


# ----------------------------------------------------------------------------- references


def fp8_linear_reference(x: Tensor, weight: Tensor, weight_scale: Tensor, *, block: tuple[int, int] | None = None,
                         bias: Tensor | None = None) -> Tensor:
    """``fp8_linear`` in torch ops: fake-quantized activations and the dequantized weight in
    ``x.dtype``, one matmul."""
    xq, xs = quantize_act_fp8(x, block[1] if block is not None else None)
    if block is not None:
        xs = xs.repeat_interleave(block[1], 1)[:, :x.shape[1]]
    xd = (xq.float() * xs).to(x.dtype)
    return torch.nn.functional.linear(xd, dequantize_fp8(weight, weight_scale, block).to(x.dtype), bias)


def int_weight_linear_reference(x: Tensor, qweight: Tensor, scales: Tensor, zeros: Tensor | None, *, bits: int,
                                group_size: int, perm: Tensor | None = None, bias: Tensor | None = None) -> Tensor:
    """``int_weight_linear`` in torch ops: the dequantized weight in ``x.dtype``, one matmul."""
    if perm is not None:
        x = x[:, perm]
    w = dequantize_int(qweight, scales, zeros, bits, group_size).to(x.dtype)
    return torch.nn.functional.linear(x, w, bias)


# ----------------------------------------------------------------------------- the ops


def _kernels(x: Tensor, use_triton: bool | None) -> bool:
    return bool(x.shape[0]) and (x.is_cuda if use_triton is None else use_triton)


def fp8_linear(x: Tensor, weight: Tensor, weight_scale: Tensor, *, block: tuple[int, int] | None = None,
               bias: Tensor | None = None, use_triton: bool | None = None) -> Tensor:
    """``x @ W.T + bias`` for an fp8 weight (the module docstring's layout). ``use_triton``:
    None takes the kernels on CUDA and the reference elsewhere; up to ``GEMV_MAX_M`` rows
    go through ``gemv.fp8_gemv`` (x unquantized), more through ``fp8_gemm.fp8_gemm``."""
    check_fp8(x, weight, weight_scale, block)
    if not _kernels(x, use_triton):
        return fp8_linear_reference(x, weight, weight_scale, block=block, bias=bias)
    x = x if x.stride(1) == 1 else x.contiguous()
    if x.shape[0] <= GEMV_MAX_M:
        return fp8_gemv(x, weight, weight_scale, block, bias)
    if block is None and weight_scale.dim() == 1:
        choice = fp8_rows.choose(x.shape[0], weight.shape[0], x.shape[1], False, x.device)
        y = fp8_rows.run_choice(choice, x, weight, weight_scale, bias) if choice else None
        if y is not None:
            return y
    return fp8_gemm(x, weight, weight_scale, block, bias)


def int_weight_linear(x: Tensor, qweight: Tensor, scales: Tensor, zeros: Tensor | None, *, bits: int,
                      group_size: int, perm: Tensor | None = None, bias: Tensor | None = None,
                      use_triton: bool | None = None) -> Tensor:
    """``x[:, perm] @ W.T + bias`` for an int4/int8 weight (the module docstring's layout).
    ``use_triton``: None takes the kernels on CUDA and the reference elsewhere; up to
    ``GEMV_MAX_M`` rows go through ``gemv.int_gemv``, more through ``int_gemm.int_gemm``."""
    check_int(x, qweight, scales, zeros, bits, group_size, perm)
    if not _kernels(x, use_triton):
        return int_weight_linear_reference(x, qweight, scales, zeros, bits=bits, group_size=group_size, perm=perm,
                                           bias=bias)
    x = x if x.stride(1) == 1 else x.contiguous()
    if x.shape[0] <= GEMV_MAX_M:
        return int_gemv(x, qweight, scales, zeros, bits, group_size, perm, bias)
    return int_gemm(x, qweight, scales, zeros, bits, group_size, perm, bias)
