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

``experts_gemv`` (decode at batch 1: the model routes from the router's logits inside it)
computes it as two matrix-vector kernels over the k chosen experts' rows side by side, and
``add_rmsnorm_router`` puts the residual add, the norm before the block and the router's GEMV
in one kernel: the block is three kernels.

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
from radixd.core.triton_ops import pdl_begin, silu_mul

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
                   tiles: MoETiles | None = None, chunk_tokens: int = CHUNK_TOKENS,
                   gemv: bool | None = None) -> torch.Tensor:
    """The two grouped GEMMs over ``align_pairs``' blocks, then the sum over each token's k
    slots; ``chunk_tokens`` tokens at a time (a long prefill's pair buffers stay bounded).
    ``tiles``: instead of ``moe_tiles``' choice (benchmarks sweep them). ``gemv``: True takes
    ``experts_gemv`` with this routing instead (at 1 token on an H200 slower than these
    kernels, 46.6 vs 32.7 us, where ``experts_gemv`` routing from the logits itself takes 35.6
    us against 53.5 for ``route`` and these: the model routes in the kernel)."""
    if gemv:
        return experts_gemv(x, gate_up, down, weights=weights, ids=ids, scales=scales, block=block)
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


# ----------------------------------------------------------------------------- a few tokens: GEMVs

GEMV_MAX_TOKENS = 1  # up to this many tokens ``SparseMoE`` routes in the GEMV kernels (``experts_gemv``)


class GemvTiles(NamedTuple):
    """Launch shape of one of ``experts_gemv``'s kernels (a plain tuple of its first three or
    more fields is taken too)."""

    rows: int               # output rows per program (gate/up: gate rows, each with its up row)
    k_step: int             # K per loop step
    warps: int
    prefetch: bool = False  # step i + 1's loads issued before step i's products (K a multiple of k_step)


# The fastest of ``benchmarks.moe --sections gemv_tiles`` on an H200 (1 token, Qwen3-30B-A3B's layer)
GEMV_UP_TILES = GemvTiles(4, 256, 16, prefetch=True)
GEMV_DOWN_TILES = GemvTiles(8, 256, 8, prefetch=True)


@triton.jit
def _route_token(Logits, t, E, stride_lt, TOP_K: tl.constexpr, RENORM: tl.constexpr, BLOCK_E: tl.constexpr,
                 BLOCK_J: tl.constexpr):
    """``route``'s choice for token ``t`` from its router logits: expert ids and float32
    weights of its slots [BLOCK_J] (slots from TOP_K on: expert 0, weight 0). Each expert's
    rank (how many beat it; among equals the lower id first) from one comparison of all pairs
    of logits (the softmax keeps their order, so the ranks need not wait for it), and slot j
    the expert of rank j; its weight exp(logit - max) over the sum of that over all E experts
    (the softmax) or, with RENORM, over the TOP_K chosen (the softmax's denominator cancels in
    the rescaling)."""
    offs = tl.arange(0, BLOCK_E)
    live = offs < E
    logit = tl.load(Logits + t * stride_lt + offs, mask=live, other=float("-inf")).to(tl.float32)
    mine = logit[:, None]
    other = logit[None, :]
    beats = (other > mine) | ((other == mine) & (offs[None, :] < offs[:, None]))
    rank = tl.sum(beats.to(tl.int32), 1)
    p = tl.where(live, tl.exp(logit - tl.max(logit, 0)), 0.0)
    slot = tl.arange(0, BLOCK_J)
    sel = (rank[None, :] == slot[:, None]) & live[None, :] & (slot < TOP_K)[:, None]
    ids = tl.sum(tl.where(sel, offs[None, :], 0), 1)
    w = tl.sum(tl.where(sel, p[None, :], 0.0), 1)
    if RENORM:
        w = w / tl.sum(tl.where(rank < TOP_K, p, 0.0), 0)
    else:
        w = w / tl.sum(p, 0)
    return ids, w


@triton.jit
def _gemv_dequant(w, mask, S, e, rows, offs_k, stride_se, stride_sn, dtype,
                  FP8: tl.constexpr, SCALE_N: tl.constexpr, SCALE_K: tl.constexpr):
    """A loaded weight tile (rows x K step) as float32: fp8 weights with block scales
    dequantized and rounded to the activations' ``dtype`` (as ``dequantize_fp8(...).to(dtype)``
    would)."""
    if FP8:
        w = w.to(tl.float32)
        if SCALE_K > 0:
            s = tl.load(S + e * stride_se + (rows // SCALE_N) * stride_sn + offs_k // SCALE_K, mask=mask, other=0.0)
            w = (w * s).to(dtype)
    return w.to(tl.float32)


@triton.jit
def _moe_gemv_up_kernel(X, W, S, Act, Ids, Wts, Logits, N, K, E, stride_xt, stride_we, stride_wn, stride_se,
                        stride_sn, stride_lt, TOP_K: tl.constexpr, BLOCK_J: tl.constexpr, ROUTE: tl.constexpr,
                        RENORM: tl.constexpr, BLOCK_E: tl.constexpr, FP8: tl.constexpr, SCALE_N: tl.constexpr,
                        SCALE_K: tl.constexpr, EVEN_K: tl.constexpr, PREFETCH: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
    """Act[p, n] = SiLU(gate[e] @ x) * (up[e] @ x) for BLOCK_N gate rows n (with their up
    rows n + N) of all TOP_K experts e of token t (pair p = t * TOP_K + slot), the k experts'
    rows read side by side ([BLOCK_J, BLOCK_N, BLOCK_K] tiles). ROUTE: the experts and their
    weights from the token's router logits (``_route_token``, once per program), written to
    Ids/Wts by the token's first program; else read from Ids. PREFETCH (EVEN_K only): the
    loads of step i + 1 (weights and x) are issued before step i's products, so that a
    program keeps two steps' reads in flight instead of waiting out each step's latency."""
    pdl_begin(PDL)
    pid_n = tl.program_id(0)
    t = tl.program_id(1)
    slot = tl.arange(0, BLOCK_J)
    live = slot < TOP_K
    pair = t * TOP_K + slot
    if ROUTE:
        e, wt = _route_token(Logits, t, E, stride_lt, TOP_K, RENORM, BLOCK_E, BLOCK_J)
        if pid_n == 0:
            tl.store(Ids + pair, e, mask=live)
            tl.store(Wts + pair, wt, mask=live)
    else:
        e = tl.load(Ids + pair, mask=live, other=0)
    e = e.to(tl.int64)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_jn = live[:, None] & (rows < N)[None, :]
    e3 = e[:, None, None]
    rows3 = rows[None, :, None]
    gate_rows = W + e3 * stride_we + rows3 * stride_wn
    up_rows = gate_rows + N * stride_wn
    x_row = X + t * stride_xt
    kk = tl.arange(0, BLOCK_K)
    dt = X.dtype.element_ty
    gate = tl.zeros([BLOCK_J, BLOCK_N], dtype=tl.float32)
    up = tl.zeros([BLOCK_J, BLOCK_N], dtype=tl.float32)
    if PREFETCH:
        mask = mask_jn[:, :, None]
        g_next = tl.load(gate_rows + kk[None, None, :], mask=mask, other=0.0)
        u_next = tl.load(up_rows + kk[None, None, :], mask=mask, other=0.0)
        x_next = tl.load(x_row + kk)
        for k0 in range(0, K, BLOCK_K):
            g_w = g_next
            u_w = u_next
            x = x_next.to(tl.float32)[None, None, :]
            k3 = (k0 + kk)[None, None, :]
            more = mask & (k3 + BLOCK_K < K)
            g_next = tl.load(gate_rows + k3 + BLOCK_K, mask=more, other=0.0)
            u_next = tl.load(up_rows + k3 + BLOCK_K, mask=more, other=0.0)
            x_next = tl.load(x_row + k0 + BLOCK_K + kk, mask=k0 + BLOCK_K + kk < K, other=0.0)
            gate += tl.sum(_gemv_dequant(g_w, mask, S, e3, rows3, k3, stride_se, stride_sn, dt, FP8, SCALE_N,
                                         SCALE_K) * x, 2)
            up += tl.sum(_gemv_dequant(u_w, mask, S, e3, rows3 + N, k3, stride_se, stride_sn, dt, FP8, SCALE_N,
                                       SCALE_K) * x, 2)
    else:
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + kk
            k3 = offs_k[None, None, :]
            if EVEN_K:
                x = tl.load(x_row + offs_k)
                mask = mask_jn[:, :, None]
            else:
                x = tl.load(x_row + offs_k, mask=offs_k < K, other=0.0)
                mask = mask_jn[:, :, None] & (k3 < K)
            x = x.to(tl.float32)[None, None, :]
            g_w = tl.load(gate_rows + k3, mask=mask, other=0.0)
            u_w = tl.load(up_rows + k3, mask=mask, other=0.0)
            gate += tl.sum(_gemv_dequant(g_w, mask, S, e3, rows3, k3, stride_se, stride_sn, dt, FP8, SCALE_N,
                                         SCALE_K) * x, 2)
            up += tl.sum(_gemv_dequant(u_w, mask, S, e3, rows3 + N, k3, stride_se, stride_sn, dt, FP8, SCALE_N,
                                       SCALE_K) * x, 2)
    if FP8 and SCALE_K == 0:  # (per output row)
        s_row = S + e[:, None] * stride_se + rows[None, :] * stride_sn
        gate = gate * tl.load(s_row, mask=mask_jn, other=0.0)
        up = up * tl.load(s_row + N * stride_sn, mask=mask_jn, other=0.0)
    g = gate.to(Act.dtype.element_ty).to(tl.float32)  # (rounded as the unfused projection's output would be)
    act = g / (1.0 + tl.exp(-g)) * up.to(Act.dtype.element_ty).to(tl.float32)
    tl.store(Act + pair.to(tl.int64)[:, None] * N + rows[None, :], act.to(Act.dtype.element_ty), mask=mask_jn)


@triton.jit
def _moe_gemv_down_kernel(Act, W, S, Y, Ids, Wts, N, K, stride_we, stride_wn, stride_se, stride_sn, stride_yt,
                          TOP_K: tl.constexpr, BLOCK_J: tl.constexpr, FP8: tl.constexpr, SCALE_N: tl.constexpr,
                          SCALE_K: tl.constexpr, EVEN_K: tl.constexpr, PREFETCH: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
    """Y[t, n] = sum over the token's TOP_K slots j of Wts[p] * down[e] @ Act[p] (p = t *
    TOP_K + j, e = Ids[p]) for BLOCK_N output rows n: the k experts' rows read side by side
    ([BLOCK_J, BLOCK_N, BLOCK_K] tiles) and summed in float32 in the program, so the token's
    output is written once, whole. PREFETCH as in ``_moe_gemv_up_kernel`` (weights and Act)."""
    pdl_begin(PDL)
    pid_n = tl.program_id(0)
    t = tl.program_id(1)
    slot = tl.arange(0, BLOCK_J)
    live = slot < TOP_K
    pair = t * TOP_K + slot
    e = tl.load(Ids + pair, mask=live, other=0).to(tl.int64)
    wt = tl.load(Wts + pair, mask=live, other=0.0).to(tl.float32)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_jn = live[:, None] & (rows < N)[None, :]
    e3 = e[:, None, None]
    rows3 = rows[None, :, None]
    w_rows = W + e3 * stride_we + rows3 * stride_wn
    a_rows = Act + pair.to(tl.int64)[:, None, None] * K
    kk = tl.arange(0, BLOCK_K)
    dt = Act.dtype.element_ty
    acc = tl.zeros([BLOCK_J, BLOCK_N], dtype=tl.float32)
    if PREFETCH:
        mask = mask_jn[:, :, None]
        mask_a = live[:, None, None]
        w_next = tl.load(w_rows + kk[None, None, :], mask=mask, other=0.0)
        a_next = tl.load(a_rows + kk[None, None, :], mask=mask_a, other=0.0)
        for k0 in range(0, K, BLOCK_K):
            w = w_next
            a = a_next.to(tl.float32)
            k3 = (k0 + kk)[None, None, :]
            w_next = tl.load(w_rows + k3 + BLOCK_K, mask=mask & (k3 + BLOCK_K < K), other=0.0)
            a_next = tl.load(a_rows + k3 + BLOCK_K, mask=mask_a & (k3 + BLOCK_K < K), other=0.0)
            acc += tl.sum(_gemv_dequant(w, mask, S, e3, rows3, k3, stride_se, stride_sn, dt, FP8, SCALE_N,
                                        SCALE_K) * a, 2)
    else:
        for k0 in range(0, K, BLOCK_K):
            k3 = (k0 + kk)[None, None, :]
            if EVEN_K:
                mask_a = live[:, None, None]
                mask = mask_jn[:, :, None]
            else:
                mask_a = live[:, None, None] & (k3 < K)
                mask = mask_jn[:, :, None] & (k3 < K)
            a = tl.load(a_rows + k3, mask=mask_a, other=0.0).to(tl.float32)
            w = tl.load(w_rows + k3, mask=mask, other=0.0)
            acc += tl.sum(_gemv_dequant(w, mask, S, e3, rows3, k3, stride_se, stride_sn, dt, FP8, SCALE_N,
                                        SCALE_K) * a, 2)
    if FP8 and SCALE_K == 0:
        acc = acc * tl.load(S + e[:, None] * stride_se + rows[None, :] * stride_sn, mask=mask_jn, other=0.0)
    y = tl.sum(acc * wt[:, None], 0)
    tl.store(Y + t * stride_yt + rows, y.to(Y.dtype.element_ty), mask=rows < N)


def experts_gemv(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, *, weights: torch.Tensor | None = None,
                 ids: torch.Tensor | None = None, logits: torch.Tensor | None = None, top_k: int = 0,
                 renormalize: bool = False, scales: Scales = None, block: tuple[int, int] | None = None,
                 up_tiles: tuple | None = None, down_tiles: tuple | None = None, pdl: bool = False) -> torch.Tensor:
    """The MoE MLP of a few tokens (decode at batch 1) as two matrix-vector kernels, each
    reading every chosen expert's weights once in long contiguous rows (no tl.dot, whose
    smallest tile would be 16 rows of which one is real):

    * gate/up (``gemv_gate_up``): a program per (``rows`` gate rows, token) reads those rows
      (and their up rows) of all k chosen experts side by side, SiLU(gate) * up in its
      epilogue;
    * down (``gemv_down``): a program per (``rows`` output rows, token) reads those rows of
      all k chosen experts, weighs each by the router and sums them: the token's output, no
      [T, k, H] partials and no sum kernel after.

    The routing: ``weights``/``ids`` [T, k] (``route``'s), or the router's ``logits`` [T, E]
    with ``top_k`` and ``renormalize``, ``route``'s softmax, top-k and rescaling then done in
    the gate/up kernel (no kernels for them). fp8 experts as ``experts_triton`` takes them.
    Sizes from T alone: CUDA-graph safe. ``up_tiles``/``down_tiles``: ``GemvTiles`` instead of
    ``GEMV_UP_TILES``/``GEMV_DOWN_TILES`` (benchmarks sweep them). ``pdl``: both kernels
    launched for programmatic dependent launch (``triton_ops.pdl_begin``)."""
    k = top_k if logits is not None else ids.shape[1]
    gs, ds = scales if scales is not None else (None, None)
    act, ids_, wts = gemv_gate_up(x, gate_up, weights=weights, ids=ids, logits=logits, top_k=k,
                                  renormalize=renormalize, scales=gs, block=block, tiles=up_tiles, pdl=pdl)
    return gemv_down(act, down, ids_, wts, k, scales=ds, block=block, tiles=down_tiles, pdl=pdl)


def gemv_gate_up(x: torch.Tensor, gate_up: torch.Tensor, *, weights: torch.Tensor | None = None,
                 ids: torch.Tensor | None = None, logits: torch.Tensor | None = None, top_k: int = 0,
                 renormalize: bool = False, scales: torch.Tensor | None = None, block: tuple[int, int] | None = None,
                 tiles: tuple | None = None, pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``experts_gemv``'s first kernel: (act [T * k, I], ids [T * k], weights [T * k]), the
    pairs' SiLU(gate) * up and their routing (the caller's, or the kernel's from ``logits``)."""
    t, h = x.shape
    num_experts, two_i, _ = gate_up.shape
    inter = two_i // 2
    if logits is None:
        top_k = ids.shape[1]
    pairs = t * top_k
    dev = x.device
    act = torch.empty((pairs, inter), dtype=x.dtype, device=dev)
    route = logits is not None
    if not route:
        ids_, wts = ids.reshape(-1), weights.reshape(-1)
        stride_lt = 0
        logits = wts  # (unread)
    else:
        ids_ = torch.empty(pairs, dtype=torch.int32, device=dev)
        wts = torch.empty(pairs, dtype=torch.float32, device=dev)
        stride_lt = logits.stride(0)
    scale_n, scale_k = block or (1, 0)
    gs = scales if scales is not None else gate_up  # (unread without fp8)
    bn, bk, warps, prefetch = GemvTiles(*(tiles or GEMV_UP_TILES))
    bk = min(bk, triton.next_power_of_2(h))
    _moe_gemv_up_kernel[(triton.cdiv(inter, bn), t)](
        x, gate_up, gs, act, ids_, wts, logits, inter, h, num_experts, x.stride(0), gate_up.stride(0),
        gate_up.stride(1), gs.stride(0), gs.stride(1), stride_lt, TOP_K=top_k,
        BLOCK_J=triton.next_power_of_2(top_k), ROUTE=route, RENORM=renormalize,
        BLOCK_E=triton.next_power_of_2(num_experts), FP8=scales is not None, SCALE_N=scale_n, SCALE_K=scale_k,
        EVEN_K=h % bk == 0, PREFETCH=bool(prefetch) and h % bk == 0, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps,
        PDL=pdl, launch_pdl=pdl)
    return act, ids_, wts


def gemv_down(act: torch.Tensor, down: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, top_k: int, *,
              scales: torch.Tensor | None = None, block: tuple[int, int] | None = None,
              tiles: tuple | None = None, pdl: bool = False) -> torch.Tensor:
    """``experts_gemv``'s second kernel: each token's output [T, H] from its ``top_k`` pairs'
    rows of ``act`` [T * k, I], ``ids`` and ``weights`` [T * k] (``gemv_gate_up``'s)."""
    pairs, inter = act.shape
    t, h = pairs // top_k, down.shape[1]
    out = torch.empty((t, h), dtype=act.dtype, device=act.device)
    scale_n, scale_k = block or (1, 0)
    ds = scales if scales is not None else down  # (unread without fp8)
    bn, bk, warps, prefetch = GemvTiles(*(tiles or GEMV_DOWN_TILES))
    bk = min(bk, triton.next_power_of_2(inter))
    _moe_gemv_down_kernel[(triton.cdiv(h, bn), t)](
        act, down, ds, out, ids, weights, h, inter, down.stride(0), down.stride(1), ds.stride(0), ds.stride(1),
        out.stride(0), TOP_K=top_k, BLOCK_J=triton.next_power_of_2(top_k), FP8=scales is not None,
        SCALE_N=scale_n, SCALE_K=scale_k, EVEN_K=inter % bk == 0, PREFETCH=bool(prefetch) and inter % bk == 0,
        BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, PDL=pdl, launch_pdl=pdl)
    return out


@triton.jit
def _add_rmsnorm_router_kernel(X, R, NormW, RouterW, Out, ResOut, Logits, N, E, eps, stride_rw,
                               BLOCK: tl.constexpr, ROWS: tl.constexpr, PDL: tl.constexpr = False):
    """One token: ResOut = X + R; Out = RMSNorm(ResOut) (``add_rmsnorm``'s arithmetic and
    rounding); Logits[rows] = RouterW[rows] @ Out for ROWS router rows per program. Every
    program normalises the token itself (8 KB from the L2); the first writes Out and ResOut,
    which are not X or R (no program reads what another writes)."""
    pdl_begin(PDL)
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32) + tl.load(R + offs, mask=mask, other=0.0).to(tl.float32)
    var = tl.sum(x * x, 0) / N
    h = (x * tl.rsqrt(var + eps)).to(Out.dtype.element_ty) * tl.load(NormW + offs, mask=mask, other=0.0)
    if pid == 0:
        tl.store(ResOut + offs, x.to(ResOut.dtype.element_ty), mask=mask)
        tl.store(Out + offs, h, mask=mask)
    rows = pid * ROWS + tl.arange(0, ROWS)
    live = rows < E
    w = tl.load(RouterW + rows[:, None] * stride_rw + offs[None, :], mask=live[:, None] & mask[None, :], other=0.0)
    logit = tl.sum(w.to(tl.float32) * h.to(tl.float32)[None, :], 1)
    tl.store(Logits + rows, logit.to(Logits.dtype.element_ty), mask=live)


def add_rmsnorm_router(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                       router_weight: torch.Tensor, *, rows: int = 1, warps: int = 4,
                       pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For one token ``x`` [1, H]: (h, x + residual, logits), h = RMSNorm(x + residual) and
    logits [1, E] = h @ ``router_weight``.T in x's dtype: the residual add, the norm before
    the MoE block and its router's GEMV in one kernel. The new residual is a new tensor
    (``residual`` is left as it is)."""
    n = x.shape[-1]
    e = router_weight.shape[0]
    h = torch.empty_like(x)
    res = torch.empty_like(residual)
    logits = torch.empty((1, e), dtype=x.dtype, device=x.device)
    _add_rmsnorm_router_kernel[(triton.cdiv(e, rows),)](
        x, residual, norm_weight, router_weight, h, res, logits, n, e, eps, router_weight.stride(0),
        BLOCK=triton.next_power_of_2(n), ROWS=rows, num_warps=warps, PDL=pdl, launch_pdl=pdl)
    return h, res, logits
