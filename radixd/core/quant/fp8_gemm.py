"""fp8 GEMM on the tensor cores: ``y = dequant(q(x)) @ dequant(W).T`` with x quantized to fp8
per token (or per token and group of columns) by a small kernel, then one tiled GEMM of fp8
operands with fp32 accumulation (Hopper's fp8 wgmma; mma on Ada).

* ``quantize_act`` (``_act_quant_kernel``): x [M, K] -> fp8 [M, K] and fp32 scales, exactly
  ``ops.quantize_act_fp8``'s rule (``max(amax, AMAX_EPS) / FP8_MAX``, x / scale rounded to
  nearest in fp32): one program per row (two passes over it) or per (row, group).
* ``_fp8_gemm_kernel``: per-tensor and per-channel weight scales and the per-token activation
  scale apply once, in the epilogue; block weights (``[ceil(N/bn), ceil(K/bk)]`` scales) apply
  per K step, whose width divides bk, to the step's partial product: ``acc += dot * sx[m] *
  sw[n // bn]``.

Callers are ``ops``' dispatch: shapes and dtypes are checked there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixd.core.quant import AMAX_EPS, FP8, FP8_MAX

_EPS = tl.constexpr(AMAX_EPS)
_QMAX = tl.constexpr(FP8_MAX)


@triton.jit
def _round_e4m3(v):
    """``v`` (fp32, |v| <= 448) rounded to nearest-even on e4m3's grid, still fp32: adding
    c = 1.5 * 2**(e + 20) leaves 3 mantissa bits of an exponent-e value (``e`` at least -6,
    the subnormals' spacing), so the following fp8 conversion is exact. (The Triton
    interpreter's own fp32 -> fp8 conversion drops the carry into the next power of two.)"""
    e = ((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    c = (((tl.maximum(e, -6) + 147) << 23) | (1 << 22)).to(tl.float32, bitcast=True)
    return (v + c) - c


@triton.jit
def _act_quant_kernel(X, Q, S, K, stride_x, stride_q, stride_s, GROUP: tl.constexpr, PER_ROW: tl.constexpr,
                      BLOCK: tl.constexpr, ROUND: tl.constexpr = True):
    """Per row (PER_ROW): the row in one BLOCK >= K held in registers where it fits, else two
    passes over it; else one group of GROUP columns (program (row, group)). ``ROUND``: the
    values rounded to e4m3's grid before the conversion (the interpreter's conversion needs
    it; a GPU's rounds to nearest-even itself)."""
    row = tl.program_id(0)
    if PER_ROW:
        if BLOCK >= K:
            offs = tl.arange(0, BLOCK)
            x = tl.load(X + row * stride_x + offs, mask=offs < K, other=0.0).to(tl.float32)
            scale = tl.maximum(tl.max(tl.abs(x), 0), _EPS) / _QMAX
            q = tl.clamp(tl.div_rn(x, scale), -_QMAX, _QMAX)
            if ROUND:
                q = _round_e4m3(q)
            tl.store(Q + row * stride_q + offs, q.to(Q.dtype.element_ty), mask=offs < K)
        else:
            amax = tl.zeros([BLOCK], dtype=tl.float32)
            for k0 in range(0, K, BLOCK):
                offs = k0 + tl.arange(0, BLOCK)
                x = tl.load(X + row * stride_x + offs, mask=offs < K, other=0.0).to(tl.float32)
                amax = tl.maximum(amax, tl.abs(x))
            scale = tl.maximum(tl.max(amax, 0), _EPS) / _QMAX
            for k0 in range(0, K, BLOCK):
                offs = k0 + tl.arange(0, BLOCK)
                x = tl.load(X + row * stride_x + offs, mask=offs < K, other=0.0).to(tl.float32)
                q = tl.clamp(tl.div_rn(x, scale), -_QMAX, _QMAX)
                if ROUND:
                    q = _round_e4m3(q)
                tl.store(Q + row * stride_q + offs, q.to(Q.dtype.element_ty), mask=offs < K)
        tl.store(S + row * stride_s, scale)
    else:
        g = tl.program_id(1)
        offs = g * GROUP + tl.arange(0, BLOCK)
        mask = (tl.arange(0, BLOCK) < GROUP) & (offs < K)
        x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(x), 0), _EPS) / _QMAX
        q = tl.clamp(tl.div_rn(x, scale), -_QMAX, _QMAX)
        if ROUND:
            q = _round_e4m3(q)
        tl.store(Q + row * stride_q + offs, q.to(Q.dtype.element_ty), mask=mask)
        tl.store(S + row * stride_s + g, scale)


ROW_IN_REGISTERS = 8192  # widest row quantized in one pass (wider rows: two passes, the second from L2)
FEW_ROWS = 256  # up to this many rows (a decode batch, one program a row, fewer than the SMs or few
#                 more): the widest rows in one pass and 16 warps a row, so that the few programs'
#                 latency, not the bytes, is what shrinks (at 64 x 4096 the kernel took 4.7 us)


def quantize_act(x: torch.Tensor, group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``ops.quantize_act_fp8`` on the device: (fp8 [M, K], fp32 [M, 1] or [M, ceil(K / group)])."""
    m, k = x.shape
    q = torch.empty((m, k), dtype=FP8, device=x.device)
    rnd = not x.is_cuda
    if group is None:
        s = torch.empty((m, 1), dtype=torch.float32, device=x.device)
        few = m <= FEW_ROWS and x.is_cuda
        block = min(2 * ROW_IN_REGISTERS if few else ROW_IN_REGISTERS, triton.next_power_of_2(k))
        _act_quant_kernel[(m,)](x, q, s, k, x.stride(0), q.stride(0), s.stride(0), GROUP=1, PER_ROW=True,
                                BLOCK=block, ROUND=rnd, num_warps=16 if few else max(4, min(16, block // 1024)))
    else:
        groups = triton.cdiv(k, group)
        s = torch.empty((m, groups), dtype=torch.float32, device=x.device)
        _act_quant_kernel[(m, groups)](x, q, s, k, x.stride(0), q.stride(0), s.stride(0), GROUP=group, PER_ROW=False,
                                       BLOCK=triton.next_power_of_2(group), ROUND=rnd,
                                       num_warps=1 if group <= 256 else 4)
    return q, s


@triton.jit
def grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Program ``pid``'s (row tile, column tile) of an M x N output, programs running in
    groups of GROUP_M row tiles so that a group reuses its weight tiles from L2."""
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * tiles_n
    first_m = (pid // in_group) * GROUP_M
    size_m = tl.minimum(tiles_m - first_m, GROUP_M)
    return first_m + (pid % in_group) % size_m, (pid % in_group) // size_m


@triton.jit
def _fp8_gemm_kernel(A, AS, B, BS, Bias, C, M, N, K, stride_am, stride_as, stride_bn, stride_bs, stride_cm,
                     SCALE: tl.constexpr, SCALE_ROWS: tl.constexpr, SCALE_COLS: tl.constexpr,
                     HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """C = (A @ B.T) scaled: A fp8 [M, K] with scales AS ([M, 1], or [M, ceil(K/SCALE_COLS)]
    for SCALE 2); B fp8 [N, K] with BS ([] SCALE 0, [N] SCALE 1, [ceil(N/SCALE_ROWS),
    ceil(K/SCALE_COLS)] SCALE 2). Programs run in groups of GROUP_M row tiles (weight tiles
    reused from L2)."""
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    rows_a = tl.where(mask_m, offs_m, 0)  # (out-of-range rows and columns read row 0; not stored)
    rows_b = tl.where(mask_n, offs_n, 0)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = A + rows_a[:, None] * stride_am + offs_k[None, :]
    b_ptrs = B + rows_b[None, :] * stride_bn + offs_k[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            a = tl.load(a_ptrs, mask=(k0 + offs_k)[None, :] < K, other=0.0)
            b = tl.load(b_ptrs, mask=(k0 + offs_k)[:, None] < K, other=0.0)
        if SCALE == 2:
            kb = k0 // SCALE_COLS
            sa = tl.load(AS + rows_a * stride_as + kb)
            sb = tl.load(BS + (rows_b // SCALE_ROWS) * stride_bs + kb)
            acc += tl.dot(a, b) * sa[:, None] * sb[None, :]
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if SCALE != 2:
        acc *= tl.load(AS + rows_a * stride_as)[:, None]
        if SCALE == 0:
            acc *= tl.load(BS)
        else:
            acc *= tl.load(BS + rows_b)[None, :]
    if HAS_BIAS:
        acc += tl.load(Bias + rows_b).to(tl.float32)[None, :]
    tl.store(C + offs_m[:, None] * stride_cm + offs_n[None, :], acc.to(C.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


def gemm_tiles(m: int, n: int, k: int, block: tuple[int, int] | None) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) by row count: narrow tiles while the weight
    read dominates (enough programs over N for every SM), 128 x 256 x 128 for prefill (Triton's
    fp8 matmul tutorial's Hopper choice). A block-scaled K step never straddles a block."""
    if m <= 16:
        tiles = (16, 64, 128, 4, 4)
    elif m <= 64:  # (measured on an H200: wide tiles for the 28672-row projection, narrow for 14336-deep)
        tiles = (64, 128, 128, 4, 3) if n >= 16384 else (64, 32 if k >= 8192 else 64, 128, 4, 4)
    elif m <= 256:
        tiles = (64, 128, 128, 4, 4)
    elif block is not None:  # (each step's product is scaled before it is added; measured on an H200)
        tiles = (64, 128, 128, 4, 4)
    else:
        tiles = (128, 256, 128, 8, 3)
    bm, bn, bk, warps, stages = tiles
    if block is not None:
        while bk > 16 and block[1] % bk:
            bk //= 2
    return bm, bn, min(bk, max(32, triton.next_power_of_2(k))), warps, stages  # (fp8 mma: K >= 32)


def fp8_gemm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, block: tuple[int, int] | None,
             bias: torch.Tensor | None, *, tiles: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """``ops.fp8_linear`` through ``quantize_act`` and ``_fp8_gemm_kernel``."""
    m, k = x.shape
    n = weight.shape[0]
    bm, bn, bk, warps, stages = tiles or gemm_tiles(m, n, k, block)
    if block is not None and block[1] % bk:
        raise ValueError(f"fp8 GEMM: K step {bk} does not divide the weight's block width {block[1]}")
    xq, xs = quantize_act(x, block[1] if block is not None else None)
    scale = 2 if block is not None else (1 if weight_scale.dim() == 1 else 0)
    rows, cols = block if block is not None else (1, 1)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    _fp8_gemm_kernel[grid](
        xq, xs, weight, weight_scale, bias if bias is not None else xs, y, m, n, k, xq.stride(0), xs.stride(0),
        weight.stride(0), weight_scale.stride(0) if weight_scale.dim() == 2 else 0, y.stride(0),
        SCALE=scale, SCALE_ROWS=rows, SCALE_COLS=cols, HAS_BIAS=bias is not None, EVEN_K=k % bk == 0,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=warps, num_stages=stages)
    return y
