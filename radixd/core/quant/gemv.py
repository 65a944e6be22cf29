"""Matrix-vector kernels for quantized weights: ``y = x @ W.T`` for a few rows of x (up to
4; ``ops`` sends GEMV_MAX_M = 1, decode at batch 1), the dequantization fused into the
weight read.

Batch-1 decode is bound by the bytes of weight read per step, so each program streams a few
weight rows in long contiguous runs (``BLOCK_K`` columns per step, a few KB per load),
dequantizes them in registers and reuses the tile for every row of x; no tensor cores, no
shared memory, thousands of programs over N so that every SM has loads in flight. Scales
apply per sub-block of ``SUB`` columns (a quantization group, or the whole step where the
group is wider): ``sum_k (q_k - z) s x_k = s (sum_k q_k x_k - z sum_k x_k)`` over a group, so
the per-element work is a conversion and an FMA.

* fp8 (``fp8_gemv``): x stays in its own dtype (a GEMV needs no fp8 operand, and this is
  closer to the unquantized product than ``ops.fp8_linear_reference``'s fake-quantized x).
* int4 / int8 (``int_gemv``): zero point and scale per group, x gathered through ``perm``
  once before the kernel; each int4 word loaded once and spread to its 8 columns by ``unpack_int4_tile``
  (interleaves keep a word's copies in the thread that loaded it; on an H200 this beat
  multiplying nibble planes with x's strided columns). Weights are small integers,
  converted by ``small_uint_to_f32``.

Callers are ``ops``' dispatch: shapes and dtypes are checked there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

GEMV_MAX_M = 1  # rows of x ``ops`` sends here; 2..4 rows ran slower than the GEMMs on an H200
SCALE_TENSOR, SCALE_CHANNEL, SCALE_BLOCK = 0, 1, 2


@triton.jit
def small_uint_to_f32(q):
    """int32 values 0..2**23 - 1 -> fp32, exactly: the bits OR'd into 2**23's mantissa, less
    2**23 (an OR and an add at full rate, where the int-to-float conversion runs at a quarter)."""
    return (q | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def unpack_int4_tile(words, BLOCK_K: tl.constexpr):
    """int32 words [R, BLOCK_K // 8] -> their nibbles [R, BLOCK_K] in column order (nibble
    k % 8 of word k // 8): each word repeated 8 times by three interleaves, then shifted."""
    words = tl.interleave(words, words)
    words = tl.interleave(words, words)
    words = tl.interleave(words, words)
    return (words >> ((tl.arange(0, BLOCK_K) % 8) * 4)[None, :]) & 0xF


@triton.jit
def _row_part(w, X, m, K, stride_xm, cols, S_sub, Z_sub, HAS_ZERO: tl.constexpr, EVEN_K: tl.constexpr,
              SCALED: tl.constexpr, BLOCK_N: tl.constexpr, NSUB: tl.constexpr, SUB: tl.constexpr):
    """One x row's contribution of a [BLOCK_N, BLOCK_K] weight tile ``w`` (fp32, unscaled):
    [BLOCK_N]; with SCALED, sum over sub-blocks of ``S_sub`` * (w . x - ``Z_sub`` * sum x)."""
    if EVEN_K:
        x = tl.load(X + m * stride_xm + cols).to(tl.float32)
    else:
        x = tl.load(X + m * stride_xm + cols, mask=cols < K, other=0.0).to(tl.float32)
    prod = w * x[None, :]
    if SCALED:
        part = tl.sum(tl.reshape(prod, (BLOCK_N, NSUB, SUB)), 2)
        if HAS_ZERO:
            xs = tl.sum(tl.reshape(x, (NSUB, SUB)), 1)
            part = part - Z_sub * xs[None, :]
        return tl.sum(part * S_sub, 1)
    return tl.sum(prod, 1)


@triton.jit
def _gemv_kernel(X, W, S, Z, Bias, Y, M, N, K, stride_xm, stride_w, stride_s, stride_ym,
                 FP8: tl.constexpr, BITS: tl.constexpr, SCALE: tl.constexpr, SCALE_ROWS: tl.constexpr,
                 GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_BIAS: tl.constexpr,
                 EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Y[:M, tile] for one tile of BLOCK_N weight rows. FP8: W fp8 [N, K], S per SCALE
    (tensor []; channel [N]; block [ceil(N / SCALE_ROWS), ceil(K / GROUP)]). Else int: W int32
    [N, K // 8] (BITS 4) or uint8 [N, K] (BITS 8), S and Z [N, K // GROUP]."""
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_n = tl.where(mask_n, offs_n, 0)  # (masked rows read row 0: no masks on the weight loads)
    offs_m = tl.arange(0, BLOCK_M)
    SUB: tl.constexpr = BLOCK_K if BLOCK_K < GROUP else GROUP
    NSUB: tl.constexpr = BLOCK_K // SUB
    SCALED: tl.constexpr = (not FP8) or SCALE == 2
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        if FP8:
            ptrs = W + offs_n[:, None] * stride_w + cols[None, :]
            if EVEN_K:
                w = tl.load(ptrs).to(tl.float32)
            else:
                w = tl.load(ptrs, mask=cols[None, :] < K, other=0.0).to(tl.float32)
        elif BITS == 4:
            words = tl.load(W + offs_n[:, None] * stride_w + k0 // 8 + tl.arange(0, BLOCK_K // 8)[None, :])
            w = small_uint_to_f32(unpack_int4_tile(words, BLOCK_K))
        else:
            w = small_uint_to_f32(tl.load(W + offs_n[:, None] * stride_w + cols[None, :]).to(tl.int32))
        s_sub = tl.zeros([BLOCK_N, NSUB], dtype=tl.float32)
        z_sub = tl.zeros([BLOCK_N, NSUB], dtype=tl.float32)
        if SCALED:
            g = (k0 + tl.arange(0, NSUB) * SUB) // GROUP
            if FP8:
                s_ptrs = S + (offs_n // SCALE_ROWS)[:, None] * stride_s + g[None, :]
                s_sub = tl.load(s_ptrs, mask=(k0 + tl.arange(0, NSUB) * SUB < K)[None, :], other=0.0)
            else:
                s_sub = tl.load(S + offs_n[:, None] * stride_s + g[None, :]).to(tl.float32)
                if HAS_ZERO:
                    z_sub = tl.load(Z + offs_n[:, None] * stride_s + g[None, :]).to(tl.float32)
                else:
                    z_sub += 2 ** (BITS - 1)
        for m in tl.static_range(BLOCK_M):
            if m < M:
                part = _row_part(w, X, m, K, stride_xm, cols, s_sub, z_sub, HAS_ZERO or not FP8, EVEN_K, SCALED,
                                 BLOCK_N, NSUB, SUB)
                acc += tl.where(offs_m[None, :] == m, part[:, None], 0.0)
    if FP8 and SCALE == 0:
        acc *= tl.load(S)
    if FP8 and SCALE == 1:
        acc *= tl.load(S + offs_n)[:, None]
    if HAS_BIAS:
        acc += tl.load(Bias + offs_n).to(tl.float32)[:, None]
    tl.store(Y + offs_m[None, :] * stride_ym + offs_n[:, None], acc.to(Y.dtype.element_ty),
             mask=mask_n[:, None] & (offs_m < M)[None, :])


def k_step(limit: int, group: int) -> int:
    """Columns per step: ``limit`` (a power of two) where it and ``group`` nest, else the
    largest power of two dividing ``group`` (so that a step never straddles two groups)."""
    if limit % group == 0 or group % limit == 0:
        return limit
    return group & -group


def gemv_tiles(kind: str, m: int, k: int, group: int | None) -> tuple[int, int, int]:
    """(weight rows per program, K per step, warps) for ``kind`` in fp8/int4/int8 with scale
    groups of ``group`` columns (None: none along K): 4 or 8 KB of weight per step and row
    tile (8 KB, 2048 columns, measured faster for fp8 and int8 at the 8B shapes on an H200),
    fewer columns per step for more rows of x (registers)."""
    limit = min((1024 if kind == "int4" else 2048) // triton.next_power_of_2(m), triton.next_power_of_2(k))
    bk = limit if group is None else k_step(limit, group)
    while group is not None and k % bk:  # (a step wider than a group: K may hold fewer such steps)
        bk //= 2
    rows = {"fp8": 4, "int4": 8, "int8": 4}[kind]
    return max(1, rows * limit // bk) if bk < limit else rows, bk, 4


def _launch(x, w, s, z, bias, n, k, *, fp8, bits, scale, scale_rows, group, tiles):
    m = x.shape[0]
    if m > 4:
        raise ValueError(f"GEMV: {m} rows of x, at most 4 (more go to the GEMM kernels)")
    bn, bk, warps = tiles
    if (scale == SCALE_BLOCK and bk % group and group % bk) or (not fp8 and k % bk):
        raise ValueError(f"GEMV: K step {bk} and scale groups of {group} columns (K={k}) do not nest")
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, bn),)](
        x, w, s, z if z is not None else s, bias if bias is not None else s, y,
        m, n, k, x.stride(0), w.stride(0), s.stride(0) if s.dim() == 2 else 0, y.stride(0),
        FP8=fp8, BITS=bits, SCALE=scale, SCALE_ROWS=scale_rows, GROUP=group, HAS_ZERO=z is not None,
        HAS_BIAS=bias is not None, EVEN_K=k % bk == 0,
        BLOCK_M=triton.next_power_of_2(m), BLOCK_N=bn, BLOCK_K=bk, num_warps=warps)
    return y


def fp8_gemv(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, block: tuple[int, int] | None,
             bias: torch.Tensor | None, *, tiles: tuple[int, int, int] | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` for an fp8 weight (``ops``' layout), x [M <= 4, K] unquantized."""
    n, k = weight.shape
    if block is not None:
        scale, rows, group = SCALE_BLOCK, block[0], block[1]
    else:
        scale, rows, group = (SCALE_CHANNEL if weight_scale.dim() == 1 else SCALE_TENSOR), 1, k
    if tiles is None:
        tiles = gemv_tiles("fp8", x.shape[0], k, group if block is not None else None)
    return _launch(x, weight, weight_scale, None, bias, n, k, fp8=True, bits=8, scale=scale, scale_rows=rows,
                   group=group, tiles=tiles)


def int_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, bits: int,
             group_size: int, perm: torch.Tensor | None, bias: torch.Tensor | None, *,
             tiles: tuple[int, int, int] | None = None) -> torch.Tensor:
    """``x[:, perm] @ W.T + bias`` for an int4/int8 weight (``ops``' layout), x [M <= 4, K]."""
    n, k = qweight.shape[0], x.shape[1]
    tiles = tiles or gemv_tiles(f"int{bits}", x.shape[0], k, group_size)
    if bits == 4 and tiles[1] % 8:
        raise ValueError(f"int4 GEMV: K step {tiles[1]} is not a multiple of 8 (group_size {group_size})")
    if perm is not None:  # (one gather of x's columns up front: per program, they would be scattered reads)
        x = x.index_select(1, perm)
    return _launch(x, qweight, scales, zeros, bias, n, k, fp8=False, bits=bits, scale=SCALE_BLOCK, scale_rows=1,
                   group=group_size, tiles=tiles)
