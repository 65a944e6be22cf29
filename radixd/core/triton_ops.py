"""Fused element-wise kernels for the decoder block (Triton), each replacing a chain of
small torch ops, with torch fallbacks used on CPU:

* ``add_rmsnorm``: residual += x; out = RMSNorm(residual) (or just RMSNorm(x)).
* ``rope_store``: rotate q (in place, or into another tensor) and write rotated k and v into
  the KV pool slots.
* ``silu_mul``: SiLU(gate) * up from the fused gate/up projection.
* ``linear``: a projection; one token's (decode at batch 1) goes through ``gemv``, a
  matrix-vector kernel that reads each weight row in long contiguous runs (cuBLAS's kernels
  for a single row reach 50-90% of the memory bandwidth on the 8B model's projection shapes,
  this one 75-100%: ``python -m benchmarks.decode_profile --sections shapes``).
* ``gate_up_silu`` and ``gemv_rope_store``: for one row, the element-wise kernel that follows
  a projection runs in the GEMV's epilogue instead (each program computes the two rows that
  the element-wise step pairs: gate and up, or a head's two rotary halves), so a decode step
  at batch 1 launches two kernels fewer per layer. ``KernelChoice.fuse_one_row`` (the engine
  option ``fuse_one_row``) turns that off (benchmarks compare both).
* ``rows_linear``: a projection of 2..128 rows (a decode batch), each weight tile streamed
  once past all rows, K split over programs where the tiles are too few, SiLU*up in the
  epilogue for the gate/up projection; taken only for the GPU models and shapes where a sweep
  measured it faster than cuBLAS (``tuned/rows_linear.json``). ``KernelChoice.rows_kernel``
  (the engine option ``rows_kernel``) turns it off.

Which optional kernels a model takes is its layers' ``KernelChoice``, given at construction:
no module-level switch, so two engines in one process may choose differently.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl

from radixd.core import cpu_kernels
from radixd.core.kv_quant import MANTISSA_BITS


@dataclass(frozen=True)
class KernelChoice:
    """The optional kernels a model's projections take (engine options of the same names)."""

    fuse_one_row: bool = True  # one row: the element-wise step after a GEMV in its epilogue
    rows_kernel: bool = True   # 2..ROWS_MAX_M rows: ``rows_linear`` where measured faster
    dense_prefill: bool = True  # long extends in cuDNN's fused attention (``attention.dense_prefill``)
    prefill_weights: str = "auto"  # CPU int4 weights: a bf16 copy for prefill (``cpu_int.with_prefill_copies``)
    # Programmatic dependent launch (CUDA, Hopper+): the decode path's Triton kernels launched
    # so that each may start while the one before it drains (``pdl_begin``)
    pdl: bool = False
    # decode attention's split partials merged in its first kernel (``decode_attention``'s
    # ``merge_in_kernel``), not by a second
    merge_in_kernel: bool = False


ALL_KERNELS = KernelChoice()


@triton.jit
def pdl_begin(PDL: tl.constexpr):
    """A kernel's first step when launched with ``launch_pdl`` (``KernelChoice.pdl``): it may
    have started while the kernel before it still ran, so it waits for that kernel's end and
    writes (griddepcontrol.wait) before touching memory, then lets the next kernel launch.
    Without PDL, nothing (the interpreter has no griddepcontrol)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def _add_rmsnorm_kernel(X, R, W, Out, stride_x, stride_r, stride_o, N, eps,
                        HAS_RES: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_begin(PDL)
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        x += tl.load(R + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(R + row * stride_r + offs, x.to(R.dtype.element_ty), mask=mask)
    var = tl.sum(x * x, 0) / N
    w = tl.load(W + offs, mask=mask, other=0.0)
    y = (x * tl.rsqrt(var + eps)).to(Out.dtype.element_ty) * w
    tl.store(Out + row * stride_o + offs, y, mask=mask)


def add_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                residual: torch.Tensor | None = None, *, use_triton: bool | None = None,
                pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (RMSNorm(x + residual), x + residual); the sum is written into ``residual``
    in place. Without ``residual``: (RMSNorm(x), x). Rows are the last dimension.
    ``use_triton``: None picks the kernel on CUDA and torch ops elsewhere. ``pdl``: the
    kernel launched for programmatic dependent launch (``pdl_begin``)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if not (x.is_cuda if use_triton is None else use_triton):
        r2 = _rows_view(residual, shape[-1]) if residual is not None else None
        if (residual is None or r2 is not None) and cpu_kernels.rows_take(x2, weight, *([r2] if r2 is not None else [])):
            return cpu_kernels.add_rmsnorm(x2, weight, eps, r2).reshape(shape), (residual if residual is not None else x)
        if residual is not None:
            residual.add_(x)
            x2 = residual.reshape(-1, shape[-1])
        xf = x2.float()
        y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight
        return y.reshape(shape), (residual if residual is not None else x)
    out = torch.empty_like(x2)
    r2 = residual.reshape(-1, shape[-1]) if residual is not None else x2
    n = shape[-1]
    _add_rmsnorm_kernel[(x2.shape[0],)](
        x2, r2, weight, out, x2.stride(0), r2.stride(0), out.stride(0), n, eps,
        HAS_RES=residual is not None, BLOCK=triton.next_power_of_2(n), num_warps=4 if n <= 4096 else 8,
        PDL=pdl, launch_pdl=pdl,
    )
    return out.reshape(shape), (residual if residual is not None else x)


def _rows_view(t: torch.Tensor, n: int) -> torch.Tensor | None:
    """``t`` as rows of ``n`` without a copy (None where it is not one view: an in-place
    write must land in ``t``)."""
    try:
        return t.view(-1, n)
    except RuntimeError:
        return None


def fp8_format(buf: torch.Tensor) -> dict[str, float | int]:
    """``_kv_value``'s constants for a KV buffer: an fp8 one's finite range and mantissa
    bits; FP8_MAX 0.0 for others."""
    if buf.dtype.itemsize != 1:
        return {"FP8_MAX": 0.0, "FP8_MANT": 0}
    return {"FP8_MAX": torch.finfo(buf.dtype).max, "FP8_MANT": MANTISSA_BITS[buf.dtype]}


@triton.jit
def _kv_value(x, scale, FP8_MAX: tl.constexpr, FP8_MANT: tl.constexpr):
    """A float32 K or V value as the pool stores it: for an fp8 pool (``FP8_MAX`` > 0; see
    core.kv_quant) ``x / scale`` rounded to FP8_MANT mantissa bits (to nearest, ties to even,
    as torch does) and saturated to +-FP8_MAX, which the store's cast then keeps exactly; else
    ``x`` itself. (The rounding is done here, in the integer bits, because the interpreter's
    cast drops the carry of a mantissa rounded up into the exponent: 7.9 became 4.)"""
    if FP8_MAX > 0:  # (float32 has 23 mantissa bits: 23 - FP8_MANT of them go)
        bits = (x / scale).to(tl.uint32, bitcast=True)
        bits = bits + (((bits >> (23 - FP8_MANT)) & 1) + ((1 << (22 - FP8_MANT)) - 1))
        x = ((bits >> (23 - FP8_MANT)) << (23 - FP8_MANT)).to(tl.float32, bitcast=True)
        x = tl.minimum(tl.maximum(x, -FP8_MAX), FP8_MAX)
    return x


@triton.jit
def _rope_store_kernel(Q, QOut, K, V, Pos, Cos, Sin, KBuf, VBuf, Loc, k_scale, v_scale,
                       stride_qt, stride_qh, stride_ot, stride_oh, stride_kt, stride_kh, stride_vt, stride_vh,
                       stride_cos, stride_bn, stride_bh, stride_vbn, stride_vbh,
                       H: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
                       BLOCK_H: tl.constexpr, BLOCK_HKV: tl.constexpr, FP8_MAX: tl.constexpr,
                       FP8_MANT: tl.constexpr, QW, KW, eps, QK_NORM: tl.constexpr, PDL: tl.constexpr = False):
    pdl_begin(PDL)
    t = tl.program_id(0)
    pos = tl.load(Pos + t)
    loc = tl.load(Loc + t)
    offs = tl.arange(0, BLOCK_HALF)
    mask_d = offs < HALF
    cos = tl.load(Cos + pos * stride_cos + offs, mask=mask_d, other=0.0)
    sin = tl.load(Sin + pos * stride_cos + offs, mask=mask_d, other=0.0)
    hq = tl.arange(0, BLOCK_H)
    mq = (hq < H)[:, None] & mask_d[None, :]
    q1p = Q + t * stride_qt + hq[:, None] * stride_qh + offs[None, :]
    q1 = tl.load(q1p, mask=mq, other=0.0).to(tl.float32)
    q2 = tl.load(q1p + HALF, mask=mq, other=0.0).to(tl.float32)
    if QK_NORM:
        q1, q2 = _head_rmsnorm(q1, q2, QW, offs, mask_d, eps, Q.dtype.element_ty, HALF)
    q1o = QOut + t * stride_ot + hq[:, None] * stride_oh + offs[None, :]
    tl.store(q1o, (q1 * cos - q2 * sin).to(QOut.dtype.element_ty), mask=mq)
    tl.store(q1o + HALF, (q2 * cos + q1 * sin).to(QOut.dtype.element_ty), mask=mq)
    hk = tl.arange(0, BLOCK_HKV)
    mk = (hk < HKV)[:, None] & mask_d[None, :]
    k1p = K + t * stride_kt + hk[:, None] * stride_kh + offs[None, :]
    k1 = tl.load(k1p, mask=mk, other=0.0).to(tl.float32)
    k2 = tl.load(k1p + HALF, mask=mk, other=0.0).to(tl.float32)
    if QK_NORM:
        k1, k2 = _head_rmsnorm(k1, k2, KW, offs, mask_d, eps, K.dtype.element_ty, HALF)
    kb = KBuf + loc * stride_bn + hk[:, None] * stride_bh + offs[None, :]
    tl.store(kb, _kv_value(k1 * cos - k2 * sin, k_scale, FP8_MAX, FP8_MANT).to(KBuf.dtype.element_ty), mask=mk)
    tl.store(kb + HALF, _kv_value(k2 * cos + k1 * sin, k_scale, FP8_MAX, FP8_MANT).to(KBuf.dtype.element_ty), mask=mk)
    vp = V + t * stride_vt + hk[:, None] * stride_vh + offs[None, :]
    vb = VBuf + loc * stride_vbn + hk[:, None] * stride_vbh + offs[None, :]
    v1 = tl.load(vp, mask=mk, other=0.0).to(tl.float32)
    v2 = tl.load(vp + HALF, mask=mk, other=0.0).to(tl.float32)
    tl.store(vb, _kv_value(v1, v_scale, FP8_MAX, FP8_MANT).to(VBuf.dtype.element_ty), mask=mk)
    tl.store(vb + HALF, _kv_value(v2, v_scale, FP8_MAX, FP8_MANT).to(VBuf.dtype.element_ty), mask=mk)


@triton.jit
def _head_rmsnorm(x1, x2, W, offs, mask_d, eps, dtype, HALF: tl.constexpr):
    """RMSNorm of each row of [heads, 2 * HALF] given as its two halves (float32), rounded as
    ``add_rmsnorm``'s output is: (x / rms) in ``dtype``, times the ``dtype`` weight ``W``."""
    r = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF) + eps)[:, None]
    w1 = tl.load(W + offs, mask=mask_d, other=0.0)[None, :]
    w2 = tl.load(W + HALF + offs, mask=mask_d, other=0.0)[None, :]
    return ((x1 * r).to(dtype) * w1).to(tl.float32), ((x2 * r).to(dtype) * w2).to(tl.float32)


def rope_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
               cos: torch.Tensor, sin: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
               loc: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0,
               qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
               q_out: torch.Tensor | None = None, pdl: bool = False) -> None:
    """Neox-style rotary on ``q`` [T, H, D] (in place, or into ``q_out`` of its shape) and
    ``k`` [T, Hkv, D]; rotated k and v go to ``k_buf[loc]``/``v_buf[loc]`` (fp8 buffers:
    divided by ``k_scale``/``v_scale``, saturated). ``cos``/``sin``: [max_pos, D/2] float32. ``qk_norm``: (q weight [D], k weight
    [D], eps): each q and k head RMS-normalised first (Qwen3's q/k norms; ``add_rmsnorm``'s
    rounding), so the norms take no kernels of their own."""
    T, H, D = q.shape
    hkv = k.shape[1]
    half = D // 2
    qw, kw, eps = qk_norm if qk_norm is not None else (q, q, 0.0)  # (unread without)
    q_out = q if q_out is None else q_out
    _rope_store_kernel[(T,)](
        q, q_out, k, v, positions, cos, sin, k_buf, v_buf, loc, k_scale, v_scale,
        q.stride(0), q.stride(1), q_out.stride(0), q_out.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos.stride(0), k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1),
        H=H, HKV=hkv, HALF=half, BLOCK_HALF=triton.next_power_of_2(half),
        BLOCK_H=triton.next_power_of_2(H), BLOCK_HKV=triton.next_power_of_2(hkv), **fp8_format(k_buf), QW=qw, KW=kw, eps=eps,
        QK_NORM=qk_norm is not None, PDL=pdl, launch_pdl=pdl,
    )


@triton.jit
def _silu_mul_kernel(X, Out, stride_x, stride_o, N, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = col < N
    g = tl.load(X + row * stride_x + col, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(X + row * stride_x + N + col, mask=mask, other=0.0).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(Out + row * stride_o + col, y.to(Out.dtype.element_ty), mask=mask)


def silu_mul(x: torch.Tensor, *, use_triton: bool | None = None) -> torch.Tensor:
    """[T, 2I] (gate | up) -> SiLU(gate) * up, [T, I]."""
    n = x.shape[-1] // 2
    if not (x.is_cuda if use_triton is None else use_triton):
        gate, up = x.split(n, dim=-1)
        return torch.nn.functional.silu(gate).mul_(up)  # (in place: one fresh [T, I] buffer, not two)
    out = torch.empty(x.shape[:-1] + (n,), dtype=x.dtype, device=x.device)
    block = 1024
    _silu_mul_kernel[(x.shape[0], triton.cdiv(n, block))](x, out, x.stride(0), out.stride(0), n, BLOCK=block)
    return out


@triton.jit
def _dot_rows(X, W, rows, mask_rows, K, stride_w, NROWS: tl.constexpr, MASK_ROWS: tl.constexpr,
              EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
    """fp32 dot products of ``X`` [K] with rows ``rows`` [NROWS] of ``W`` (with ``MASK_ROWS``,
    rows outside ``mask_rows`` give 0), reading ``BLOCK_K`` columns per step. With ``PDL`` the
    first step's weights are read before ``pdl_begin`` (no kernel of a step writes weights:
    they stream while the kernel before drains), ``X`` only after it; the caller's kernel
    reads and writes nothing else before this."""
    acc = tl.zeros([NROWS], dtype=tl.float32)
    start = 0
    if PDL:
        w = _weight_step(W, rows, mask_rows, 0, K, stride_w, MASK_ROWS, EVEN_K, BLOCK_K)
        pdl_begin(PDL)
        acc += _step_dot(w, X, 0, K, EVEN_K, BLOCK_K)
        start = BLOCK_K
    for k0 in range(start, K, BLOCK_K):
        w = _weight_step(W, rows, mask_rows, k0, K, stride_w, MASK_ROWS, EVEN_K, BLOCK_K)
        acc += _step_dot(w, X, k0, K, EVEN_K, BLOCK_K)
    return acc


@triton.jit
def _weight_step(W, rows, mask_rows, k0, K, stride_w, MASK_ROWS: tl.constexpr, EVEN_K: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    """``W``'s rows ``rows``, columns ``k0 ...`` (``BLOCK_K`` of them; masked rows and columns: 0)."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    ptrs = W + rows[:, None] * stride_w + offs_k[None, :]
    if EVEN_K:
        if MASK_ROWS:
            w = tl.load(ptrs, mask=mask_rows[:, None], other=0.0)
        else:
            w = tl.load(ptrs)
    else:
        mask_k = offs_k < K
        if MASK_ROWS:
            w = tl.load(ptrs, mask=mask_rows[:, None] & mask_k[None, :], other=0.0)
        else:
            w = tl.load(ptrs, mask=mask_k[None, :], other=0.0)
    return w


@triton.jit
def _step_dot(w, X, k0, K, EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """fp32 row sums of the weight step ``w`` times ``X``'s columns ``k0 ...``."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    if EVEN_K:
        x = tl.load(X + offs_k)
    else:
        x = tl.load(X + offs_k, mask=offs_k < K, other=0.0)
    return tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], 1)


@triton.jit
def _gemv_kernel(X, W, B, Y, N, K, stride_w, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    acc = _dot_rows(X, W, offs_n, mask_n, K, stride_w, BLOCK_N, True, EVEN_K, BLOCK_K, PDL)  # (its pdl_begin)
    if HAS_BIAS:
        acc += tl.load(B + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    tl.store(Y + offs_n, acc.to(Y.dtype.element_ty), mask=mask_n)


def gemv_tiles(k: int) -> tuple[int, int]:
    """(rows per program, K per iteration): one row and 2048-wide steps where K allows (the
    fastest on every 8B projection shape measured), else two rows and 1024."""
    if k % 2048 == 0:
        return 1, 2048
    return 2, min(1024, triton.next_power_of_2(k))


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
         tiles: tuple[int, int, int] | None = None, out: torch.Tensor | None = None,
         pdl: bool = False) -> torch.Tensor:
    """``F.linear`` of one row: ``x`` [1, K] (or [K]), ``weight`` [N, K] row-major.
    ``tiles``: (rows per program, K per iteration, warps) instead of ``gemv_tiles``' choice
    (benchmarks sweep them). ``pdl``: as ``add_rmsnorm``'s."""
    n, k = weight.shape
    bn, bk, warps = tiles if tiles is not None else (*gemv_tiles(k), 4)
    if out is None:
        out = torch.empty(x.shape[:-1] + (n,), dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, bn),)](
        x, weight, bias if bias is not None else weight, out, n, k, weight.stride(0),
        HAS_BIAS=bias is not None, EVEN_K=k % bk == 0, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps,
        PDL=pdl, launch_pdl=pdl)
    return out


def one_row(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``x @ weight.T`` is one contiguous CUDA row of a 16-bit model (the GEMV path)."""
    return (x.is_cuda and x.dim() == 2 and x.shape[0] == 1 and x.is_contiguous() and weight.stride(1) == 1
            and weight.dtype in (torch.bfloat16, torch.float16) and x.dtype == weight.dtype)


@triton.jit
def _gemv_pair(X, W, B, pid, HALF, K, stride_w,
               HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
    """The dot products of ``X`` with rows r and r + HALF of ``W``, where r is the pid-th row
    of the first halves of consecutive 2 x HALF row blocks; fp32, rounded to X's dtype (as
    the unfused projection's output would be)."""
    r0 = (pid // HALF) * (2 * HALF) + pid % HALF
    pair = tl.arange(0, 2)
    rows = r0 + pair * HALF
    acc = _dot_rows(X, W, rows, rows, K, stride_w, 2, False, EVEN_K, BLOCK_K, PDL)  # (its pdl_begin)
    if HAS_BIAS:
        acc += tl.load(B + rows).to(tl.float32)
    acc = acc.to(X.dtype.element_ty).to(tl.float32)
    return tl.sum(tl.where(pair == 0, acc, 0.0), 0), tl.sum(tl.where(pair == 1, acc, 0.0), 0)


@triton.jit
def _gemv_silu_kernel(X, W, Y, INTER, K, stride_w, EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr,
                      PDL: tl.constexpr = False):
    pid = tl.program_id(0)
    g, u = _gemv_pair(X, W, W, pid, INTER, K, stride_w, False, EVEN_K, BLOCK_K, PDL)
    tl.store(Y + pid, (g / (1.0 + tl.exp(-g)) * u).to(Y.dtype.element_ty))


def gemv_silu_mul(x: torch.Tensor, weight: torch.Tensor, *, tiles: tuple[int, int] | None = None,
                  pdl: bool = False) -> torch.Tensor:
    """``silu_mul(F.linear(x, weight))`` for one row ``x`` [1, K]; ``weight`` [2I, K] is the
    fused (gate | up) projection. ``tiles``: (K per iteration, warps); by default 8 warps
    for 2048-wide steps (the fastest at the 8B model's shapes, tp 1 and 2:
    ``python -m benchmarks.decode_profile --sections fused``). ``pdl``: as ``add_rmsnorm``'s."""
    two_i, k = weight.shape
    if tiles is None:
        bk = gemv_tiles(k)[1]
        tiles = (bk, 8 if bk == 2048 else 4)
    bk, warps = tiles
    out = torch.empty(x.shape[:-1] + (two_i // 2,), dtype=x.dtype, device=x.device)
    _gemv_silu_kernel[(two_i // 2,)](x, weight, out, two_i // 2, k, weight.stride(0),
                                     EVEN_K=k % bk == 0, BLOCK_K=bk, num_warps=warps, PDL=pdl, launch_pdl=pdl)
    return out


def gate_up_silu(x: torch.Tensor, layer: torch.nn.Linear, kernels: KernelChoice = ALL_KERNELS) -> torch.Tensor:
    """``silu_mul(linear(x, layer))``: one kernel for one CUDA row (``gemv_silu_mul``) and
    for a few (``rows_linear``, where it beats cuBLAS), as ``kernels`` allows; a quantized
    projection's own (``QuantLinear.forward_silu``) where it has one."""
    fused = getattr(layer, "forward_silu", None) if kernels.fuse_one_row else None
    y = fused(x) if fused is not None else None
    if y is not None:
        return y
    if isinstance(layer, torch.nn.Linear) and layer.bias is None:
        if kernels.fuse_one_row and one_row(x, layer.weight):
            return gemv_silu_mul(x, layer.weight, pdl=kernels.pdl)
        tiles = few_rows(x, layer.weight, silu=True) if kernels.rows_kernel else None
        if tiles:
            return rows_linear(x, layer.weight, silu=True, tiles=tiles, pdl=kernels.pdl)
    return silu_mul(linear(x, layer, kernels))


@triton.jit
def rope_store_pairs(a, b, pair, mask, Q, KBuf, VBuf, Pos, Loc, Cos, Sin, stride_cos, stride_bn, stride_bh,
                     stride_vbn, stride_vbh, H, HKV, k_scale, v_scale, HALF: tl.constexpr,
                     FP8_MAX: tl.constexpr, FP8_MANT: tl.constexpr):
    """A one-token q/k/v projection's epilogue for its row pairs ``pair`` [P] (pair p: rows j
    and j + HALF of head p // HALF, j = p % HALF; ``mask``: the real ones), whose products are
    ``a`` and ``b`` [P] (fp32): q and k pairs rotated (neox halves), q stored to ``Q`` [H, 2 *
    HALF], k and v to their buffers' slot ``Loc`` as ``rope_store`` stores them."""
    head = pair // HALF
    j = pair % HALF
    pos = tl.load(Pos)
    loc = tl.load(Loc)
    cos = tl.load(Cos + pos * stride_cos + j, mask=mask, other=0.0)
    sin = tl.load(Sin + pos * stride_cos + j, mask=mask, other=0.0)
    y0 = a * cos - b * sin
    y1 = b * cos + a * sin
    is_q = mask & (head < H)
    is_k = mask & (head >= H) & (head < H + HKV)
    is_v = mask & (head >= H + HKV)
    tl.store(Q + head * 2 * HALF + j, y0.to(Q.dtype.element_ty), mask=is_q)
    tl.store(Q + head * 2 * HALF + j + HALF, y1.to(Q.dtype.element_ty), mask=is_q)
    kp = KBuf + loc * stride_bn + (head - H) * stride_bh + j
    tl.store(kp, _kv_value(y0, k_scale, FP8_MAX, FP8_MANT).to(KBuf.dtype.element_ty), mask=is_k)
    tl.store(kp + HALF, _kv_value(y1, k_scale, FP8_MAX, FP8_MANT).to(KBuf.dtype.element_ty), mask=is_k)
    vp = VBuf + loc * stride_vbn + (head - H - HKV) * stride_vbh + j
    tl.store(vp, _kv_value(a, v_scale, FP8_MAX, FP8_MANT).to(VBuf.dtype.element_ty), mask=is_v)
    tl.store(vp + HALF, _kv_value(b, v_scale, FP8_MAX, FP8_MANT).to(VBuf.dtype.element_ty), mask=is_v)


@triton.jit
def _gemv_rope_store_kernel(X, W, B, Q, KBuf, VBuf, Pos, Loc, Cos, Sin, K, stride_w, stride_cos,
                            stride_bn, stride_bh, stride_vbn, stride_vbh, H, HKV, k_scale, v_scale,
                            HALF: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
                            BLOCK_K: tl.constexpr, FP8_MAX: tl.constexpr, FP8_MANT: tl.constexpr,
                            PDL: tl.constexpr = False):
    pid = tl.program_id(0)
    a, b = _gemv_pair(X, W, B, pid, HALF, K, stride_w, HAS_BIAS, EVEN_K, BLOCK_K, PDL)
    one = tl.zeros([1], dtype=tl.float32)
    pair = pid + tl.arange(0, 1)
    rope_store_pairs(a + one, b + one, pair, pair >= 0, Q, KBuf, VBuf, Pos, Loc, Cos, Sin, stride_cos, stride_bn,
                     stride_bh, stride_vbn, stride_vbh, H, HKV, k_scale, v_scale, HALF, FP8_MAX, FP8_MANT)


def gemv_rope_store(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, position: torch.Tensor,
                    cos: torch.Tensor, sin: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                    loc: torch.Tensor, *, num_heads: int, tiles: tuple[int, int] | None = None,
                    k_scale: float = 1.0, v_scale: float = 1.0, pdl: bool = False) -> torch.Tensor:
    """The fused q/k/v projection of one token ``x`` [1, K] (``weight`` rows: q heads | k
    heads | v heads), ``rope_store``'s work in the epilogue: returns rotated q [1, H, D];
    rotated k and v go to ``k_buf[loc]``/``v_buf[loc]`` (fp8: as ``rope_store`` stores them). ``position``/``loc``: [1] on the
    device. ``tiles``: (K per iteration, warps)."""
    n, k = weight.shape
    hkv, d = k_buf.shape[1], k_buf.shape[2]
    assert n == (num_heads + 2 * hkv) * d and d % 2 == 0
    bk, warps = tiles if tiles is not None else (gemv_tiles(k)[1], 4)
    q = torch.empty((1, num_heads, d), dtype=x.dtype, device=x.device)
    _gemv_rope_store_kernel[(n // 2,)](
        x, weight, bias if bias is not None else weight, q, k_buf, v_buf, position, loc, cos, sin, k,
        weight.stride(0), cos.stride(0), k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1),
        num_heads, hkv, k_scale, v_scale, HALF=d // 2, HAS_BIAS=bias is not None, EVEN_K=k % bk == 0, BLOCK_K=bk,
        **fp8_format(k_buf), num_warps=warps, PDL=pdl, launch_pdl=pdl)
    return q


@triton.jit
def _rows_tile(M, N, K, SPLIT_K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """A rows kernel's program (tile, split): its tile, the masks of its weight rows and of X's
    rows, and its slice [k_lo, k_hi) of K (whole steps of BLOCK_K)."""
    pid = tl.program_id(0)
    split = tl.program_id(1)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    mask_n = offs_n < N
    mask_m = offs_m < M
    k_per = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_lo = split * k_per
    k_hi = tl.minimum(k_lo + k_per, K)
    return pid, split, offs_n, offs_m, mask_n, mask_m, k_lo, k_hi


@triton.jit
def _rows_epilogue(acc, acc_up, B, Y, Part, Count, pid, split, offs_m, offs_n, mask_n, mask_m, stride_ym, SPLIT_K,
                   HAS_BIAS: tl.constexpr, SILU: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The end of a rows kernel (``_rows_kernel``, ``quant.fp8_rows``) for one tile's program:
    with SPLIT_K > 1 its slice's sums go to ``Part`` and the tile's last program to arrive
    (``Count``, set back to 0) adds the slices in order; then the bias, SiLU(gate) * up with
    SILU, and the store of Y[:M, tile]."""
    last = True
    if SPLIT_K > 1:
        parts = 2 if SILU else 1
        tile = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + offs_m[None, :]
        mine = Part + ((pid * SPLIT_K + split) * parts) * (BLOCK_N * BLOCK_M) + tile
        tl.store(mine, acc)
        if SILU:
            tl.store(mine + BLOCK_N * BLOCK_M, acc_up)
        tl.debug_barrier()  # every thread's slice stored before the arrival is counted
        last = tl.atomic_add(Count + pid, 1, sem="acq_rel") == SPLIT_K - 1
        if last:
            acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            acc_up = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            for s in range(SPLIT_K):
                src = Part + ((pid * SPLIT_K + s) * parts) * (BLOCK_N * BLOCK_M) + tile
                acc += tl.load(src, cache_modifier=".cg")
                if SILU:
                    acc_up += tl.load(src + BLOCK_N * BLOCK_M, cache_modifier=".cg")
            tl.store(Count + pid, 0)
    if last:
        if HAS_BIAS:
            acc += tl.load(B + offs_n, mask=mask_n, other=0.0).to(tl.float32)[:, None]
        if SILU:  # (rounded as the unfused projection's output would be)
            g = acc.to(Y.dtype.element_ty).to(tl.float32)
            acc = g / (1.0 + tl.exp(-g)) * acc_up.to(Y.dtype.element_ty).to(tl.float32)
        tl.store(Y + offs_m[None, :] * stride_ym + offs_n[:, None], acc.to(Y.dtype.element_ty),
                 mask=mask_n[:, None] & mask_m[None, :])


@triton.jit
def _rows_kernel(X, W, B, Y, Part, Count, M, N, K, stride_xm, stride_w, stride_ym, HALF,
                 HAS_BIAS: tl.constexpr, SILU: tl.constexpr, EVEN_K: tl.constexpr, SPLIT_K: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
    """Y[:M, tile] = X[:M] @ W[tile].T for one tile of BLOCK_N weight rows and all M (<=
    BLOCK_M) rows of X, accumulated as W-tile x X-tile.T (the weights are the wide side of the
    product). With SILU, W is (gate | up) with HALF rows each: the tile's gate rows and the
    matching up rows are read, and Y gets SiLU(gate) * up.

    SPLIT_K > 1: program (tile, s) sums the s-th of SPLIT_K slices of K and leaves it in
    ``Part``; the tile's last program to finish (``Count``, a per-tile arrival counter it
    sets back to 0) adds the slices in order and writes Y, so one launch does the whole
    product and the result does not depend on which program came last."""
    pdl_begin(PDL)
    pid, split, offs_n, offs_m, mask_n, mask_m, k_lo, k_hi = _rows_tile(M, N, K, SPLIT_K, BLOCK_M, BLOCK_N, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)  # (SILU only)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        w_ptrs = W + offs_n[:, None] * stride_w + offs_k[None, :]
        x_ptrs = X + offs_m[None, :] * stride_xm + offs_k[:, None]
        if EVEN_K:
            mask_w = mask_n[:, None]
            mask_x = mask_m[None, :]
        else:
            mask_w = mask_n[:, None] & (offs_k[None, :] < k_hi)
            mask_x = mask_m[None, :] & (offs_k[:, None] < k_hi)
        x = tl.load(x_ptrs, mask=mask_x, other=0.0)
        acc = tl.dot(tl.load(w_ptrs, mask=mask_w, other=0.0), x, acc)
        if SILU:
            acc_up = tl.dot(tl.load(w_ptrs + HALF * stride_w, mask=mask_w, other=0.0), x, acc_up)
    _rows_epilogue(acc, acc_up, B, Y, Part, Count, pid, split, offs_m, offs_n, mask_n, mask_m, stride_ym, SPLIT_K,
                   HAS_BIAS, SILU, BLOCK_M, BLOCK_N)


ROWS_MAX_M = 128
ROWS_DEFAULT_TILES = (64, 128, 4, 4, 1)  # rows_linear called directly where nothing was measured
ROWS_SCRATCH = 1 << 22  # fp32 partial sums per stream for split-K launches (16 MiB)
ROWS_TUNED = Path(__file__).with_name("tuned") / "rows_linear.json"
_rows_scratch: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def rows_shape_key(n: int, k: int, silu: bool) -> str:
    return f"{n}x{k}" + (" silu" if silu else "")


@functools.cache
def _tuned_rows(device: torch.device) -> dict:
    """The measured ``rows_linear`` tiles for ``device``'s GPU model (``ROWS_TUNED``, written
    by ``python -m benchmarks.decode_profile --sections rows --rows-write``): shape key -> {row bucket:
    tiles or None}."""
    if device.type != "cuda":
        return {}
    table = json.loads(ROWS_TUNED.read_text()) if ROWS_TUNED.exists() else {}
    return table.get(torch.cuda.get_device_name(device), {})


def rows_tiles(m: int, n: int, k: int, *, silu: bool = False,
               device: torch.device | None = None) -> tuple[int, int, int, int, int] | None:
    """(weight rows per program, K per iteration, warps, pipeline stages, K splits) for
    ``rows_linear`` at ``m`` rows of a projection to ``n`` outputs from ``k`` on ``device``
    (default: the current CUDA device): the tiles measured fastest for the smallest measured
    row count >= ``m``; None where cuBLAS was as fast or the GPU or shape was not measured
    (tiles that suit one GPU and shape can lose to cuBLAS on another)."""
    if m > ROWS_MAX_M:
        return None
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device())
    buckets = _tuned_rows(device).get(rows_shape_key(n, k, silu))
    if not buckets:
        return None
    fits = [b for b in map(int, buckets) if b >= m]
    if not fits:
        return None
    tiles = buckets[str(min(fits))]
    return tuple(tiles) if tiles else None


def few_rows(x: torch.Tensor, weight: torch.Tensor, *, silu: bool = False) -> tuple[int, int, int, int, int] | None:
    """The ``rows_linear`` tiles for ``x @ weight.T`` if it is 2..ROWS_MAX_M CUDA rows of a
    16-bit model with measured tiles for its shape (``rows_tiles``), else None."""
    if not (x.is_cuda and x.dim() == 2 and 1 < x.shape[0] <= ROWS_MAX_M and x.stride(1) == 1
            and weight.stride(1) == 1 and weight.dtype in (torch.bfloat16, torch.float16) and x.dtype == weight.dtype):
        return None
    n = weight.shape[0] // 2 if silu else weight.shape[0]
    return rows_tiles(x.shape[0], n, x.shape[1], silu=silu, device=x.device)


def _split_scratch(device: torch.device, need: int, tiles: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The current stream's split-K partials and per-tile arrival counters (zero between
    launches), made on its first use (for a CUDA graph: in the warm-up on the capture
    stream); None if ``need`` floats or ``tiles`` counters do not fit, or if they would have
    to be made during capture. One set per stream: launches on one stream never overlap, and
    two engines on one device never share a stream."""
    cuda = device.type == "cuda"
    key = (device, torch.cuda.current_stream(device).stream_id if cuda else 0)
    have = _rows_scratch.get(key)
    if have is None:
        if cuda and torch.cuda.is_current_stream_capturing():
            return None
        have = _rows_scratch[key] = (torch.empty(ROWS_SCRATCH, dtype=torch.float32, device=device),
                                     torch.zeros(ROWS_SCRATCH // 1024, dtype=torch.int32, device=device))
    if need > have[0].numel() or tiles > have[1].numel():
        return None
    return have


def rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, silu: bool = False,
                tiles: tuple[int, int, int, int, int] | None = None, out: torch.Tensor | None = None,
                pdl: bool = False) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for a few rows ``x`` [M, K] (``silu``: ``silu_mul`` of
    it, ``weight`` being the fused (gate | up) projection) in one kernel that streams each
    weight tile once past all M rows, K split over several programs per tile where the tiles
    alone are too few for the device. ``tiles``: ``rows_tiles``' tuple (default: its choice,
    or ROWS_DEFAULT_TILES where nothing was measured); a split that finds no scratch raises
    rather than run unsplit. ``pdl``: as ``add_rmsnorm``'s."""
    assert not (silu and bias is not None), "the fused gate/up projection has no bias"
    m, k = x.shape
    n = weight.shape[0] // 2 if silu else weight.shape[0]
    bn, bk, warps, stages, split = tiles or rows_tiles(m, n, k, silu=silu, device=x.device) or ROWS_DEFAULT_TILES
    block_m = max(16, triton.next_power_of_2(m))
    grid_n = triton.cdiv(n, bn)
    scratch = None
    if split > 1:
        scratch = _split_scratch(x.device, grid_n * split * (2 if silu else 1) * bn * block_m, grid_n)
        if scratch is None:
            raise ValueError(f"no split-K scratch for {split} splits of {grid_n} tiles of {bn} x {block_m}")
    part, count = scratch if scratch is not None else (x, x)
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    _rows_kernel[(grid_n, split)](
        x, weight, bias if bias is not None else weight, out, part, count, m, n, k, x.stride(0), weight.stride(0),
        out.stride(0), n, HAS_BIAS=bias is not None, SILU=silu, EVEN_K=k % (bk * split) == 0, SPLIT_K=split,
        BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages, PDL=pdl, launch_pdl=pdl)
    return out


def linear(x: torch.Tensor, layer: torch.nn.Linear, kernels: KernelChoice = ALL_KERNELS) -> torch.Tensor:
    """``layer(x)``; a single CUDA row of a 16-bit model goes through ``gemv`` (an
    ``nn.Linear`` only: other heads, e.g. tensor parallel's, are called as they are)."""
    if not isinstance(layer, torch.nn.Linear):
        return layer(x)
    return linear_weight(x, layer.weight, layer.bias, kernels)


def linear_weight(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  kernels: KernelChoice = ALL_KERNELS) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, through ``gemv`` for a single CUDA row of a 16-bit model
    and ``rows_linear`` for a few rows where it beats cuBLAS (``kernels.rows_kernel``)."""
    if one_row(x, weight):
        return gemv(x, weight, bias, pdl=kernels.pdl)
    tiles = few_rows(x, weight) if kernels.rows_kernel else None
    if tiles:
        return rows_linear(x, weight, bias, tiles=tiles, pdl=kernels.pdl)
    return torch.nn.functional.linear(x, weight, bias)


@triton.jit
def _argmax_partial_kernel(X, PartMax, PartIdx, V, stride_x, CHUNKS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    c = tl.program_id(1)
    offs = c * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + row * stride_x + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    m = tl.max(x, 0)
    idx = tl.min(tl.where(x == m, offs, 2147483647), 0)
    tl.store(PartMax + row * CHUNKS + c, m)
    tl.store(PartIdx + row * CHUNKS + c, idx)


@triton.jit
def _argmax_final_kernel(PartMax, PartIdx, Out, CHUNKS: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, CHUNKS)
    m = tl.load(PartMax + row * CHUNKS + offs)
    idx = tl.load(PartIdx + row * CHUNKS + offs)
    best = tl.max(m, 0)
    tl.store(Out + row, tl.min(tl.where(m == best, idx, 2147483647), 0).to(tl.int64))


def argmax_rows(x: torch.Tensor, *, use_triton: bool | None = None) -> torch.Tensor:
    """``x.argmax(dim=-1)`` (the first index of each row's maximum); for a 2-D CUDA tensor in
    two short kernels: torch's reduction spends one block per row, ~28 us on a 128k row.
    ``use_triton``: None picks the kernel on CUDA and torch elsewhere."""
    if not ((x.is_cuda if use_triton is None else use_triton) and x.dim() == 2 and x.stride(-1) == 1):
        return x.argmax(dim=-1)
    rows, v = x.shape
    block = 4096
    chunks = triton.next_power_of_2(triton.cdiv(v, block))
    part_max = torch.empty(rows, chunks, dtype=torch.float32, device=x.device)
    part_idx = torch.empty(rows, chunks, dtype=torch.int32, device=x.device)
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    _argmax_partial_kernel[(rows, chunks)](x, part_max, part_idx, v, x.stride(0), CHUNKS=chunks, BLOCK=block,
                                           num_warps=8)
    _argmax_final_kernel[(rows,)](part_max, part_idx, out, CHUNKS=chunks, num_warps=1)
    return out
