"""Weight-only int4/int8 GEMM (W4A16 / W8A16) for batches of a few to a few hundred rows:
each K step loads a tile of packed weights, dequantizes it in registers (nibbles by shifts of
whole int32 words, ``(q - z) * s`` per group, rounded to x's dtype) and feeds it to a 16-bit
``tl.dot`` with fp32 accumulation. A K step never straddles a group (its width divides
``group_size``), so a step's scales and zero points are one per weight row. With ``perm``
(GPTQ act-order) the x tile is gathered through it: the weight stays in its stored order.

Callers are ``ops``' dispatch: shapes and dtypes are checked there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _int_gemm_kernel(X, Perm, QW, S, Z, Bias, Y, M, N, K, stride_xm, stride_qw, stride_s, stride_ym,
                     BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_PERM: tl.constexpr,
                     HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * tiles_n
    first_m = (pid // in_group) * GROUP_M
    size_m = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % size_m
    pid_n = (pid % in_group) // size_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    rows_x = tl.where(mask_m, offs_m, 0)  # (out-of-range rows read row 0; not stored)
    rows_w = tl.where(mask_n, offs_n, 0)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        if HAS_PERM:
            cols = tl.load(Perm + cols)
        x = tl.load(X + rows_x[:, None] * stride_xm + cols[None, :])
        if BITS == 4:
            words = tl.load(QW + rows_w[:, None] * stride_qw + k0 // 8 + tl.arange(0, BLOCK_K // 8)[None, :])
            nib = (words[:, :, None] >> (tl.arange(0, 8) * 4)[None, None, :]) & 0xF
            q = tl.reshape(nib, (BLOCK_N, BLOCK_K))
        else:
            q = tl.load(QW + rows_w[:, None] * stride_qw + k0 + tl.arange(0, BLOCK_K)[None, :])
        g = k0 // GROUP
        s = tl.load(S + rows_w * stride_s + g).to(tl.float32)
        if HAS_ZERO:
            z = tl.load(Z + rows_w * stride_s + g).to(tl.float32)
        else:
            z = tl.zeros([BLOCK_N], dtype=tl.float32) + 2 ** (BITS - 1)
        w = ((q.to(tl.float32) - z[:, None]) * s[:, None]).to(X.dtype.element_ty)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(Bias + rows_w).to(tl.float32)[None, :]
    tl.store(Y + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(Y.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


def gemm_tiles(m: int, n: int, group_size: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) by row count: narrow tiles while the weight
    read dominates (enough programs over N for every SM), wider ones as rows grow; the K step
    the largest power of two <= 128 dividing ``group_size``."""
    if m <= 16:
        bm, bn, warps, stages = 16, 32, 4, 4
    elif m <= 64:
        bm, bn, warps, stages = 64, 64, 4, 4
    elif m <= 256:
        bm, bn, warps, stages = 64, 128, 4, 3
    else:
        bm, bn, warps, stages = 128, 128, 8, 3
    return bm, bn, min(128, group_size & -group_size), warps, stages


def int_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, bits: int,
             group_size: int, perm: torch.Tensor | None, bias: torch.Tensor | None, *,
             tiles: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """``ops.int_weight_linear`` through ``_int_gemm_kernel``."""
    m, k = x.shape
    n = qweight.shape[0]
    bm, bn, bk, warps, stages = tiles or gemm_tiles(m, n, group_size)
    if bk < 16 or group_size % bk:
        raise ValueError(f"int GEMM: K step {bk} must be >= 16 and divide group_size {group_size}")
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    _int_gemm_kernel[grid](
        x, perm if perm is not None else x, qweight, scales, zeros if zeros is not None else scales,
        bias if bias is not None else scales, y, m, n, k, x.stride(0), qweight.stride(0), scales.stride(0),
        y.stride(0), BITS=bits, GROUP=group_size, HAS_ZERO=zeros is not None, HAS_PERM=perm is not None,
        HAS_BIAS=bias is not None, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=warps, num_stages=stages)
    return y
