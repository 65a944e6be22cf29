"""Weight-only int4/int8 GEMM (W4A16 / W8A16) for batches of a few to a few hundred rows:
each K step loads a tile of packed weights, dequantizes it in registers (``(q - z) * s`` per
group, rounded to x's dtype) and feeds it to a 16-bit ``tl.dot`` with fp32 accumulation.
int4 words are loaded once and spread to their columns by ``gemv.unpack_int4_tile``. A
step within one group takes one scale and zero point per weight
row; a step wider than a group (groups of 32 or 64 columns) reads each column's. A last
group shorter than the others (K not a multiple of ``group_size``) needs nothing special. With
``perm`` (GPTQ act-order) x's columns are gathered through it: the weight stays in its
stored order.

Callers are ``ops``' dispatch: shapes and dtypes are checked there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixd.core.quant.fp8_gemm import grouped_tile
from radixd.core.quant.gemv import small_uint_to_f32, unpack_int4_tile


@triton.jit
def _int_gemm_kernel(X, Perm, QW, S, Z, Bias, Y, M, N, K, stride_xm, stride_qw, stride_s, stride_ym,
                     BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_PERM: tl.constexpr,
                     HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    rows_x = tl.where(mask_m, offs_m, 0)  # (out-of-range rows read row 0; not stored)
    rows_w = tl.where(mask_n, offs_n, 0)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        mask_k = cols < K
        xk = cols
        if HAS_PERM:
            xk = tl.load(Perm + cols) if EVEN_K else tl.load(Perm + cols, mask=mask_k, other=0)
        if EVEN_K:
            x = tl.load(X + rows_x[:, None] * stride_xm + xk[None, :])
        else:  # (x's columns past K are 0: the weights there may be anything)
            x = tl.load(X + rows_x[:, None] * stride_xm + xk[None, :], mask=mask_k[None, :], other=0.0)
        if BITS == 4:
            words_k = k0 // 8 + tl.arange(0, BLOCK_K // 8)
            w_ptrs = QW + rows_w[:, None] * stride_qw + words_k[None, :]
            if EVEN_K:
                words = tl.load(w_ptrs)
            else:
                words = tl.load(w_ptrs, mask=(words_k * 8 < K)[None, :], other=0)
            q = unpack_int4_tile(words, BLOCK_K)
        elif EVEN_K:
            q = tl.load(QW + rows_w[:, None] * stride_qw + cols[None, :])
        else:
            q = tl.load(QW + rows_w[:, None] * stride_qw + cols[None, :], mask=mask_k[None, :], other=0)
        if BLOCK_K <= GROUP:  # one scale (and zero point) per weight row this step
            g_ptrs = rows_w[:, None] * stride_s + k0 // GROUP
        else:  # the step spans several groups: each column's own
            g_ptrs = rows_w[:, None] * stride_s + (tl.minimum(cols, K - 1) // GROUP)[None, :]
        s = tl.load(S + g_ptrs).to(tl.float32)
        if HAS_ZERO:
            z = tl.load(Z + g_ptrs).to(tl.float32)
        else:
            z = 2 ** (BITS - 1)
        w = ((small_uint_to_f32(q.to(tl.int32)) - z) * s).to(X.dtype.element_ty)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(Bias + rows_w).to(tl.float32)[None, :]
    tl.store(Y + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(Y.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


def gemm_tiles(m: int, n: int, group_size: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) by row count: narrow tiles while the weight
    read dominates (enough programs over N for every SM), wider ones as rows grow; the K step
    128 columns; K need not be a multiple of it."""
    if m <= 16:
        bm, bn, warps, stages = 16, 64, 4, 4
    elif m <= 64:  # (measured on an H200, int8: wide tiles for the 28672-row projection)
        bm, bn, warps, stages = (64, 128, 4, 3) if n >= 16384 else (64, 32, 4, 4)
    elif m <= 256:
        bm, bn, warps, stages = 64, 128, 4, 3
    else:
        bm, bn, warps, stages = 128, 128, 8, 3
    return bm, bn, 128, warps, stages


def int_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, bits: int,
             group_size: int, perm: torch.Tensor | None, bias: torch.Tensor | None, *,
             tiles: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """``ops.int_weight_linear`` through ``_int_gemm_kernel``."""
    m, k = x.shape
    n = qweight.shape[0]
    bm, bn, bk, warps, stages = tiles or gemm_tiles(m, n, group_size)
    if bk < 16 or (group_size < k and group_size % bk and bk % group_size):
        raise ValueError(f"int GEMM: K step {bk} must be >= 16 (tl.dot) and nest with group_size {group_size}")
    if perm is not None:  # (one gather of x's columns up front: per tile, they would be scattered reads)
        x, perm = x.index_select(1, perm), None
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    _int_gemm_kernel[grid](
        x, perm if perm is not None else x, qweight, scales, zeros if zeros is not None else scales,
        bias if bias is not None else scales, y, m, n, k, x.stride(0), qweight.stride(0), scales.stride(0),
        y.stride(0), BITS=bits, GROUP=group_size, HAS_ZERO=zeros is not None, HAS_PERM=perm is not None,
        HAS_BIAS=bias is not None, EVEN_K=k % bk == 0, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=warps, num_stages=stages)
    return y
