"""The mixture-of-experts MLP: each token through the gated MLPs of its top-k experts, their
outputs summed with the router's weights.

    x [T, H]; gate_up [E, 2I, H] (each expert's gate rows, then its up rows); down [E, H, I];
    ids, weights [T, k]:
        y[t] = sum_j weights[t, j] * down[e] @ (SiLU(gate[e] @ x[t]) * up[e] @ x[t]),  e = ids[t, j]

The experts may be fp8 (a quantized checkpoint's): ``scales`` (gate_up's, down's) per expert
and output row [E, N], or per ``block`` of (bn, bk) weights [E, ceil(N / bn), ceil(K / bk)];
each weight is dequantized to x's dtype as it is read (the torch path: each expert's whole
weight, ``ops.dequantize_fp8``), so both paths compute the dequantized model's MLP.

``fused_experts`` computes it one of two ways:

* ``experts_torch`` (CPU, and the reference): for each expert that has tokens,
  ``index_select`` of its tokens, two matmuls, ``index_add_`` of the weighted result.
* ``experts_triton`` (CUDA): the T*k (token, slot) pairs are grouped by expert and each
  expert's run padded to a multiple of BLOCK_M (``align_pairs``); one grouped GEMM kernel
  computes SiLU(gate) * up for every pair (gate and up tiles in the same program, the
  activation in its epilogue), a second the down projection times the pair's weight; the k
  slots of each token are summed last. A block of pairs reads only its expert's weights and
  only experts with tokens have blocks, so a decode step reads the chosen experts' weights
  and no others. Up to ``PAIRS_UNSORTED`` pairs (decode at batch 1 and 2 of a top-8 model)
  each pair is its own block in pair order and the kernels read the router's ids as the
  blocks' experts: no alignment step at all.

The Triton path keeps everything on the device with sizes known from T alone (no host sync),
so it runs inside a CUDA graph: the grid covers the most blocks T*k pairs can need and the
programs past the blocks in use return at once.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from radixd.core.quant.ops import dequantize_fp8
from radixd.core.triton_ops import silu_mul

PAIRS_UNSORTED = 16  # up to this many (token, slot) pairs: one block per pair, no sort
CHUNK_TOKENS = 4096  # tokens per launch pair (a 16k-token prefill at top-8 would hold ~0.7 GB of pair rows)


class MoETiles(NamedTuple):
    """Launch shape of the two grouped GEMMs."""

    block_m: int                           # pairs per block (>= 16: tl.dot's smallest M)
    gate_up: tuple[int, int, int, int]     # (BLOCK_N, BLOCK_K, warps, stages) of the gate/up GEMM
    down: tuple[int, int, int, int]        # the same for the down GEMM


FEW_PAIRS_TILES = MoETiles(16, (32, 128, 4, 4), (64, 128, 4, 4))   # decode: weight reads dominate
MANY_PAIRS_TILES = MoETiles(64, (64, 64, 4, 3), (128, 64, 4, 3))   # prefill and large batches


def moe_tiles(pairs: int) -> MoETiles:
    return FEW_PAIRS_TILES if pairs <= 1024 else MANY_PAIRS_TILES


Scales = tuple[torch.Tensor, torch.Tensor] | None  # fp8 experts: gate_up's and down's scales


def fused_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
                  ids: torch.Tensor, *, scales: Scales = None, block: tuple[int, int] | None = None,
                  use_triton: bool | None = None) -> torch.Tensor:
    """The MoE MLP's output [T, H] (see the module docstring). ``use_triton``: None picks the
    Triton kernels on CUDA and ``experts_torch`` elsewhere."""
    if x.is_cuda if use_triton is None else use_triton:
        return experts_triton(x, gate_up, down, weights, ids, scales=scales, block=block)
    return experts_torch(x, gate_up, down, weights, ids, scales=scales, block=block)


def _expert_weight(w: torch.Tensor, scales: torch.Tensor | None, e: int, block, dtype: torch.dtype) -> torch.Tensor:
    return w[e] if scales is None else dequantize_fp8(w[e], scales[e], block).to(dtype)


def experts_torch(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
                  ids: torch.Tensor, *, scales: Scales = None, block: tuple[int, int] | None = None) -> torch.Tensor:
    """A loop over the experts that have tokens: gather them, the gated MLP, scatter-add back."""
    k = ids.shape[1]
    flat = ids.flatten()
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
    tokens = order // k
    w = weights.flatten()[order].to(x.dtype)
    out = torch.zeros_like(x)
    start = 0
    for e, c in enumerate(counts):
        if not c:
            continue
        idx = tokens[start:start + c]
        gu, dn = (_expert_weight(m, s, e, block, x.dtype)
                  for m, s in zip((gate_up, down), scales or (None, None), strict=True))
        act = silu_mul(F.linear(x.index_select(0, idx), gu), use_triton=False)
        out.index_add_(0, idx, F.linear(act, dn) * w[start:start + c, None])
        start += c
    return out


def align_pairs(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Blocks of ``block_m`` pair ids (pair p = token p // k, slot p % k), each block one
    expert's: ``sorted`` [blocks * block_m] (the pair count T*k marks padding),
    ``block_expert`` [blocks], ``used`` [1] (rows of ``sorted`` in blocks in use; the blocks
    after them are padding of the fixed-size grid). Device ops only, sizes from T*k alone."""
    flat = ids.flatten()
    n = flat.numel()
    dev = flat.device
    max_blocks = min(n, triton.cdiv(n, block_m) + num_experts)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    blocks = (counts + block_m - 1) // block_m
    block_end = blocks.cumsum(0)
    order = flat.argsort(stable=True)
    expert = flat[order]
    rank = torch.arange(n, device=dev) - (counts.cumsum(0) - counts)[expert]  # within its expert's run
    dest = (block_end - blocks)[expert] * block_m + rank
    sorted_ids = torch.full((max_blocks * block_m,), n, dtype=torch.int64, device=dev).scatter_(0, dest, order)
    block_expert = torch.searchsorted(block_end, torch.arange(max_blocks, device=dev), right=True)
    return sorted_ids, block_expert.clamp_(max=num_experts - 1), block_end[-1:] * block_m


@triton.jit
def _experts_kernel(X, W, S, Y, Sorted, BlockExpert, Used, Weights, n_pairs, N, K, x_row_div,
                    stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_ym,
                    GATE_UP: tl.constexpr, UNSORTED: tl.constexpr, EVEN_K: tl.constexpr, FP8: tl.constexpr,
                    SCALE_N: tl.constexpr, SCALE_K: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One BLOCK_M x BLOCK_N tile of Y for one block of pairs, all of one expert e: with
    GATE_UP, Y[p] = SiLU(W[e, gate] @ x) * (W[e, up] @ x), W[e]'s rows N gate then N up, x
    row p // x_row_div of X (the pair's token); else Y[p] = Weights[p] * W[e] @ X[p].
    The blocks: ``align_pairs``' (Sorted, BlockExpert, Used), or with UNSORTED block b is
    pair b alone and BlockExpert the pairs' expert ids (Sorted and Used unread).
    FP8: W in fp8, scales S[e] per output row (SCALE_K 0) or per SCALE_N x SCALE_K block;
    each weight tile dequantized to X's dtype before its product (block scales), or the
    product scaled per column (row scales)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if UNSORTED:
        pairs = tl.where(tl.arange(0, BLOCK_M) == 0, pid_m, n_pairs)
    else:
        if pid_m * BLOCK_M >= tl.load(Used):
            return
        pairs = tl.load(Sorted + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < n_pairs
    rows = pairs // x_row_div
    e = tl.load(BlockExpert + pid_m)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    w_cols = W + e * stride_we + offs_n[None, :] * stride_wn  # W[e]'s rows as a [K, N] tile's columns
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)  # (GATE_UP only)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            mask_x = valid[:, None]
            mask_w = mask_n[None, :]
        else:
            mask_x = valid[:, None] & (offs_k[None, :] < K)
            mask_w = mask_n[None, :] & (offs_k[:, None] < K)
        x = tl.load(X + rows[:, None] * stride_xm + offs_k[None, :], mask=mask_x, other=0.0)
        w_ptrs = w_cols + offs_k[:, None]
        acc = tl.dot(x, _weight_tile(w_ptrs, mask_w, S, e, offs_n, offs_k, stride_se, stride_sn, X, FP8,
                                     SCALE_N, SCALE_K), acc)
        if GATE_UP:
            acc_up = tl.dot(x, _weight_tile(w_ptrs + N * stride_wn, mask_w, S, e, offs_n + N, offs_k, stride_se,
                                            stride_sn, X, FP8, SCALE_N, SCALE_K), acc_up)
    if FP8 and SCALE_K == 0:  # (per output row: the tile's columns)
        s_row = S + e * stride_se + offs_n * stride_sn
        acc = acc * tl.load(s_row, mask=mask_n, other=0.0)[None, :]
        if GATE_UP:
            acc_up = acc_up * tl.load(s_row + N * stride_sn, mask=mask_n, other=0.0)[None, :]
    if GATE_UP:  # (rounded as the unfused projection's output would be)
        g = acc.to(Y.dtype.element_ty).to(tl.float32)
        acc = g / (1.0 + tl.exp(-g)) * acc_up.to(Y.dtype.element_ty).to(tl.float32)
    else:
        acc = acc * tl.load(Weights + pairs, mask=valid, other=0.0).to(tl.float32)[:, None]
    tl.store(Y + pairs[:, None] * stride_ym + offs_n[None, :], acc.to(Y.dtype.element_ty),
             mask=valid[:, None] & mask_n[None, :])


@triton.jit
def _weight_tile(w_ptrs, mask_w, S, e, offs_n, offs_k, stride_se, stride_sn, X, FP8: tl.constexpr,
                 SCALE_N: tl.constexpr, SCALE_K: tl.constexpr):
    """A [BLOCK_K, BLOCK_N] tile of W[e]'s rows ``offs_n`` (as columns) in X's dtype: fp8
    weights converted, and with block scales (SCALE_K > 0) multiplied by their block's."""
    w = tl.load(w_ptrs, mask=mask_w, other=0.0)
    if FP8:
        if SCALE_K > 0:
            s = tl.load(S + e * stride_se + (offs_n // SCALE_N)[None, :] * stride_sn + (offs_k // SCALE_K)[:, None],
                        mask=mask_w, other=0.0)
            w = w.to(tl.float32) * s
        w = w.to(X.dtype.element_ty)
    return w


def experts_triton(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
                   ids: torch.Tensor, *, scales: Scales = None, block: tuple[int, int] | None = None,
                   tiles: MoETiles | None = None, chunk_tokens: int = CHUNK_TOKENS) -> torch.Tensor:
    """The two grouped GEMMs over ``align_pairs``' blocks, then the sum over each token's k
    slots; ``chunk_tokens`` tokens at a time (a long prefill's pair buffers stay bounded).
    ``tiles``: instead of ``moe_tiles``' choice (benchmarks sweep them)."""
    if x.shape[0] <= chunk_tokens:
        return _experts_triton(x, gate_up, down, weights, ids, tiles, scales, block)
    out = torch.empty_like(x)
    for s in range(0, x.shape[0], chunk_tokens):
        e = s + chunk_tokens
        out[s:e] = _experts_triton(x[s:e], gate_up, down, weights[s:e], ids[s:e], tiles, scales, block)
    return out


def _experts_triton(x, gate_up, down, weights, ids, tiles: MoETiles | None, scales: Scales, block) -> torch.Tensor:
    t, h = x.shape
    num_experts, two_i, _ = gate_up.shape
    inter = two_i // 2
    k = ids.shape[1]
    n = t * k
    bm, up_tiles, down_tiles = tiles or moe_tiles(n)
    unsorted = n <= PAIRS_UNSORTED
    if unsorted:
        block_expert = ids.flatten()
        sorted_ids = used = block_expert  # (unread)
        blocks = n
    else:
        sorted_ids, block_expert, used = align_pairs(ids, num_experts, bm)
        blocks = sorted_ids.numel() // bm
    flat_w = weights.flatten()
    act = torch.empty((n, inter), dtype=x.dtype, device=x.device)
    out = torch.empty((n, h), dtype=x.dtype, device=x.device)
    scale_n, scale_k = block or (1, 0)
    for src, w, sc, dst, row_div, gate, (bn, bk, warps, stages) in (
            (x, gate_up, scales and scales[0], act, k, True, up_tiles),
            (act, down, scales and scales[1], out, 1, False, down_tiles)):
        width, depth = dst.shape[1], src.shape[1]
        sc = sc if sc is not None else w  # (unread without fp8)
        _experts_kernel[(blocks, triton.cdiv(width, bn))](
            src, w, sc, dst, sorted_ids, block_expert, used, flat_w, n, width, depth, row_div,
            src.stride(0), w.stride(0), w.stride(1), sc.stride(0), sc.stride(1), dst.stride(0),
            GATE_UP=gate, UNSORTED=unsorted, EVEN_K=depth % bk == 0, FP8=scales is not None, SCALE_N=scale_n,
            SCALE_K=scale_k, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)
    return out.view(t, k, h).sum(1)
