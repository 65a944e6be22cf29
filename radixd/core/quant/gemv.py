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
* int4, one bf16 row of x on CUDA (``_int4_asm_kernel``): packed bf16 arithmetic in
  inline PTX, two weights per instruction (``int4_dot8_asm``), where the path above spends
  a conversion and an FMA on each.
* ``silu``: W is a (gate | up) projection; each program's tile holds matching gate and up
  rows, and SiLU(gate) * up is its epilogue (``QuantLinear.forward_silu``, batch-1 decode).

Tiles: where ``tuned/quant_gemv.json`` has this GPU's measured tiles for the weight's kind
and shape (``python -m benchmarks.quant_kernels --sweep --write-tuned``), those; else
``gemv_tiles``' rule.

Callers are ``ops``' dispatch and ``QuantLinear``: shapes and dtypes are checked there.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl

from radixd.core.triton_ops import fp8_format, pdl_begin, rope_store_pairs

GEMV_TUNED = Path(__file__).parents[1] / "tuned" / "quant_gemv.json"

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


# One int4 word's 8 products with a bf16 x, in bf16x2 pairs: the word's nibbles n and n + 4
# (columns 8j + n and 8j + n + 4) land in the two halves of one register by a single lop3
# with the exponent of 2**7 OR'd in, so each half reads 2**7 + q exactly; one packed FMA takes
# off the offset (and the zero point 8 when symmetric), one more multiplies by x's matching
# pair and accumulates. The four pairs' sums leave as one fp32 (bf16 -> fp32: a 16-bit
# shift). Per 8 weights: 3 shifts, 4 lop3, 4 packs of x, 8 packed FMAs, where the fp32 path
# spends a conversion and an FMA on each. (bf16 only: an fp16 x takes the fp32 path.)
def _pair(i: int) -> str:
    """PTX for the word's nibbles i and i + 4 (in ``$1``) against x's pair ``$(2 + 2i)``,
    ``$(3 + 2i)``, added to ``acc`` (the first pair starts it)."""
    shift = f"shr.u32 t, $1, {4 * i};\n" if i else ""
    return (f"{shift}lop3.b32 q, {'t' if i else '$1'}, mask, magic, 0xEA;\nfma.rn.bf16x2 q, q, one, off;\n"
            f"mov.b32 xp, {{${2 + 2 * i}, ${3 + 2 * i}}};\nfma.rn.bf16x2 acc, q, xp, {'acc' if i else 'zero'};\n")


def int4_dot8_asm(symmetric: bool) -> str:
    """The PTX: 2**7 + q's offset, with the zero point 8 folded in when ``symmetric``, else
    the asm's last input ($10: the pair -(2**7 + z) for the word's group)."""
    return ("""
{
.reg .b32 q, t, acc, xp, one, off, zero, mask, magic;
mov.b32 one, 0x3F803F80;
mov.b32 off, """ + ("0xC308C308" if symmetric else "$10") + """;
mov.b32 zero, 0;
mov.b32 mask, 0x000F000F;
mov.b32 magic, 0x43004300;
""" + "".join(_pair(i) for i in range(4)) + """shl.b32 t, acc, 16;
and.b32 acc, acc, 0xFFFF0000;
add.f32 $0, t, acc;
}
""")


@triton.jit
def _x_half(base, c):
    return tl.load(base + c).to(tl.int16, bitcast=True)[None, :]


@triton.jit
def _tile_rows(pid, N, G, BLOCK_N: tl.constexpr, PAIRED: tl.constexpr):
    """Program ``pid``'s BLOCK_N weight rows and which are real (rows past N read row 0); with
    PAIRED, BLOCK_N // 2 row pairs (r, r + G), r the p-th of the first halves of consecutive
    2G-row blocks, p = pid * BLOCK_N // 2 + i: the first rows, then their partners (gate | up
    with G = N // 2; a q/k/v head's rotary halves with G = head_dim // 2)."""
    i = tl.arange(0, BLOCK_N)
    if PAIRED:
        p = pid * (BLOCK_N // 2) + i % (BLOCK_N // 2)
        mask = p < N // 2
        rows = (p // G) * (2 * G) + p % G + (i // (BLOCK_N // 2)) * G
    else:
        rows = pid * BLOCK_N + i
        mask = rows < N
    return tl.where(mask, rows, 0), mask


@triton.jit
def _epilogue(y, Y, pid, N, rows, mask, KBuf, VBuf, Pos, Loc, Cos, Sin, stride_cos, stride_bn,
              stride_bh, stride_vbn, stride_vbh, H, HKV, k_scale, v_scale, EPI: tl.constexpr, BLOCK_N: tl.constexpr,
              HALF: tl.constexpr, FP8_MAX: tl.constexpr, FP8_MANT: tl.constexpr):
    """Stores one x row's fp32 sums ``y`` [BLOCK_N] of ``_tile_rows``' rows: EPI 0 as they are;
    else (paired rows, each pair's two sums rounded to Y's dtype first, as the unfused
    projection's output would be) 1: SiLU(gate) * up; 2: ``triton_ops.rope_store_pairs``
    (Y is q [H, 2 * HALF])."""
    if EPI == 0:
        tl.store(Y + rows, y.to(Y.dtype.element_ty), mask=mask)
    else:
        a, b = tl.split(tl.permute(tl.reshape(y, (2, BLOCK_N // 2)), (1, 0)))
        a = a.to(Y.dtype.element_ty).to(tl.float32)
        b = b.to(Y.dtype.element_ty).to(tl.float32)
        pair = pid * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        if EPI == 1:
            tl.store(Y + pair, (a / (1.0 + tl.exp(-a)) * b).to(Y.dtype.element_ty), mask=pair < N // 2)
        else:
            rope_store_pairs(a, b, pair, pair < N // 2, Y, KBuf, VBuf, Pos, Loc, Cos, Sin, stride_cos, stride_bn,
                             stride_bh, stride_vbn, stride_vbh, H, HKV, k_scale, v_scale, HALF, FP8_MAX, FP8_MANT)


@triton.jit
def _int4_asm_kernel(X, W, S, Z, Bias, Y, N, K, stride_w, stride_s, G, KBuf, VBuf, Pos, Loc, Cos, Sin, stride_cos,
                     stride_bn, stride_bh, stride_vbn, stride_vbh, H, HKV, k_scale, v_scale,
                     ASM: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_BIAS: tl.constexpr,
                     EPI: tl.constexpr, HALF: tl.constexpr, FP8_MAX: tl.constexpr, FP8_MANT: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
    """Y[0, tile] for one x row and BLOCK_N int4 weight rows (``_tile_rows``) through
    ``int4_dot8_asm``'s text ``ASM``: per step a sum over each group's words, scaled into a
    per-group accumulator, summed once at the end. (On an H200 this beat a per-word
    accumulator, with scales read per word or broadcast from each group's, by 8-21% summed
    over the 8B projections at each one's fastest tiles.)"""
    pdl_begin(PDL)
    pid = tl.program_id(0)
    offs_n, mask_n = _tile_rows(pid, N, G, BLOCK_N, EPI != 0)
    WORDS: tl.constexpr = BLOCK_K // 8
    SUB: tl.constexpr = BLOCK_K if BLOCK_K < GROUP else GROUP  # columns per scale within a step
    NSUB: tl.constexpr = BLOCK_K // SUB
    acc = tl.zeros([BLOCK_N, NSUB], dtype=tl.float32)
    w_ptrs = W + offs_n[:, None] * stride_w + tl.arange(0, WORDS)[None, :]
    x = X + tl.arange(0, WORDS) * 8
    for k0 in range(0, K, BLOCK_K):
        words = tl.load(w_ptrs)
        g_ptrs = offs_n[:, None] * stride_s + ((k0 + tl.arange(0, NSUB) * SUB) // GROUP)[None, :]
        s = tl.load(S + g_ptrs).to(tl.float32)
        x0, x4, x1, x5 = _x_half(x, 0), _x_half(x, 4), _x_half(x, 1), _x_half(x, 5)
        x2, x6, x3, x7 = _x_half(x, 2), _x_half(x, 6), _x_half(x, 3), _x_half(x, 7)
        w_ptrs += WORDS
        x += BLOCK_K
        if HAS_ZERO:  # -(2**7 + z) in both halves of a register
            z = tl.load(Z + g_ptrs).to(tl.float32)
            off = (-(z + 128.0)).to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
            off = tl.reshape(tl.broadcast_to((off | (off << 16))[:, :, None], (BLOCK_N, NSUB, SUB // 8)),
                             (BLOCK_N, WORDS))
            d = tl.inline_asm_elementwise(ASM, "=r,r,h,h,h,h,h,h,h,h,r", [words, x0, x4, x1, x5, x2, x6, x3, x7, off],
                                          dtype=tl.int32, is_pure=True, pack=1)
        else:
            d = tl.inline_asm_elementwise(ASM, "=r,r,h,h,h,h,h,h,h,h", [words, x0, x4, x1, x5, x2, x6, x3, x7],
                                          dtype=tl.int32, is_pure=True, pack=1)
        acc += tl.sum(tl.reshape(d.to(tl.float32, bitcast=True), (BLOCK_N, NSUB, SUB // 8)), 2) * s
    y = tl.sum(acc, 1)
    if HAS_BIAS:
        y += tl.load(Bias + offs_n).to(tl.float32)
    _epilogue(y, Y, pid, N, offs_n, mask_n, KBuf, VBuf, Pos, Loc, Cos, Sin, stride_cos, stride_bn, stride_bh,
              stride_vbn, stride_vbh, H, HKV, k_scale, v_scale, EPI, BLOCK_N, HALF, FP8_MAX, FP8_MANT)


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
def _gemv_kernel(X, W, S, Z, Bias, Y, M, N, K, stride_xm, stride_w, stride_s, stride_ym, G, KBuf, VBuf, Pos, Loc,
                 Cos, Sin, stride_cos, stride_bn, stride_bh, stride_vbn, stride_vbh, H, HKV, k_scale, v_scale,
                 FP8: tl.constexpr, BITS: tl.constexpr, SCALE: tl.constexpr, SCALE_ROWS: tl.constexpr,
                 GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_BIAS: tl.constexpr,
                 EVEN_K: tl.constexpr, EPI: tl.constexpr, HALF: tl.constexpr, FP8_MAX: tl.constexpr,
                 FP8_MANT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 PDL: tl.constexpr = False):
    """Y[:M, tile] for one tile of BLOCK_N weight rows (``_tile_rows``; ``_epilogue``'s EPI > 0:
    paired rows, one row of x).
    FP8: W fp8 [N, K], S per SCALE (tensor []; channel [N]; block [ceil(N / SCALE_ROWS),
    ceil(K / GROUP)]). Else int: W int32 [N, K // 8] (BITS 4) or uint8 [N, K] (BITS 8), S and
    Z [N, K // GROUP]."""
    pdl_begin(PDL)
    pid = tl.program_id(0)
    offs_n, mask_n = _tile_rows(pid, N, G, BLOCK_N, EPI != 0)  # (masked rows read row 0: no masks on the loads)
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
    if EPI != 0:
        _epilogue(tl.sum(acc, 1), Y, pid, N, offs_n, mask_n, KBuf, VBuf, Pos, Loc, Cos, Sin, stride_cos, stride_bn,
                  stride_bh, stride_vbn, stride_vbh, H, HKV, k_scale, v_scale, EPI, BLOCK_N, HALF, FP8_MAX, FP8_MANT)
    else:
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


def tuned_key(kind: str, n: int, k: int) -> str:
    """``GEMV_TUNED``'s key for a weight of ``kind`` (``fp8 channel``, ``int4 g128 asym``, ...)
    and shape [n, k]."""
    return f"{kind} {n}x{k}"


@functools.cache
def _tuned(gpu: str) -> dict:
    table = json.loads(GEMV_TUNED.read_text()) if GEMV_TUNED.exists() else {}
    return table.get(gpu, {})


def _tiles(x: torch.Tensor, kind: str, n: int, k: int, rule: tuple[int, int, int]) -> tuple[int, int, int]:
    """The measured tiles for one CUDA row of x and a ``kind`` weight [n, k], else ``rule``."""
    if x.shape[0] != 1 or not x.is_cuda:
        return rule
    tiles = _tuned(torch.cuda.get_device_name(x.device)).get(tuned_key(kind, n, k))
    return tuple(tiles) if tiles else rule


def fp8_kind(weight_scale: torch.Tensor, block: tuple[int, int] | None) -> str:
    if block is not None:
        return f"fp8 block{block[0]}x{block[1]}"
    return "fp8 channel" if weight_scale.dim() == 1 else "fp8 tensor"


def int_kind(bits: int, group_size: int, symmetric: bool) -> str:
    return f"int{bits} g{group_size} {'sym' if symmetric else 'asym'}"


@dataclass(frozen=True)
class RopeStore:
    """The q/k/v projection of one token's epilogue (``triton_ops.gemv_rope_store``'s, for a
    quantized weight): q and k rotated at ``position``, k and v stored at slot ``loc`` of the
    layer's buffers (fp8 buffers: divided by the scales, saturated)."""

    position: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    k_buf: torch.Tensor
    v_buf: torch.Tensor
    loc: torch.Tensor
    num_heads: int
    k_scale: float = 1.0
    v_scale: float = 1.0


def _epilogue_args(x: torch.Tensor, n: int, silu: bool, rope: RopeStore | None) -> tuple[torch.Tensor, tuple, dict]:
    """The output, ``_epilogue``'s runtime arguments (G first) and its constexprs."""
    if rope is None:
        y = torch.empty((x.shape[0], n // 2 if silu else n), dtype=x.dtype, device=x.device)
        args = (n // 2 if silu else 0, *(y,) * 6, 0, 0, 0, 0, 0, 0, 0, 1.0, 1.0)
        return y, args, dict(EPI=1 if silu else 0, HALF=1, FP8_MAX=0.0, FP8_MANT=0)
    kb, vb = rope.k_buf, rope.v_buf
    hkv, dim = kb.shape[1], kb.shape[2]
    if n != (rope.num_heads + 2 * hkv) * dim or dim % 2 or x.shape[0] != 1:
        raise ValueError(f"GEMV with rope: {n} rows for {rope.num_heads} + 2 x {hkv} heads of {dim}, one row of x")
    y = torch.empty((1, rope.num_heads, dim), dtype=x.dtype, device=x.device)
    args = (dim // 2, kb, vb, rope.position, rope.loc, rope.cos, rope.sin, rope.cos.stride(0), kb.stride(0),
            kb.stride(1), vb.stride(0), vb.stride(1), rope.num_heads, hkv, rope.k_scale, rope.v_scale)
    return y, args, dict(EPI=2, HALF=dim // 2, **fp8_format(kb))


def _launch(x, w, s, z, bias, n, k, *, fp8, bits, scale, scale_rows, group, tiles, silu=False, rope=None, pdl=False):
    m = x.shape[0]
    if m > 4 or ((silu or rope is not None) and (m != 1 or n % 2)) or (silu and bias is not None):
        raise ValueError(f"GEMV: {m} rows of x, at most 4 (more go to the GEMM kernels); with silu or rope one, "
                         f"an even N ({n}) and (silu) no bias")
    bn, bk, warps = tiles
    if (scale == SCALE_BLOCK and bk % group and group % bk) or (not fp8 and k % bk):
        raise ValueError(f"GEMV: K step {bk} and scale groups of {group} columns (K={k}) do not nest")
    if (silu or rope is not None) and bn % 2:
        raise ValueError(f"GEMV with silu or rope: {bn} weight rows per program, not pairs")
    y, epi, consts = _epilogue_args(x, n, silu, rope)
    grid = (triton.cdiv(n // 2, bn // 2) if consts["EPI"] else triton.cdiv(n, bn),)
    asm = _asm_for(x, fp8, bits, z is None, group)
    if asm:
        _int4_asm_kernel[grid](
            x, w, s, z if z is not None else s, bias if bias is not None else s, y, n, k, w.stride(0), s.stride(0),
            *epi, ASM=asm, GROUP=group, HAS_ZERO=z is not None, HAS_BIAS=bias is not None, BLOCK_N=bn,
            BLOCK_K=bk, num_warps=warps, PDL=pdl, launch_pdl=pdl, **consts)
        return y
    _gemv_kernel[grid](
        x, w, s, z if z is not None else s, bias if bias is not None else s, y,
        m, n, k, x.stride(0), w.stride(0), s.stride(0) if s.dim() == 2 else 0, y.stride(0), *epi,
        FP8=fp8, BITS=bits, SCALE=scale, SCALE_ROWS=scale_rows, GROUP=group, HAS_ZERO=z is not None,
        HAS_BIAS=bias is not None, EVEN_K=k % bk == 0,
        BLOCK_M=triton.next_power_of_2(m), BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, PDL=pdl, launch_pdl=pdl,
        **consts)
    return y


def _asm_for(x: torch.Tensor, fp8: bool, bits: int, symmetric: bool, group: int) -> str:
    """The int4 packed-pair asm for one bf16 row of x on CUDA (packed bf16 FMAs: sm_80 on)
    and groups of whole words, else "" (``_gemv_kernel``)."""
    if fp8 or bits != 4 or x.shape[0] != 1 or group % 8 or not x.is_cuda or x.dtype != torch.bfloat16:
        return ""
    return int4_dot8_asm(symmetric) if torch.cuda.get_device_capability(x.device) >= (8, 0) else ""


def fp8_gemv(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, block: tuple[int, int] | None,
             bias: torch.Tensor | None, *, tiles: tuple[int, int, int] | None = None,
             silu: bool = False, rope: RopeStore | None = None, pdl: bool = False) -> torch.Tensor:
    """``x @ W.T + bias`` for an fp8 weight (``ops``' layout), x [M <= 4, K] unquantized; with
    ``silu`` (W = gate | up, one row of x, no bias) SiLU(gate) * up of it, [1, N // 2]; with
    ``rope`` (W = q | k | v heads, one row of x) ``rope``'s epilogue: returns q [1, H, D].
    ``pdl``: launched for programmatic dependent launch (``triton_ops.pdl_begin``)."""
    n, k = weight.shape
    if block is not None:
        scale, rows, group = SCALE_BLOCK, block[0], block[1]
    else:
        scale, rows, group = (SCALE_CHANNEL if weight_scale.dim() == 1 else SCALE_TENSOR), 1, k
    if tiles is None:
        tiles = _tiles(x, fp8_kind(weight_scale, block), n, k,
                       gemv_tiles("fp8", x.shape[0], k, group if block is not None else None))
    return _launch(x, weight, weight_scale, None, bias, n, k, fp8=True, bits=8, scale=scale, scale_rows=rows,
                   group=group, tiles=tiles, silu=silu, rope=rope, pdl=pdl)


def int_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, bits: int,
             group_size: int, perm: torch.Tensor | None, bias: torch.Tensor | None, *,
             tiles: tuple[int, int, int] | None = None, silu: bool = False,
             rope: RopeStore | None = None, pdl: bool = False) -> torch.Tensor:
    """``x[:, perm] @ W.T + bias`` for an int4/int8 weight (``ops``' layout), x [M <= 4, K];
    ``silu``, ``rope`` and ``pdl`` as ``fp8_gemv``'s."""
    n, k = qweight.shape[0], x.shape[1]
    tiles = tiles or _tiles(x, int_kind(bits, group_size, zeros is None), n, k,
                            gemv_tiles(f"int{bits}", x.shape[0], k, group_size))
    if bits == 4 and tiles[1] % 8:
        raise ValueError(f"int4 GEMV: K step {tiles[1]} is not a multiple of 8 (group_size {group_size})")
    if perm is not None:  # (one gather of x's columns up front: per program, they would be scattered reads)
        x = x.index_select(1, perm)
    return _launch(x, qweight, scales, zeros, bias, n, k, fp8=False, bits=bits, scale=SCALE_BLOCK, scale_rows=1,
                   group=group_size, tiles=tiles, silu=silu, rope=rope, pdl=pdl)
