"""fp8 weights times a few rows of x (a decode batch, 2..``ROWS_MAX_M`` rows): per-tensor or
per-channel fp8 weights streamed once past all rows, K split over programs where the weight
tiles alone are too few for the device, as ``triton_ops.rows_linear`` does for 16-bit weights
(the same split-K scratch and in-kernel reduction; the same SiLU(gate) * up epilogue for the
gate/up projection).

Two ways to form the products (``MODE``):

* ``A8W8`` (1, what ``choose`` picks): x quantized to fp8 per token first
  (``fp8_gemm.quantize_act``, the reference's rule), the fp8 tile of W times the fp8 tile of
  x on the fp8 tensor cores (wgmma, the weight tile as the 64-row side), both scales in the
  epilogue. On an H200 at the 8B projections, 16-128 rows, it beat ``fp8_gemm`` (the same
  quantized x, tiles over M and N) by 1.07-2.5x and cuBLASLt's row-wise-scaled fp8 GEMM
  (``torch._scaled_mm``) by 1.0-1.8x (``benchmarks.fp8_rows``); at 256 rows cuBLASLt wins.
* ``W8A16`` (0): x left in its own dtype (as the one-row GEMV keeps it), each weight tile
  widened to it in registers, 16-bit products. No activation-quantization kernel runs, but
  the widening costs more than that kernel: measured slower than A8W8 at every shape and row
  count (also with the widening in inline PTX, two weights per few integer instructions), so
  no tuned entry picks it; kept for the accuracy it has and tested.

Callers are ``ops``' dispatch: shapes and dtypes are checked there.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch
import triton
import triton.language as tl

from radixd.core.triton_ops import _rows_epilogue, _rows_tile, _split_scratch

ROWS_MAX_M = 128
W8A16, A8W8 = 0, 1


@triton.jit
def _fp8_rows_kernel(X, XS, W, WS, B, Y, Part, Count, M, N, K, stride_xm, stride_w, stride_ym, HALF, SPLIT_K,
                     MODE: tl.constexpr, PER_CHANNEL: tl.constexpr, HAS_BIAS: tl.constexpr,
                     SILU: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Y[:M, tile] = X[:M] @ dequant(W[tile]).T for one tile of BLOCK_N weight rows and all M
    (<= BLOCK_M) rows, accumulated as W-tile x X-tile.T; ``triton_ops._rows_kernel``'s split-K
    and SILU. X: x (W8A16) or fp8 x with per-row scales XS [M, 1] (A8W8); WS: the weight's
    scales ([N] PER_CHANNEL, else []), applied with XS's to each slice's sums."""
    pid, split, offs_n, offs_m, mask_n, mask_m, k_lo, k_hi = _rows_tile(M, N, K, SPLIT_K, BLOCK_M, BLOCK_N, BLOCK_K)
    rows_n = tl.where(mask_n, offs_n, 0)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)  # (SILU only)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        w_ptrs = W + rows_n[:, None] * stride_w + offs_k[None, :]
        x_ptrs = X + offs_m[None, :] * stride_xm + offs_k[:, None]
        if EVEN_K:
            x = tl.load(x_ptrs, mask=mask_m[None, :], other=0.0)
            w = tl.load(w_ptrs)
            if SILU:
                w_up = tl.load(w_ptrs + HALF * stride_w)
        else:
            x = tl.load(x_ptrs, mask=mask_m[None, :] & (offs_k[:, None] < k_hi), other=0.0)
            w = tl.load(w_ptrs, mask=offs_k[None, :] < k_hi, other=0.0)
            if SILU:
                w_up = tl.load(w_ptrs + HALF * stride_w, mask=offs_k[None, :] < k_hi, other=0.0)
        if MODE == 0:
            acc = tl.dot(w.to(tl.float32).to(X.dtype.element_ty), x, acc)
            if SILU:
                acc_up = tl.dot(w_up.to(tl.float32).to(X.dtype.element_ty), x, acc_up)
        else:
            acc = tl.dot(w, x, acc)
            if SILU:
                acc_up = tl.dot(w_up, x, acc_up)
    # the scales (linear: applied to each slice before the slices are added)
    if PER_CHANNEL:
        acc *= tl.load(WS + rows_n)[:, None]
        if SILU:
            acc_up *= tl.load(WS + HALF + rows_n)[:, None]
    else:
        acc *= tl.load(WS)
        if SILU:
            acc_up *= tl.load(WS)
    if MODE == 1:
        xs = tl.load(XS + tl.where(mask_m, offs_m, 0))[None, :]
        acc *= xs
        if SILU:
            acc_up *= xs
    _rows_epilogue(acc, acc_up, B, Y, Part, Count, pid, split, offs_m, offs_n, mask_n, mask_m, stride_ym, SPLIT_K,
                   HAS_BIAS, SILU, BLOCK_M, BLOCK_N)


TUNED = Path(__file__).parents[1] / "tuned" / "fp8_rows.json"
BUCKETS = (16, 32, 64, 128, 256)  # row buckets measured; more rows take ``fp8_gemm``


def shape_key(n: int, k: int, silu: bool) -> str:
    return f"{n}x{k}" + (" silu" if silu else "")


@functools.cache
def _tuned(device_name: str) -> dict:
    """``TUNED``'s entries for a GPU model (written by ``python -m benchmarks.fp8_rows
    --write-tuned``): shape key -> {row bucket: choice}."""
    table = json.loads(TUNED.read_text()) if TUNED.exists() else {}
    return table.get(device_name, {})


def choose(m: int, n: int, k: int, silu: bool, device: torch.device) -> list | None:
    """The fastest measured kernel for ``m`` rows of a per-channel fp8 ``n`` x ``k`` projection
    (``silu``: the gate/up projection, ``n`` its outputs, with SiLU * up) on ``device``'s GPU
    model, from the smallest measured row bucket >= ``m``: ``["rows", mode, weight rows, K
    step, warps, stages, splits]`` (``fp8_rows``), ``["scaled_mm"]`` (per-token fp8 x through
    ``torch._scaled_mm``), ``["gemm"]`` (``fp8_gemm``); None where nothing was measured."""
    if device.type != "cuda" or m > BUCKETS[-1]:
        return None
    buckets = _tuned(torch.cuda.get_device_name(device)).get(shape_key(n, k, silu))
    if not buckets:
        return None
    fits = [b for b in map(int, buckets) if b >= m]
    return buckets[str(min(fits))] if fits else None


def fp8_rows(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None,
             *, silu: bool = False, mode: int = A8W8,
             tiles: tuple[int, int, int, int, int] = (64, 128, 4, 4, 1)) -> torch.Tensor:
    """``x @ W.T + bias`` (``silu``: SiLU(gate) * up of it, W the (gate | up) projection, no
    bias) for a per-tensor or per-channel fp8 weight and 1..ROWS_MAX_M rows x. ``tiles``:
    (weight rows per program, K step, warps, stages, K splits); the splits fall back to one
    where the stream's split-K scratch cannot hold them."""

    assert not (silu and bias is not None), "the fused gate/up projection has no bias"
    m, k = x.shape
    n = weight.shape[0] // 2 if silu else weight.shape[0]
    bn, bk, warps, stages, split = tiles
    block_m = max(16, triton.next_power_of_2(m))
    grid_n = triton.cdiv(n, bn)
    if mode == A8W8:
        from radixd.core.quant.fp8_gemm import quantize_act

        xin, xs = quantize_act(x)
    else:
        xin, xs = x, weight_scale
    part, count = x, x
    if split > 1:
        scratch = _split_scratch(x.device, grid_n * split * (2 if silu else 1) * bn * block_m, grid_n)
        if scratch is None:
            split = 1
        else:
            part, count = scratch
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    _fp8_rows_kernel[(grid_n, split)](
        xin, xs, weight, weight_scale, bias if bias is not None else weight_scale, out, part, count, m, n, k,
        xin.stride(0), weight.stride(0), out.stride(0), n, split, MODE=mode, PER_CHANNEL=weight_scale.dim() == 1,
        HAS_BIAS=bias is not None, SILU=silu, EVEN_K=k % (bk * split) == 0, BLOCK_M=block_m,
        BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)
    return out


def scaled_mm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` for a per-channel fp8 weight through cuBLASLt's fp8 GEMM
    (``torch._scaled_mm``, row-wise scales), x quantized per token first as ``fp8_gemm`` does."""
    from radixd.core.quant.fp8_gemm import quantize_act

    xq, xs = quantize_act(x)
    return torch._scaled_mm(xq, weight.T, scale_a=xs, scale_b=weight_scale.view(1, -1), bias=bias,
                            out_dtype=x.dtype)


def run_choice(choice: list, x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None = None, *, silu: bool = False) -> torch.Tensor | None:
    """``choose``'s ``choice`` run (None for ``["gemm"]``: the caller's own path). ``silu``:
    the gate/up projection with SiLU * up (``rows`` only; for the others, the caller's)."""
    if choice[0] == "rows":
        return fp8_rows(x, weight, weight_scale, bias, silu=silu, mode=choice[1], tiles=tuple(choice[2:]))
    if choice[0] == "scaled_mm" and not silu:
        return scaled_mm(x, weight, weight_scale, bias)
    return None
