"""The CPU kernels of ``int_weight_linear``'s int4/int8 weights, the weight kept quantized
and dequantized inside the kernel, never as a whole (but for prefill's GEMMs).

``pack_cpu(qweight, scales, zeros, bits, group_size)`` turns a weight in the ops' canonical
layout (``ops``' module docstring) into a ``CpuIntWeight`` once, at load; ``cpu_int_linear``
multiplies by it every step. ``None`` from ``pack_cpu``: a shape the kernels do not take (the
reference path serves it). Two families, chosen at load by the CPU:

* "records" (a CPU with AVX512-VNNI or with AVX2, FMA and F16C, checked at run time:
  ``cpu_kernels.records``): radixd's own kernels (``cpu_kernels.qmm``). With AVX512-VNNI they
  are integer kernels, llama.cpp's way on x86 (below). With AVX2 only the activations stay
  float32 and each weight is dequantized inside the kernel into a float panel for an FMA
  kernel (``cpu_kernels.c``: ``qmm_fma``): float32 products of the dequantized weight, at any
  row count (an AVX2 CPU multiplies bf16 slowly, so no bf16 GEMM and no prefill copies; on a
  2-core AMD EPYC a 576 x 3072 int4 weight at 300 rows ran at 137 GFLOP/s, float32's GEMM
  at 114). With VNNI the weight is repacked into
  records of 16 output columns by 32 input columns (``pack_records``): int4 as unsigned nibbles
  with fp16 ``d`` and ``m`` (``w = d * q + m``: Q4_1 as shipped; canonical ``(q - z) * s`` is
  ``d = s``, ``m = -z * s``, a group of 64..256 repeated per block of 32), int8 as ``w / d +
  128`` bytes with fp16 ``d`` (Q8_0). The activations are quantized per row and block of 32
  (``d_x = max|x| / 127``, rounded to nearest) into int8, and each block's dot product is
  ``vpdpbusd``'s exact int32 sum, scaled once in float32: ``d_w d_x sum(q_w q_x) + m_w d_x
  sum(q_x)``. **Numerics**: as shipped the activations take two int8 planes, ``x / d_x = q +
  q2 / 254`` (``q2`` the rounded remainder: about 15 bits, twice the dot products): the
  default model's log-probabilities then stay within 0.001 of the fp32 conversion's on a
  55-token text, where bf16 activations (torch's int kernels) were 0.02 off on average and one
  int8 plane 0.06 (``RADIXD_CPU_ACT_BITS=8``: llama.cpp's Q8 activations, 10-20% faster decode
  steps at 8 requests; it turned the default model's near-tied first answer token, 0.08 apart in
  fp32, from "The capital of France is Paris." to "L'Étoile, ..."). Scales that fp16 does not
  hold (its subnormals, beyond 65504) keep the torch family. More than ``VNNI_GEMM_ROWS`` rows
  of an int4 weight (a prefill) dequantize it to bf16 (``cpu_kernels.qdequant_bf16``) for one
  bf16 GEMM (AMX where the CPU has it) where the CPU multiplies bf16 natively
  (``cpu_setup.native_bf16``); int8 weights take the kernel at any row count.
* "torch" (every other CPU, or ``RADIXD_CPU_ISA=baseline``): torch's packed weight-only
  matmuls on bf16 activations.

  * int4 (asymmetric or symmetric): ``aten._weight_int4pack_mm_for_cpu``, which dequantizes
    ``(q - 8) * scale + zero`` per group of 32/64/128/256 columns; canonical ``(q - z) * s``
    is ``scale = s``, ``zero = (8 - z) * s``. Its packed weight is in the CPU's own tile order.
    It is a kernel for few rows (it reads a quarter of bf16's bytes, but its cost grows with
    the rows as a GEMM's does not): more than ``DEQUANT_ROWS`` rows (a prefill) dequantize the
    weight to bf16 with radixd's C kernel (``cpu_kernels.int4pack_to_bf16``, where it reads
    this torch's packing) and multiply in a bf16 GEMM.
  * int8 symmetric: ``aten._weight_int8pack_mm`` takes one scale per row, so a grouped weight
    is held as ``[G, N, group]`` and multiplied group by group (G calls of [M, group] x
    [group, N], summed in fp32): each reads its slice of the weight once, as a per-channel one
    would. Up to ``DEQUANT_ROWS`` rows take radixd's C kernel instead
    (``cpu_kernels.int8_matmul``: all groups in one pass, 2x at 8 rows).

  Both are fast only in bf16 (their fp32 and fp16 paths are scalar): activations, scales and
  zeros are bf16, the result is cast back to ``x``'s dtype.

Contract: a ``CpuIntWeight`` is built once and never mutated; ``rows`` (embedding lookups of
a tied int8 table) reads it too; a "records" weight is only ever multiplied where
``cpu_kernels.records()`` held when it was packed (the process's CPU).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from radixd.core import cpu_kernels, cpu_setup

INT4_GROUPS = (32, 64, 128, 256)  # what the int4 kernel takes
DEQUANT_ROWS = 16  # int4 matmuls of more rows dequantize and run a bf16 GEMM; int8 ones of as many take the C kernel
GEMM_ROWS = 64  # "records" int4 weights: more rows dequantize and run a bf16 GEMM where bf16 is native (else the kernel)
# ... or more than this many where the weight has its bf16 copy (``dense``): the default
# model's four projections of 30 layers took 8.7 / 33.8 / 63.8 ms in the int4 kernel at 8 /
# 32 / 64 rows, 8.6 / 10.8 / 13.4 ms as bf16 GEMMs on the copies (two threads)
COPY_GEMM_ROWS = 8
ACT = torch.bfloat16


@dataclass(frozen=True)
class CpuIntWeight:
    """A weight [N, K] packed for the CPU kernels. ``kind`` "torch": int4 ``q`` (torch's packed
    uint8) with ``scales`` [G, N, 2] (scale, zero); int8 ``q`` int8 [G, N, group] with
    ``scales`` [G, N]. ``kind`` "records": ``q`` uint8 [ceil(N / 16), K / 32, record] (radixd's
    q4 / q8 records, ``cpu_kernels.c``: nibbles or bytes with their fp16 scales inline),
    ``scales`` empty. ``dense``: an int4 weight's bf16 copy [K, N] (a view, as
    ``cpu_kernels.qdequant_bf16`` returns it) that prefill's GEMMs read in place of
    dequantizing every step (``with_prefill_copies``); None: dequantized each time."""

    bits: int
    n: int
    k: int
    group_size: int
    q: Tensor
    scales: Tensor
    kind: str = "torch"
    dense: Tensor | None = None

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.scales.nbytes + (self.dense_bytes if self.dense is not None else 0)

    @property
    def dense_bytes(self) -> int:
        """Bytes of a bf16 copy for prefill (``dense``), 0 where prefill takes no copy (int8)."""
        if self.bits != 4:
            return 0
        if self.kind == "records":
            return 2 * self.k * cpu_kernels.padded_ld(self.n) if _bf16_gemms() else 0
        return 2 * self.k * self.n if self.dequantizable else 0

    @property
    def dequantizable(self) -> bool:
        """Whether many rows multiply this torch-packed int4 weight dequantized, in a bf16 GEMM:
        where radixd's kernel reads torch's packing and the CPU multiplies bf16 natively
        (``cpu_setup.native_bf16``). Elsewhere torch's int4 kernel is faster: on an AVX2-only
        CPU a bf16 GEMM took 21x a float32 one (300 x 576 by 576 x 1536: 420 vs 20 ms), the
        int4 kernel 13 ms."""
        return (self.bits == 4 and self.n % 64 == 0 and cpu_kernels.int4pack_readable()
                and cpu_setup.native_bf16())

    def dequantized(self) -> Tensor:
        """The int4 weight in bf16, transposed: [K, N] (a fresh tensor)."""
        if self.kind == "records":
            return cpu_kernels.qdequant_bf16(self.q, self.bits, self.n, self.k)
        return cpu_kernels.int4pack_to_bf16(self.q, self.scales, self.n, self.k, self.group_size)


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
    if cpu_kernels.records():
        packed = _pack_records_weight(qweight, s, None if zeros is None else zeros.float(), bits, g, n, k)
        if packed is not None:
            return packed
    if bits == 4:
        z = zeros.float() if zeros is not None else torch.full_like(s, 8.0)
        q = torch.ops.aten._convert_weight_to_int4pack_for_cpu(unpack_int4(qweight).to(torch.int32).contiguous(), 1)
        sz = torch.stack((s, (8.0 - z) * s), -1).transpose(0, 1).contiguous().to(ACT)
        return CpuIntWeight(4, n, k, g, q, sz)
    if zeros is not None:
        return None  # (no asymmetric int8 kernel)
    q = (qweight.to(torch.int16) - 128).to(torch.int8).view(n, k // g, g).transpose(0, 1).contiguous()
    return CpuIntWeight(8, n, k, g, q, s.t().contiguous().to(ACT))


def _fp16_exact_enough(t: Tensor) -> bool:
    """Whether fp16 holds ``t`` to its own precision (finite, no value in fp16's subnormals)."""
    h = t.half().float()
    return bool(torch.isfinite(h).all() and ((h - t).abs() <= t.abs() * 2.0**-11).all())


def pack_records(q: Tensor, d: Tensor, m: Tensor | None) -> Tensor:
    """Records of ``cpu_kernels.qmm`` from q uint8 [N, K] (int4: 0..15, w = d * q + m; int8:
    u = w / d + 128, ``m`` None) and per-block (32 columns) d, m float [N, K / 32]: uint8
    [ceil(N / 16), K / 32, 320 or 544], columns past N zero."""
    n, k = q.shape
    pad = -n % 16
    if pad:
        q = torch.cat((q, torch.zeros(pad, k, dtype=q.dtype)))
        d = torch.cat((d, torch.zeros(pad, d.shape[1], dtype=d.dtype)))
        m = None if m is None else torch.cat((m, torch.zeros(pad, m.shape[1], dtype=m.dtype)))
    c, b = q.shape[0] // 16, k // 32

    def half(t: Tensor) -> Tensor:  # [N, B] -> [C, B, 32] bytes: a record's 16 fp16 values
        return t.view(c, 16, b).permute(0, 2, 1).contiguous().half().view(torch.uint8)

    if m is not None:  # chunk j, lane l, byte i: k = 32b + 8j + 4h + i, h the nibble
        v = q.view(c, 16, b, 4, 2, 4).permute(0, 2, 3, 1, 5, 4)
        qs = (v[..., 0] | (v[..., 1] << 4)).reshape(c, b, 256)
        return torch.cat((qs, half(d), half(m)), -1).contiguous()
    qs = q.view(c, 16, b, 8, 4).permute(0, 2, 3, 1, 4).reshape(c, b, 512)  # k = 32b + 4j + i
    return torch.cat((qs, half(d)), -1).contiguous()


def _pack_records_weight(qweight: Tensor, s: Tensor, z: Tensor | None, bits: int, g: int, n: int, k: int
                      ) -> CpuIntWeight | None:
    from radixd.core.quant.ops import unpack_int4

    if g % 32 or k % 32:
        return None
    d = s.repeat_interleave(g // 32, 1)
    if bits == 4:
        m = (-(z if z is not None else torch.full_like(s, 8.0)) * s).repeat_interleave(g // 32, 1)
        if not (_fp16_exact_enough(d) and _fp16_exact_enough(m)):
            return None
        return CpuIntWeight(4, n, k, g, pack_records(unpack_int4(qweight), d, m), torch.empty(0), "records")
    if z is not None or not _fp16_exact_enough(d):
        return None
    return CpuIntWeight(8, n, k, g, pack_records(qweight.view(torch.uint8), d, None), torch.empty(0), "records")


def _bf16_gemms() -> bool:
    """Whether "records" int4 weights of many rows (and their prefill copies) are dequantized
    for bf16 GEMMs: where the CPU multiplies bf16 natively and the dequantization kernel (VNNI
    code) runs; with AVX2 only the FMA kernel takes every row count."""
    return cpu_kernels.vnni() and cpu_setup.native_bf16()


def cpu_int_linear(x: Tensor, w: CpuIntWeight, bias: Tensor | None = None) -> Tensor:
    """``x @ W.T + bias`` for x [M, K] (any float dtype; computed in bf16 or, for a "records"
    weight, in radixd's kernels; returned in x's dtype). No rows (a prefill
    chunk that computes no logits): no kernel call."""
    if x.shape[0] == 0:
        y = x.new_empty((0, w.n))
        return y if bias is None else y + bias
    if w.kind == "records":
        y = records_linear(x, w)
        return y if bias is None else y + bias
    xa = x.to(ACT).contiguous()
    if w.bits == 4 and xa.shape[0] > DEQUANT_ROWS and w.dense is not None:
        y = xa @ w.dense
    elif xa.shape[0] > DEQUANT_ROWS and w.dequantizable:
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


def records_linear(x: Tensor, w: CpuIntWeight, silu: bool = False) -> Tensor:
    """``x @ W.T`` for a "records" weight (``silu``: of SiLU(gate) * up, x [M, 2K] gate | up)."""
    if x.shape[0] == 0:
        return x.new_empty((0, w.n))
    xa = x if x.dtype in (torch.float32, torch.bfloat16) and x.stride(-1) == 1 else x.float().contiguous()
    gemm = w.dense is not None or (_bf16_gemms() and xa.shape[0] > GEMM_ROWS)
    if w.bits == 4 and gemm and xa.shape[0] > COPY_GEMM_ROWS:
        # many rows (a prefill): one bf16 GEMM on the weight dequantized (or its copy)
        if silu:
            xa = cpu_kernels.silu_mul(xa.to(ACT))
        dense = w.dense if w.dense is not None else cpu_kernels.qdequant_bf16(w.q, w.bits, w.n, w.k, scratch=True)
        y = xa.to(ACT) @ dense
    else:
        y = cpu_kernels.qmm(xa, w.q, w.bits, w.n, w.k, silu=silu)
    return y.to(x.dtype)


def rows(w: CpuIntWeight, ids: Tensor, dtype: torch.dtype) -> Tensor:
    """Rows ``ids`` of an int8 ``w`` dequantized (an embedding lookup: only these rows are read)."""
    if w.bits != 8:
        raise ValueError("rows: only int8 weights keep their rows readable (int4 is in the kernel's tile order)")
    flat = ids.reshape(-1)
    if w.kind == "records":  # row n: lane n % 16 of record group n // 16, in every block
        blocks, rec = w.q.shape[1], w.q.shape[2]
        lane = flat % 16
        start = (flat // 16 * blocks)[:, None] * rec + torch.arange(blocks) * rec  # [T, B]: the records
        qi = (start + 4 * lane[:, None])[:, :, None, None] + (torch.arange(8) * 64)[:, None] + torch.arange(4)
        di = (start + 512) // 2 + lane[:, None]  # fp16 d in the records' halves
        flat_q = w.q.view(-1)
        q = (flat_q[qi].reshape(-1, blocks, 32).float() - 128) * flat_q.view(torch.float16)[di].float()[..., None]
        return q.reshape(*ids.shape, w.k).to(dtype)
    q = w.q[:, flat].float() * w.scales[:, flat, None].float()  # [G, T, group]
    return q.transpose(0, 1).reshape(*ids.shape, w.k).to(dtype)


PREFILL_COPY_MAX = 1 << 30  # "auto": copies of at most this many bytes (and an eighth of the memory)


def prefill_copy_wanted(mode: str, total: int) -> bool:
    """Whether int4 weights keep bf16 copies for prefill (``[model] prefill_weights``): "bf16"
    always, "dequantize" never, "auto" where the copies (``total`` bytes) take at most
    ``PREFILL_COPY_MAX`` and an eighth of the machine's memory."""
    if mode != "auto":
        return mode == "bf16"
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        memory = 0
    return 0 < total <= min(PREFILL_COPY_MAX, memory // 8)


def with_prefill_copies(weights: list[CpuIntWeight], mode: str) -> list[CpuIntWeight]:
    """``weights``, the int4 ones with a bf16 copy for prefill's GEMMs where ``mode`` wants
    them (``prefill_copy_wanted``, on all their copies' bytes): the same values each prefill
    step would dequantize, read in place instead (a prefill step of the default model
    dequantized 106M weights, a fifth of a 4 x 32-token extend's time), at 2 bytes a weight
    more memory; decode steps still read the int4 records."""
    if not prefill_copy_wanted(mode, sum(w.dense_bytes for w in weights)):
        return weights
    return [replace(w, dense=w.dequantized()) if w.dense_bytes else w for w in weights]
