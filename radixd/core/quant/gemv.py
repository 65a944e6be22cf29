"""Matrix-vector kernels for quantized weights: ``y = x @ W.T`` for 1..GEMV_MAX_M rows of x
(decode at batch 1 and a few), the dequantization fused into the weight read.

Batch-1 decode is bound by the bytes of weight read per step, so each program streams a few
weight rows in long contiguous runs (``BLOCK_K`` columns per step, a few KB per load),
dequantizes them in registers and reuses the tile for every row of x; no tensor cores, no
shared memory, thousands of programs over N so that every SM has loads in flight. Scales
apply per sub-block of ``SUB`` columns (a quantization group, or the whole step where the
group is wider): ``sum_k (q_k - z) s x_k = s (sum_k q_k x_k - z sum_k x_k)`` over a group, so
the per-element work is one convert and one FMA.

* fp8 (``fp8_gemv``): x stays in its own dtype (a GEMV needs no fp8 operand, and this is
  closer to the unquantized product than ``ops.fp8_linear_reference``'s fake-quantized x).
* int4 / int8 (``int_gemv``): each int32 word loaded once and its nibbles taken by shifts
  in the thread that loaded it (``_gemv_kernel``'s planes), zero point and scale per group,
  ``perm`` read as x's column order.

Callers are ``ops``' dispatch: shapes and dtypes are checked there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

GEMV_MAX_M = 4             # rows of x a GEMV takes; more go to the GEMM kernels
SCALE_TENSOR, SCALE_CHANNEL, SCALE_BLOCK = 0, 1, 2


@triton.jit
def _gemv_kernel(X, Perm, W, S, Z, Bias, Y, M, N, K, stride_xm, stride_w, stride_s, stride_ym,
                 FP8: tl.constexpr, BITS: tl.constexpr, SCALE: tl.constexpr, SCALE_ROWS: tl.constexpr,
                 GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_PERM: tl.constexpr, HAS_BIAS: tl.constexpr,
                 EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Y[:M, tile] for one tile of BLOCK_N weight rows. FP8: W fp8 [N, K], S per SCALE
    (tensor []; channel [N]; block [ceil(N / SCALE_ROWS), ceil(K / GROUP)]). Else int: W int32
    [N, K // 8] (BITS 4) or uint8 [N, K] (BITS 8), S and Z [N, K // GROUP].

    A step's weights are taken as PLANES planes of BLOCK_K // PLANES columns: int4's plane p
    is nibble p of each word (columns k0 + 8j + p), read from the words in registers, and x
    is read at the same columns, so no nibble ever moves between threads (one plane, the
    plain columns, for fp8 and int8). The planes' products add up elementwise; the sums over
    each scale group's columns come after the last plane."""
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_n = tl.where(mask_n, offs_n, 0)  # (masked rows read row 0: no masks on the weight loads)
    offs_m = tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    PLANES: tl.constexpr = 8 if BITS == 4 else 1
    WIDTH: tl.constexpr = BLOCK_K // PLANES
    SUB: tl.constexpr = BLOCK_K if BLOCK_K < GROUP else GROUP
    NSUB: tl.constexpr = BLOCK_K // SUB
    SCALED: tl.constexpr = (not FP8) or SCALE == 2
    j = tl.arange(0, WIDTH)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if BITS == 4:
            words = tl.load(W + offs_n[:, None] * stride_w + k0 // 8 + j[None, :])
        tot = tl.zeros([BLOCK_M, BLOCK_N, WIDTH], dtype=tl.float32)
        xsum = tl.zeros([BLOCK_M, NSUB], dtype=tl.float32)
        for p in tl.static_range(PLANES):
            cols = k0 + j * PLANES + p
            if BITS == 4:
                w = ((words >> (4 * p)) & 0xF).to(tl.float32)
            elif EVEN_K:
                w = tl.load(W + offs_n[:, None] * stride_w + cols[None, :]).to(tl.float32)
            else:
                w = tl.load(W + offs_n[:, None] * stride_w + cols[None, :], mask=cols[None, :] < K,
                            other=0.0).to(tl.float32)
            xk = cols
            if HAS_PERM:
                xk = tl.load(Perm + cols)
            mask_x = mask_m[:, None] if EVEN_K else mask_m[:, None] & (cols < K)[None, :]
            x = tl.load(X + offs_m[:, None] * stride_xm + xk[None, :], mask=mask_x, other=0.0).to(tl.float32)
            tot += w[None, :, :] * x[:, None, :]
            if not FP8:
                xsum += tl.sum(tl.reshape(x, (BLOCK_M, NSUB, SUB // PLANES)), 2)
        if SCALED:
            part = tl.sum(tl.reshape(tot, (BLOCK_M, BLOCK_N, NSUB, SUB // PLANES)), 3)
            g = (k0 + tl.arange(0, NSUB) * SUB) // GROUP
            if FP8:
                s_ptrs = S + (offs_n // SCALE_ROWS)[:, None] * stride_s + g[None, :]
                s_sub = tl.load(s_ptrs, mask=(k0 + tl.arange(0, NSUB) * SUB < K)[None, :], other=0.0)
            else:
                s_sub = tl.load(S + offs_n[:, None] * stride_s + g[None, :]).to(tl.float32)
                if HAS_ZERO:
                    z_sub = tl.load(Z + offs_n[:, None] * stride_s + g[None, :]).to(tl.float32)
                else:
                    z_sub = tl.zeros([BLOCK_N, NSUB], dtype=tl.float32) + 2 ** (BITS - 1)
                part -= z_sub[None, :, :] * xsum[:, None, :]
            acc += tl.sum(part * s_sub[None, :, :], 2)
        else:
            acc += tl.sum(tot, 2)
    if FP8 and SCALE == 0:
        acc *= tl.load(S)
    if FP8 and SCALE == 1:
        acc *= tl.load(S + offs_n)[None, :]
    if HAS_BIAS:
        acc += tl.load(Bias + offs_n).to(tl.float32)[None, :]
    tl.store(Y + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(Y.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


def k_step(limit: int, group: int) -> int:
    """Columns per step: ``limit`` (a power of two) where it and ``group`` nest, else the
    largest power of two dividing ``group`` (so that a step never straddles two groups)."""
    if limit % group == 0 or group % limit == 0:
        return limit
    return group & -group


def gemv_tiles(kind: str, m: int, k: int, group: int | None) -> tuple[int, int, int]:
    """(weight rows per program, K per step, warps) for ``kind`` in fp8/int4/int8 with scale
    groups of ``group`` columns (None: none along K): about 4 KB of weight per step and row
    tile, fewer columns per step for more rows of x (registers)."""
    limit = min(1024 // triton.next_power_of_2(m), triton.next_power_of_2(k))
    bk = limit if group is None else k_step(limit, group)
    while group is not None and k % bk:  # (a step wider than a group: K may hold fewer such steps)
        bk //= 2
    rows = {"fp8": 4, "int4": 8, "int8": 4}[kind]
    return max(1, rows * limit // bk) if bk < limit else rows, bk, 4


def _launch(x, w, s, z, bias, perm, n, k, *, fp8, bits, scale, scale_rows, group, tiles):
    m = x.shape[0]
    bn, bk, warps = tiles
    if (scale == SCALE_BLOCK and bk % group and group % bk) or (not fp8 and k % bk):
        raise ValueError(f"GEMV: K step {bk} and scale groups of {group} columns (K={k}) do not nest")
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, bn),)](
        x, perm if perm is not None else x, w, s, z if z is not None else s, bias if bias is not None else s, y,
        m, n, k, x.stride(0), w.stride(0), s.stride(0) if s.dim() == 2 else 0, y.stride(0),
        FP8=fp8, BITS=bits, SCALE=scale, SCALE_ROWS=scale_rows, GROUP=group, HAS_ZERO=z is not None,
        HAS_PERM=perm is not None, HAS_BIAS=bias is not None, EVEN_K=k % bk == 0,
        BLOCK_M=triton.next_power_of_2(m), BLOCK_N=bn, BLOCK_K=bk, num_warps=warps)
    return y


def fp8_gemv(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, block: tuple[int, int] | None,
             bias: torch.Tensor | None, *, tiles: tuple[int, int, int] | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` for an fp8 weight (``ops``' layout), x [M <= GEMV_MAX_M, K] unquantized."""
    n, k = weight.shape
    if block is not None:
        scale, rows, group = SCALE_BLOCK, block[0], block[1]
    else:
        scale, rows, group = (SCALE_CHANNEL if weight_scale.dim() == 1 else SCALE_TENSOR), 1, k
    if tiles is None:
        tiles = gemv_tiles("fp8", x.shape[0], k, group if block is not None else None)
    return _launch(x, weight, weight_scale, None, bias, None, n, k, fp8=True, bits=8, scale=scale, scale_rows=rows,
                   group=group, tiles=tiles)


def int_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, bits: int,
             group_size: int, perm: torch.Tensor | None, bias: torch.Tensor | None, *,
             tiles: tuple[int, int, int] | None = None) -> torch.Tensor:
    """``x[:, perm] @ W.T + bias`` for an int4/int8 weight (``ops``' layout), x [M <= GEMV_MAX_M, K]."""
    n, k = qweight.shape[0], x.shape[1]
    tiles = tiles or gemv_tiles(f"int{bits}", x.shape[0], k, group_size)
    if bits == 4 and tiles[1] % 8:
        raise ValueError(f"int4 GEMV: K step {tiles[1]} is not a multiple of 8 (group_size {group_size})")
    return _launch(x, qweight, scales, zeros, bias, perm, n, k, fp8=False, bits=bits, scale=SCALE_BLOCK, scale_rows=1,
                   group=group_size, tiles=tiles)
