"""The CPU kernels of ``int_weight_linear``'s int4/int8 weights: torch's packed weight-only
matmuls, the weight kept quantized and dequantized inside the kernel, never as a whole.

``pack_cpu(qweight, scales, zeros, bits, group_size)`` turns a weight in the ops' canonical
layout (``ops``' module docstring) into a ``CpuIntWeight`` once, at load; ``cpu_int_linear``
multiplies by it every step. ``None`` from ``pack_cpu``: a shape the kernels do not take (the
reference path serves it).

* int4 (asymmetric or symmetric): ``aten._weight_int4pack_mm_for_cpu``, which dequantizes
  ``(q - 8) * scale + zero`` per group of 32/64/128/256 columns; canonical ``(q - z) * s``
  is ``scale = s``, ``zero = (8 - z) * s``. Its packed weight is in the CPU's own tile order.
  It is a kernel for few rows (it reads a quarter of bf16's bytes, but its cost grows with
  the rows as a GEMM's does not): more than ``DEQUANT_ROWS`` rows (a prefill) dequantize the
  weight to bf16 with radixd's C kernel (``cpu_kernels.int4pack_to_bf16``, where it reads
  this torch's packing) and multiply in a bf16 GEMM.
* int8 symmetric: ``aten._weight_int8pack_mm`` takes one scale per row, so a grouped weight is
  held as ``[G, N, group]`` and multiplied group by group (G calls of [M, group] x [group, N],
  summed in fp32): each reads its slice of the weight once, as a per-channel one would. Up to
  ``DEQUANT_ROWS`` rows take radixd's C kernel instead (``cpu_kernels.int8_matmul``: all
  groups in one pass, 2x at 8 rows).

Both kernels are fast only in bf16 (their fp32 and fp16 paths are scalar): activations, scales
and zeros are bf16, the result is cast back to ``x``'s dtype. bf16 activations are finer than
llama.cpp's, which quantizes them to 8 bits for its Q4_1 / Q8_0 dot products.

Contract: a ``CpuIntWeight`` is built once and never mutated; ``rows`` (embedding lookups of
a tied int8 table) reads it too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from radixd.core import cpu_kernels

INT4_GROUPS = (32, 64, 128, 256)  # what the int4 kernel takes
DEQUANT_ROWS = 16  # int4 matmuls of more rows dequantize and run a bf16 GEMM; int8 ones of as many take the C kernel
ACT = torch.bfloat16


@dataclass(frozen=True)
class CpuIntWeight:
    """A weight [N, K] packed for the CPU kernels: int4 ``q`` (the kernel's packed uint8) with
    ``scales`` [G, N, 2] (scale, zero); int8 ``q`` int8 [G, N, group] with ``scales`` [G, N]."""

    bits: int
    n: int
    k: int
    group_size: int
    q: Tensor
    scales: Tensor

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.scales.nbytes


def pack_cpu(qweight: Tensor, scales: Tensor, zeros: Tensor | None, bits: int, group_size: int) -> CpuIntWeight | None:
    """The canonical int weight packed for ``cpu_int_linear`` (None: a shape the kernels lack:
    int4 needs N a multiple of 16 and a group of 32..256, both need whole groups)."""
    from radixd.core.quant.ops import unpack_int4

    n = qweight.shape[0]
    k = qweight.shape[1] * (8 if bits == 4 else 1)
    g = min(group_size, k)
    if k % g or (bits == 4 and (n % 16 or g not in INT4_GROUPS)):
        return None
    s = scales.float()
    if bits == 4:
        z = zeros.float() if zeros is not None else torch.full_like(s, 8.0)
        q = torch.ops.aten._convert_weight_to_int4pack_for_cpu(unpack_int4(qweight).to(torch.int32).contiguous(), 1)
        sz = torch.stack((s, (8.0 - z) * s), -1).transpose(0, 1).contiguous().to(ACT)
        return CpuIntWeight(4, n, k, g, q, sz)
    if zeros is not None:
        return None  # (no asymmetric int8 kernel)
    q = (qweight.to(torch.int16) - 128).to(torch.int8).view(n, k // g, g).transpose(0, 1).contiguous()
    return CpuIntWeight(8, n, k, g, q, s.t().contiguous().to(ACT))


def cpu_int_linear(x: Tensor, w: CpuIntWeight, bias: Tensor | None = None) -> Tensor:
    """``x @ W.T + bias`` for x [M, K] (any float dtype; computed in bf16, returned in x's)."""
    xa = x.to(ACT).contiguous()
    if w.bits == 4 and xa.shape[0] > DEQUANT_ROWS and w.n % 64 == 0 and cpu_kernels.int4pack_readable():
        y = xa @ cpu_kernels.int4pack_to_bf16(w.q, w.scales, w.n, w.k, w.group_size)
    elif w.bits == 4:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(xa, w.q, w.group_size, w.scales)
    elif xa.shape[0] <= DEQUANT_ROWS and cpu_kernels.library() is not None:
        y = cpu_kernels.int8_matmul(xa, w.q, w.scales)
    else:
        groups = w.q.shape[0]
        if groups == 1:
            y = torch.ops.aten._weight_int8pack_mm(xa, w.q[0], w.scales[0])
        else:
            xg = xa.view(x.shape[0], groups, w.group_size)
            y = torch.ops.aten._weight_int8pack_mm(xg[:, 0].contiguous(), w.q[0], w.scales[0]).float()
            for i in range(1, groups):
                y += torch.ops.aten._weight_int8pack_mm(xg[:, i].contiguous(), w.q[i], w.scales[i])
    y = y.to(x.dtype)
    return y if bias is None else y + bias


def rows(w: CpuIntWeight, ids: Tensor, dtype: torch.dtype) -> Tensor:
    """Rows ``ids`` of an int8 ``w`` dequantized (an embedding lookup: only these rows are read)."""
    if w.bits != 8:
        raise ValueError("rows: only int8 weights keep their rows readable (int4 is in the kernel's tile order)")
    flat = ids.reshape(-1)
    q = w.q[:, flat].float() * w.scales[:, flat, None].float()  # [G, T, group]
    return q.transpose(0, 1).reshape(*ids.shape, w.k).to(dtype)
