"""Triton kernels for radix attention: K and V are read in place from the token pool through
the request-to-token table (no copy of a request's KV).

* ``decode_attention``: one new token per request. Split-KV flash decoding: stage 1 gives
  each (request, KV head, split) program a slice of the sequence and all query heads of the
  KV head's group (GQA) as one tile; stage 2 merges the splits with their log-sum-exp (or,
  with ``merge_in_kernel``, the last of the splits' programs to finish does, in stage 1).
* ``cascade_decode_attention``: the same with each shared prefix read once for the requests
  of its item; with one split per request, the shared level runs first and stage 1 merges
  its partials itself (no stage 2).
* ``extend_attention``: a block of new tokens of one request attends to its cached prefix and
  to the new tokens themselves, causally (the new K/V are stored in the pool before).
* ``build_kv_indices``: flattens the table rows of a batch into one slot array (CSR layout).

The pool may hold fp8 (``radixd.core.kv_quant``): K and V tiles are converted to the query's
dtype as they are loaded; a layer's K scale is folded into the score scale by the caller
(``k_scale`` arguments) and its V scale multiplies each output (``v_scale``).

They run on CUDA tensors, and on CPU tensors under ``TRITON_INTERPRET=1`` (tests).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from radixd.core.triton_ops import pdl_begin

DECODE_CONFIG = (64, 4, 3)  # stage 1: tokens per tile, warps, pipeline stages
# an fp8 pool's: twice the tokens a tile (the same bytes); on an H200 at 256 x 4096 tokens the
# kernel took 844-903 us against 1085-1216 with DECODE_CONFIG (three calls; benchmarks.fp8_kv --sweep)
FP8_DECODE_CONFIG = (128, 4, 3)
PREFIX_CONFIG = (64, 4, 3)  # cascade's shared level: tokens per tile, warps, pipeline stages
PREFIX_PROGRAMS = 64        # programs per (KV head, split) walking the shared-prefix items


@triton.jit
def _tanh(x):
    return 2 * tl.sigmoid(2 * x) - 1


@triton.jit
def _attend_span(q, rows_ok, K, V, Table, SlotMap, row, kvh, start, end, scale, v_scale,
                 stride_kn, stride_kh, stride_vn, stride_vh, stride_tr, offs_d, mask_d,
                 ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, SOFTCAP: tl.constexpr,
                 MAPPED: tl.constexpr, tree_base, tree_bits, TREE: tl.constexpr, FP8_DOT: tl.constexpr = False):
    """A tile of query rows (``rows_ok``: the real ones) of one KV head over the keys at
    positions ``[start, end)`` of table row ``row``, online softmax: (normalised output,
    log-sum-exp; -inf for a span with no key). ``SOFTCAP`` > 0: scores capped to
    ``SOFTCAP * tanh(score / SOFTCAP)``. ``scale`` includes the K scale; ``v_scale``
    multiplies the output (1.0 unless the pool is fp8). ``MAPPED``: K/V rows are
    ``SlotMap[slot]`` (a window layer's region, ``swa_pool``). ``TREE``: a key at position
    ``p >= tree_base`` is seen only where bit ``p - tree_base`` of ``tree_bits`` is set (a
    token tree's row: its ancestors and itself). ``FP8_DOT`` (an e4m3 pool, ``q`` already in
    e4m3, its scale folded into ``scale``): q.K on the fp8 tensor cores, K's tile as the wide
    side; p.V in fp16."""
    m = tl.full([ROWS], float("-inf"), dtype=tl.float32)
    lsum = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        if TREE:
            node = tl.maximum(offs_n - tree_base, 0)
            mask_n = mask_n & ((offs_n < tree_base) | (((tree_bits >> node) & 1) != 0))
        slots = tl.load(Table + row * stride_tr + offs_n, mask=mask_n, other=0)
        if MAPPED:
            slots = tl.load(SlotMap + slots, mask=mask_n, other=0)
        if FP8_DOT:  # K [BLOCK_N, D] as the product's wide side: the fp8 tensor cores (wgmma)
            k = tl.load(K + slots[:, None] * stride_kn + kvh * stride_kh + offs_d[None, :],
                        mask=mask_n[:, None] & mask_d[None, :], other=0.0)
            qk = tl.trans(tl.dot(k, tl.trans(q))) * scale
        else:
            k = tl.load(K + slots[None, :] * stride_kn + kvh * stride_kh + offs_d[:, None],
                        mask=mask_n[None, :] & mask_d[:, None], other=0.0).to(q.dtype)
            qk = tl.dot(q, k) * scale
        if SOFTCAP > 0:
            qk = SOFTCAP * _tanh(qk / SOFTCAP)
        qk = tl.where(rows_ok[:, None] & mask_n[None, :], qk, float("-inf"))
        m_new = tl.maximum(m, tl.max(qk, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(qk - m_safe[:, None])
        alpha = tl.exp(m - m_safe)
        lsum = lsum * alpha + tl.sum(p, 1)
        v = tl.load(V + slots[:, None] * stride_vn + kvh * stride_vh + offs_d[None, :],
                    mask=mask_n[:, None] & mask_d[None, :], other=0.0)
        pv = tl.float16 if FP8_DOT else q.dtype
        acc = acc * alpha[:, None] + tl.dot(p.to(pv), v.to(pv))
        m = m_new
    has = lsum > 0
    out = acc * (v_scale / tl.where(has, lsum, 1.0))[:, None]
    lse = tl.where(has, m + tl.log(tl.where(has, lsum, 1.0)), float("-inf"))
    return out, lse


@triton.jit
def _decode_stage1(
    Q, K, V, Table, SlotMap, Rows, SeqLens, Starts, MidO, MidLse, Out, PrefixParts, TreeBase, TreeBits, scale, v_scale,
    stride_qb, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_tr,
    stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_b, stride_h,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS: tl.constexpr,
    HAS_START: tl.constexpr, WRITE_LSE: tl.constexpr, MERGE_PREFIX: tl.constexpr,
    WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, MAPPED: tl.constexpr, F16_DOT: tl.constexpr,
    TREE: tl.constexpr = False, FP8_DOT: tl.constexpr = False, PDL: tl.constexpr = False,
    Counters=None, MERGE_LAST: tl.constexpr = False, BLOCK_S: tl.constexpr = 1,
):
    """``MERGE_LAST`` (``decode_attention``'s ``merge_in_kernel``): the last of a (request,
    KV head)'s ``SPLITS`` programs to finish merges their partials into ``Out`` (stage 2's
    work, ``_merge_if_last``), counted in ``Counters`` [B, Hkv]. ``MERGE_PREFIX`` (cascade
    with one split): the shared level's ``PrefixParts[b]`` partials, in split slots
    ``SPLITS ...`` of ``MidO``/``MidLse``, are already there; they are merged with this
    program's own span and the result goes to ``Out``. ``WINDOW`` > 0:
    only the newest ``WINDOW`` keys are read (not with a start). ``F16_DOT``: the query (and
    so the K/V tiles and probabilities) in fp16 for the products (see ``decode_attention``).
    ``TREE``: row b sees a key at position ``p >= TreeBase[b]`` only where bit
    ``p - TreeBase[b]`` of ``TreeBits[b]`` is set (``decode_attention``'s ``tree``). ``PDL``:
    ``triton_ops.pdl_begin``."""
    pdl_begin(PDL)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    sp = tl.program_id(2)
    row = tl.load(Rows + b)
    seq_len = tl.load(SeqLens + b)
    first = 0
    if HAS_START:  # (cascade: the shared prefix before ``first`` is attended by _prefix_stage)
        first = tl.load(Starts + b)
    if WINDOW > 0:
        first = tl.maximum(seq_len - WINDOW, 0)
    split_len = tl.cdiv(tl.cdiv(seq_len - first, SPLITS), BLOCK_N) * BLOCK_N  # whole tiles per split
    start = first + sp * split_len
    end = tl.minimum(start + split_len, seq_len)

    offs_g = tl.arange(0, BLOCK_H)
    mask_g = offs_g < GROUP
    heads = kvh * GROUP + offs_g
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_g[:, None] & mask_d[None, :], other=0.0)
    if F16_DOT:
        q = q.to(tl.float16)
    if FP8_DOT:  # (the query of the KV head's group in e4m3, one scale for the tile)
        qf = q.to(tl.float32)
        q_scale = tl.maximum(tl.max(tl.max(tl.abs(qf), 1), 0), 1e-30) / 448.0
        q = (qf / q_scale).to(K.dtype.element_ty)
        scale = scale * q_scale

    tree_base = 0
    tree_bits = 0
    if TREE:
        tree_base = tl.load(TreeBase + b)
        tree_bits = tl.load(TreeBits + b)
    out, lse = _attend_span(q, mask_g, K, V, Table, SlotMap, row, kvh, start, end, scale, v_scale,
                            stride_kn, stride_kh, stride_vn, stride_vh, stride_tr, offs_d, mask_d,
                            BLOCK_H, BLOCK_N, BLOCK_D, SOFTCAP, MAPPED, tree_base, tree_bits, TREE, FP8_DOT)
    mask_gd = mask_g[:, None] & mask_d[None, :]
    if MERGE_PREFIX:
        for s in range(tl.load(PrefixParts + b)):
            slot = SPLITS + s
            lse_p = tl.load(MidLse + b * stride_lb + heads * stride_lh + slot, mask=mask_g, other=float("-inf"))
            o_p = tl.load(MidO + b * stride_ob + heads[:, None] * stride_oh + slot * stride_os + offs_d[None, :],
                          mask=mask_gd, other=0.0)
            m = tl.maximum(lse, lse_p)
            m_safe = tl.where(m == float("-inf"), 0.0, m)
            w_own = tl.exp(lse - m_safe)
            w_p = tl.exp(lse_p - m_safe)
            tot = w_own + w_p
            out = (out * w_own[:, None] + o_p * w_p[:, None]) / tl.where(tot > 0, tot, 1.0)[:, None]
            lse = tl.where(tot > 0, m_safe + tl.log(tl.where(tot > 0, tot, 1.0)), float("-inf"))
        tl.store(Out + b * stride_b + heads[:, None] * stride_h + offs_d[None, :], out.to(Out.dtype.element_ty),
                 mask=mask_gd)
    else:
        tl.store(MidO + b * stride_ob + heads[:, None] * stride_oh + sp * stride_os + offs_d[None, :],
                 out.to(MidO.dtype.element_ty), mask=mask_gd)
        if WRITE_LSE:  # (one split: MidO is the output itself, nothing to merge)
            tl.store(MidLse + b * stride_lb + heads * stride_lh + sp, lse, mask=mask_g)
        if MERGE_LAST:
            _merge_if_last(MidO, MidLse, Out, Counters + b * tl.num_programs(1) + kvh, b, heads, mask_g, offs_d,
                           mask_d, stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_b, stride_h,
                           SPLITS, BLOCK_S, BLOCK_H, BLOCK_D)


@triton.jit
def _merge_if_last(MidO, MidLse, Out, Counter, b, heads, mask_g, offs_d, mask_d,
                   stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_b, stride_h,
                   SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """Stage 2 inside stage 1: once this program's partials are stored, it counts itself in
    ``Counter`` (its request and KV head's); the last of the ``SPLITS`` to arrive merges
    all their partials for the group's heads (``_decode_stage2``'s arithmetic) into ``Out``
    and sets the counter back to 0 for the next launch (a CUDA graph replays the same
    counters). The barrier orders every thread's stores before the count, whose acquire-
    release semantics order them before the last program's loads; those bypass L1 (".cg"),
    which may still hold an earlier step's partials."""
    tl.debug_barrier()
    arrived = tl.atomic_add(Counter, 1, sem="acq_rel")
    if arrived == SPLITS - 1:
        tl.store(Counter, 0)
        offs_s = tl.arange(0, BLOCK_S)
        mask_s = offs_s < SPLITS
        mask_gs = mask_g[:, None] & mask_s[None, :]
        lse = tl.load(MidLse + b * stride_lb + heads[:, None] * stride_lh + offs_s[None, :], mask=mask_gs,
                      other=float("-inf"), cache_modifier=".cg")
        mx = tl.max(lse, 1)
        mx = tl.where(mx == float("-inf"), 0.0, mx)  # (the tile's padding heads: no partials)
        tot = tl.sum(tl.where(mask_gs & (lse > float("-inf")), tl.exp(lse - mx[:, None]), 0.0), 1)
        tot = tl.where(tot > 0, tot, 1.0)
        out = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
        mask_gd = mask_g[:, None] & mask_d[None, :]
        for s in tl.static_range(SPLITS):  # each split's partial, weighted by its share of the sum
            lse_s = tl.load(MidLse + b * stride_lb + heads * stride_lh + s, mask=mask_g, other=float("-inf"),
                            cache_modifier=".cg")
            w_s = tl.where(lse_s > float("-inf"), tl.exp(lse_s - mx), 0.0) / tot
            part = tl.load(MidO + b * stride_ob + heads[:, None] * stride_oh + s * stride_os + offs_d[None, :],
                           mask=mask_gd, other=0.0, cache_modifier=".cg")
            out += part * w_s[:, None]
        tl.store(Out + b * stride_b + heads[:, None] * stride_h + offs_d[None, :], out.to(Out.dtype.element_ty),
                 mask=mask_gd)


@triton.jit
def _decode_stage2(
    MidO, MidLse, Out, PrefixParts,
    stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_b, stride_h,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
    PREFIX_SPLITS: tl.constexpr, PDL: tl.constexpr = False,
):
    pdl_begin(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    if PREFIX_SPLITS > 0:  # a request in a shared-prefix item also has the prefix's partials
        mask_s = offs_s < SPLITS + tl.load(PrefixParts + b)
    else:
        mask_s = offs_s < SPLITS
    lse = tl.load(MidLse + b * stride_lb + h * stride_lh + offs_s, mask=mask_s, other=float("-inf"))
    mx = tl.max(lse, 0)
    w = tl.where(mask_s & (lse > float("-inf")), tl.exp(lse - mx), 0.0)
    w = w / tl.sum(w, 0)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    parts = tl.load(MidO + b * stride_ob + h * stride_oh + offs_s[:, None] * stride_os + offs_d[None, :],
                    mask=mask_s[:, None] & mask_d[None, :], other=0.0)
    out = tl.sum(parts * w[:, None], 0)
    tl.store(Out + b * stride_b + h * stride_h + offs_d, out.to(Out.dtype.element_ty), mask=mask_d)


def decode_attention(
    q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, table: torch.Tensor,
    rows: torch.Tensor, seq_lens: torch.Tensor, scale: float, *, num_splits: int = 8,
    out: torch.Tensor | None = None, mid_o: torch.Tensor | None = None, mid_lse: torch.Tensor | None = None,
    config: tuple[int, int, int] | None = None, window: int = 0, softcap: float = 0.0,
    k_scale: float = 1.0, v_scale: float = 1.0, slot_map: torch.Tensor | None = None,
    fp16_dot: bool | None = None, tree: tuple[torch.Tensor, torch.Tensor] | None = None, fp8_dot: bool = False,
    pdl: bool = False, merge_in_kernel: bool = False, counters: torch.Tensor | None = None,
) -> torch.Tensor:
    """``q`` [B, H, D] (one token per request) -> [B, H, D]. ``rows``/``seq_lens`` [B] on the
    device; the launch shape depends only on B, so it can be captured in a CUDA graph.
    ``config``: stage 1's (tokens per tile, warps, pipeline stages) instead of the default
    (benchmarks sweep them). With one split, stage 1 writes ``out`` itself and stage 2 does
    not run. ``window`` > 0: each request attends to its newest ``window`` keys;
    ``softcap`` > 0: scores soft-capped (``softcap * tanh(score / softcap)``); ``k_scale``/
    ``v_scale``: the layer's scales of an fp8 pool; ``slot_map``: K/V of the table's slot s
    at row ``slot_map[s]`` of the buffers (``swa_pool``). ``fp16_dot`` (None: an fp8 pool
    read by a bf16 query): the products in fp16, to which fp8 converts in one instruction per
    two values where bf16 takes several (|q| stays far inside fp16's range, 65504; the
    probabilities are in [0, 1]; fp16 carries more mantissa than bf16). ``tree``: (base [B],
    bits [B]) int64 on the device, token trees' rows among the batch's (a verify step,
    ``radixd.core.speculative.tree``): row b sees a key at table position ``p >= base[b]``
    only where bit ``p - base[b]`` of ``bits[b]`` is set (the tree's root at ``base``, its
    nodes after it; at most 63 rows a tree); a row outside any tree has ``base = seq_len``.
    ``fp8_dot`` (an e4m3 pool): q.K on the fp8 tensor cores, the query rounded to e4m3 with one
    scale per KV head's group (relative error 0.033 against bf16 K/V, the pool alone 0.030); off
    by default: on an H200 at 256 x 4096 tokens it took 803 and 867 us in two calls against
    903 and 844 with the fp16 products. Without ``config``, an fp8 pool's stage 1 takes
    ``FP8_DECODE_CONFIG``. ``pdl``: both kernels launched for programmatic dependent launch
    (``triton_ops.pdl_begin``). ``merge_in_kernel``: no stage 2; the last of a (request, KV
    head)'s split programs merges the partials (``_merge_if_last``), counting in
    ``counters`` (int32 [>= B, Hkv], all 0, left at 0; None: made here) — one launch a
    layer instead of two."""
    B, H, D = q.shape
    Hkv = k_buf.shape[1]
    fp8_dot = fp8_dot and k_buf.dtype == torch.float8_e4m3fn
    if fp16_dot is None:
        fp16_dot = k_buf.element_size() == 1 and q.dtype == torch.bfloat16 and not fp8_dot
    group = H // Hkv
    if out is None:
        out = torch.empty_like(q)
    if num_splits == 1:
        mid_o, mid_lse = out[:, :, None], out
    elif mid_o is None:
        mid_o = torch.empty((B, H, num_splits, D), dtype=torch.float32, device=q.device)
        mid_lse = torch.empty((B, H, num_splits), dtype=torch.float32, device=q.device)
    block_d = triton.next_power_of_2(D)
    block_n, warps, stages = config or (FP8_DECODE_CONFIG if k_buf.element_size() == 1 else DECODE_CONFIG)
    merge_in_kernel = merge_in_kernel and num_splits > 1
    if merge_in_kernel and counters is None:
        counters = torch.zeros((B, Hkv), dtype=torch.int32, device=q.device)
    _decode_stage1[(B, Hkv, num_splits)](
        q, k_buf, v_buf, table, table if slot_map is None else slot_map, rows, seq_lens, seq_lens, mid_o, mid_lse,
        out, seq_lens, *(tree if tree is not None else (seq_lens, seq_lens)), scale * k_scale, v_scale,
        q.stride(0), q.stride(1), k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1), table.stride(0),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1),  # (Starts, Out, PrefixParts: unread without a start or a merge)
        GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n,
        HEAD_DIM=D, BLOCK_D=block_d, SPLITS=num_splits, HAS_START=False, WRITE_LSE=num_splits > 1,
        MERGE_PREFIX=False, WINDOW=window, SOFTCAP=softcap, MAPPED=slot_map is not None, F16_DOT=fp16_dot,
        TREE=tree is not None, FP8_DOT=fp8_dot, PDL=pdl, launch_pdl=pdl,
        Counters=counters, MERGE_LAST=merge_in_kernel, BLOCK_S=triton.next_power_of_2(num_splits),
        num_warps=warps, num_stages=stages,
    )
    if num_splits == 1 or merge_in_kernel:
        return out
    _decode_stage2[(B, H)](
        mid_o, mid_lse, out, seq_lens,  # (PrefixParts: unread without prefix splits)
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1),
        HEAD_DIM=D, BLOCK_D=block_d, SPLITS=num_splits, BLOCK_S=triton.next_power_of_2(num_splits),
        PREFIX_SPLITS=0, PDL=pdl, launch_pdl=pdl,
    )
    return out


def prefix_members(group: int) -> int:
    """Requests per shared-prefix item: their query heads of one KV head make one tile of
    (about) 64 rows against each K/V tile of the prefix."""
    return max(1, 64 // group)


@triton.jit
def _prefix_stage(
    Q, K, V, Table, ItemRows, ItemLens, Members, PrefixParts, MidO, MidLse, scale, v_scale, n_items,
    stride_qb, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_tr, stride_m,
    stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
    GROUP: tl.constexpr, MEMBERS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS: tl.constexpr, SLOT0: tl.constexpr,
    PROGRAMS: tl.constexpr, SOFTCAP: tl.constexpr,
):
    """Cascade decoding, the shared level: the requests of one item share the KV of their
    first ``ItemLens[i]`` positions (the same pool slots), so each K/V tile of it is read
    once for all of them: a tile of (member, query head) rows against it. Partials go to
    split slot ``SLOT0 + sp`` of each member, merged with its own suffix's by stage 2. An item
    is read in ``PrefixParts[member]`` splits (at most SPLITS, the grid's; programs past them
    have nothing to do)."""
    p = tl.program_id(0)
    kvh = tl.program_id(1)
    sp = tl.program_id(2)
    offs_r = tl.arange(0, BLOCK_R)
    member = offs_r // GROUP
    heads = kvh * GROUP + offs_r % GROUP
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    for it in range(p, n_items, PROGRAMS):  # item slots past the last real one have length 0
        length = tl.load(ItemLens + it)
        nsplits = tl.load(PrefixParts + tl.maximum(tl.load(Members + it), 0))
        if (length > 0) & (sp < nsplits):
            row = tl.load(ItemRows + it)
            b = tl.load(Members + member * stride_m + it, mask=member < MEMBERS, other=-1)
            valid = b >= 0
            q = tl.load(Q + b[:, None] * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                        mask=valid[:, None] & mask_d[None, :], other=0.0)
            split_len = tl.cdiv(tl.cdiv(length, nsplits), BLOCK_N) * BLOCK_N
            start = sp * split_len
            end = tl.minimum(start + split_len, length)
            out, lse = _attend_span(q, valid, K, V, Table, Table, row, kvh, start, end, scale, v_scale,
                                    stride_kn, stride_kh, stride_vn, stride_vh, stride_tr, offs_d, mask_d,
                                    BLOCK_R, BLOCK_N, BLOCK_D, SOFTCAP, False, 0, 0, False)
            slot = SLOT0 + sp
            tl.store(MidO + b[:, None] * stride_ob + heads[:, None] * stride_oh + slot * stride_os + offs_d[None, :],
                     out, mask=valid[:, None] & mask_d[None, :])
            tl.store(MidLse + b * stride_lb + heads * stride_lh + slot, lse, mask=valid)


def cascade_decode_attention(
    q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, table: torch.Tensor,
    rows: torch.Tensor, seq_lens: torch.Tensor, scale: float, shares: torch.Tensor, prefix_parts: torch.Tensor,
    item_rows: torch.Tensor, item_lens: torch.Tensor, members: torch.Tensor, *,
    num_splits: int, prefix_splits: int, out: torch.Tensor | None = None,
    mid_o: torch.Tensor | None = None, mid_lse: torch.Tensor | None = None,
    config: tuple[int, int, int] | None = None, softcap: float = 0.0, k_scale: float = 1.0, v_scale: float = 1.0,
) -> torch.Tensor:
    """Decode attention in two levels (cascade): the prefix shared by the requests of an
    item is read once for all of them, each request's own rest (from ``shares[b]``, 0 for a
    request in no item) by itself; stage 2 merges both levels' partials, or, with one split
    per request (``num_splits == 1``: large batches), the shared level runs first and stage 1
    merges its partials as it writes each request's output (one launch and one round trip
    of the partials fewer).

    ``shares`` [B]: the shared length of each request's item (0: in no item);
    ``prefix_parts`` [B]: the splits its item's prefix is read in (1 to ``prefix_splits``; 0:
    in no item). Items (up to N): ``item_rows`` [N] (the table row of any member),
    ``item_lens`` [N] (0: unused slot), ``members`` [M, N] (batch indices, -1 padding; M =
    ``prefix_members(group)``). Launch shapes depend only on B, N and ``prefix_splits``:
    capturable in a CUDA graph (the split counts are read on the device). ``mid_o`` and
    ``mid_lse`` need ``num_splits + prefix_splits`` split slots."""
    B, H, D = q.shape
    Hkv = k_buf.shape[1]
    group = H // Hkv
    n_items = item_lens.numel()
    parts = num_splits + prefix_splits
    if out is None:
        out = torch.empty_like(q)
    if mid_o is None:
        mid_o = torch.empty((B, H, parts, D), dtype=torch.float32, device=q.device)
        mid_lse = torch.empty((B, H, parts), dtype=torch.float32, device=q.device)
    assert mid_o.shape[2] >= parts and members.shape[0] == prefix_members(group)
    block_d = triton.next_power_of_2(D)
    block_n, warps, stages = config if config is not None else DECODE_CONFIG
    common = (k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1), table.stride(0))
    mids = (mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1))
    merge = num_splits == 1

    def own_level():
        _decode_stage1[(B, Hkv, num_splits)](
            q, k_buf, v_buf, table, table, rows, seq_lens, shares, mid_o, mid_lse, out, prefix_parts, shares, shares,
            scale * k_scale,
            v_scale, q.stride(0), q.stride(1), *common, *mids, out.stride(0), out.stride(1),
            GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n,
            HEAD_DIM=D, BLOCK_D=block_d, SPLITS=num_splits, HAS_START=True, WRITE_LSE=True,
            MERGE_PREFIX=merge, WINDOW=0, SOFTCAP=softcap, MAPPED=False, F16_DOT=False, num_warps=warps,
            num_stages=stages,
        )

    if not merge:
        own_level()
    members_n = prefix_members(group)
    programs = min(n_items, PREFIX_PROGRAMS)
    _prefix_stage[(programs, Hkv, prefix_splits)](
        q, k_buf, v_buf, table, item_rows, item_lens, members, prefix_parts, mid_o, mid_lse, scale * k_scale,
        v_scale, n_items,
        q.stride(0), q.stride(1), *common, members.stride(0), *mids,
        GROUP=group, MEMBERS=members_n, BLOCK_R=max(16, triton.next_power_of_2(members_n * group)),
        BLOCK_N=PREFIX_CONFIG[0], HEAD_DIM=D, BLOCK_D=block_d, SPLITS=prefix_splits, SLOT0=num_splits,
        PROGRAMS=programs, SOFTCAP=softcap, num_warps=PREFIX_CONFIG[1], num_stages=PREFIX_CONFIG[2],
    )
    if merge:
        own_level()
        return out
    _decode_stage2[(B, H)](
        mid_o, mid_lse, out, prefix_parts, *mids, out.stride(0), out.stride(1),
        HEAD_DIM=D, BLOCK_D=block_d, SPLITS=num_splits, BLOCK_S=triton.next_power_of_2(parts),
        PREFIX_SPLITS=prefix_splits,
    )
    return out


@triton.jit
def _extend_block(q, m, lsum, acc, K, V, Table, SlotMap, row, kvh, q_pos, lo, hi, qk_scale,
                  stride_kn, stride_kh, stride_vn, stride_vh, stride_tr, offs_d, mask_d,
                  BLOCK_N: tl.constexpr, MASKED: tl.constexpr, K_ROWS: tl.constexpr,
                  WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, MAPPED: tl.constexpr,
                  TreeMask, tree_off, prefix, ext, offs_m, TREE: tl.constexpr):
    """Online softmax of one query tile over keys ``[lo, hi)``; ``MASKED`` adds the bounds
    and causal masks (needed only on the diagonal and the ragged end), and the window's;
    ``TREE`` (with MASKED) the request's tree mask over its new tokens (``tree_off`` >= 0:
    where its [ext, ext] mask starts in ``TreeMask``). Scores are in log2 units
    (``qk_scale`` has log2(e) in it), ``SOFTCAP`` too."""
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < hi
        if MASKED:
            slots = tl.load(Table + row * stride_tr + offs_n, mask=mask_n, other=0)
            mask_nd = mask_n[:, None] & mask_d[None, :]
        else:
            slots = tl.load(Table + row * stride_tr + offs_n)
            mask_nd = mask_d[None, :]
        if MAPPED:  # (a window layer's region: swa_pool)
            slots = tl.load(SlotMap + slots, mask=mask_n, other=0)
        if K_ROWS:  # K tile read as rows (each slot's head contiguous), transposed for the dot
            k = tl.load(K + slots[:, None] * stride_kn + kvh * stride_kh + offs_d[None, :], mask=mask_nd,
                        other=0.0).to(q.dtype)
            qk = tl.dot(q, tl.trans(k))
        else:  # K tile gathered straight into [D, N]
            k = tl.load(K + slots[None, :] * stride_kn + kvh * stride_kh + offs_d[:, None],
                        mask=tl.trans(mask_nd), other=0.0).to(q.dtype)
            qk = tl.dot(q, k)
        v = tl.load(V + slots[:, None] * stride_vn + kvh * stride_vh + offs_d[None, :], mask=mask_nd,
                    other=0.0).to(q.dtype)
        scale = qk_scale  # (applied with the running max's subtraction, in one multiply-add)
        if SOFTCAP > 0:
            qk = SOFTCAP * _tanh(qk * qk_scale / SOFTCAP)
            scale = 1.0
        if MASKED:
            visible = mask_n[None, :] & (offs_n[None, :] <= q_pos[:, None])
            if WINDOW > 0:
                visible = visible & (offs_n[None, :] > q_pos[:, None] - WINDOW)
            if TREE:  # (keys before the new tokens, and requests without a tree, read as seen)
                new = offs_n - prefix
                lim = tl.where(tree_off >= 0, ext, 0)  # (0: no tree, nothing read)
                in_tree = (offs_m[:, None] < lim) & (new[None, :] >= 0) & (new[None, :] < lim)
                seen = tl.load(TreeMask + tree_off + offs_m[:, None] * ext + new[None, :], mask=in_tree, other=1)
                visible = visible & (seen != 0)
            qk = tl.where(visible, qk, float("-inf"))
        m_new = tl.maximum(m, tl.max(qk, 1) * scale)
        m_use = m_new
        if MASKED:  # (a row may have seen no key yet: its max stays -inf, 0 is subtracted)
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(qk * scale - m_use[:, None])
        alpha = tl.math.exp2(m - m_use)
        lsum = lsum * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(q.dtype), v, acc * alpha[:, None])
        m = m_new
    return m, lsum, acc


@triton.jit
def _extend_kernel(
    Q, K, V, Out, Table, SlotMap, Rows, PrefixLens, ExtendLens, QStarts, TreeMask, TreeOffsets, qk_scale, v_scale,
    stride_qt, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_ot, stride_oh, stride_tr,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, K_ROWS: tl.constexpr, PACK: tl.constexpr,
    WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, MAPPED: tl.constexpr, TREE: tl.constexpr,
):
    # A program's BLOCK_M rows are BLOCK_M // PACK new tokens times PACK query heads of one KV
    # head's group (row i: token i // PACK, head i % PACK of the pack): PACK > 1 reads each K/V
    # tile once for PACK heads.
    TOKENS: tl.constexpr = BLOCK_M // PACK
    r = tl.program_id(0)
    hp = tl.program_id(1)  # which pack of query heads
    mb = tl.num_programs(2) - 1 - tl.program_id(2)  # the longest (last) tiles start first
    ext = tl.load(ExtendLens + r)
    if mb * TOKENS < ext:
        prefix = tl.load(PrefixLens + r)
        row = tl.load(Rows + r)
        q0 = tl.load(QStarts + r)
        kvh = (hp * PACK) // GROUP
        offs_i = tl.arange(0, BLOCK_M)
        offs_m = mb * TOKENS + offs_i // PACK  # each row's new token
        heads = hp * PACK + offs_i % PACK
        mask_m = offs_m < ext
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < HEAD_DIM
        q = tl.load(Q + (q0 + offs_m)[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=mask_m[:, None] & mask_d[None, :], other=0.0)
        q_pos = prefix + offs_m
        end = tl.minimum(prefix + ext, prefix + (mb + 1) * TOKENS)
        m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        lsum = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        tree_off = -1
        if TREE:
            tree_off = tl.load(TreeOffsets + r)
        if WINDOW > 0:  # from the tile of the first query's oldest key in the window, all masked
            lo = (tl.maximum(prefix + mb * TOKENS - WINDOW + 1, 0) // BLOCK_N) * BLOCK_N
            m, lsum, acc = _extend_block(q, m, lsum, acc, K, V, Table, SlotMap, row, kvh, q_pos, lo, end, qk_scale,
                                         stride_kn, stride_kh, stride_vn, stride_vh, stride_tr, offs_d, mask_d,
                                         BLOCK_N, True, K_ROWS, WINDOW, SOFTCAP, MAPPED,
                                         TreeMask, tree_off, prefix, ext, offs_m, TREE)
        else:
            # every key before the tile's first query is visible to all its queries: no masks there
            full = ((prefix + mb * TOKENS) // BLOCK_N) * BLOCK_N
            if TREE:  # a tree's new tokens are not all visible to later ones: masked from there
                full = tl.where(tree_off >= 0, tl.minimum(full, (prefix // BLOCK_N) * BLOCK_N), full)
            m, lsum, acc = _extend_block(q, m, lsum, acc, K, V, Table, SlotMap, row, kvh, q_pos, 0, full, qk_scale,
                                         stride_kn, stride_kh, stride_vn, stride_vh, stride_tr, offs_d, mask_d,
                                         BLOCK_N, False, K_ROWS, 0, SOFTCAP, MAPPED,
                                         TreeMask, tree_off, prefix, ext, offs_m, False)
            m, lsum, acc = _extend_block(q, m, lsum, acc, K, V, Table, SlotMap, row, kvh, q_pos, full, end, qk_scale,
                                         stride_kn, stride_kh, stride_vn, stride_vh, stride_tr, offs_d, mask_d,
                                         BLOCK_N, True, K_ROWS, 0, SOFTCAP, MAPPED,
                                         TreeMask, tree_off, prefix, ext, offs_m, TREE)
        out = acc * (v_scale / tl.where(lsum > 0, lsum, 1.0))[:, None]
        tl.store(Out + (q0 + offs_m)[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(Out.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


# Tile configurations (BLOCK_M, BLOCK_N, num_warps, num_stages, K_ROWS[, PACK]) swept by
# benchmarks/extend_attention.py (and decode_profile.py's extend section).
EXTEND_CONFIGS = [(64, 64, 4, 3, False), (64, 64, 4, 3, True), (128, 64, 8, 3, False), (128, 64, 8, 3, True),
                  (64, 64, 4, 4, True), (128, 64, 4, 3, True), (64, 32, 4, 3, True), (128, 128, 8, 3, True),
                  (64, 128, 4, 3, True), (128, 32, 4, 3, False), (64, 64, 4, 3, True, 4), (128, 64, 8, 3, True, 4),
                  (32, 64, 4, 2, False, 4), (256, 64, 16, 3, True, 4), (32, 64, 2, 3, True, 4)]
_LOG2E = 1.4426950408889634


def extend_config(head_dim: int, max_extend: int, group: int, heads: int = 0, extends: int = 1,
                   processors: int = 0) -> tuple:
    """The default tile. With head dim 128 and a GQA group of a multiple of 4, 4 query heads
    share each program (each K/V tile read once for them); on an H200 (8B shape):

    ==================  =====================  =============================  ==========
    extend              per-head (64, 64, 4)   packed (256, 64, 16, 3, 4)     SDPA
    ==================  =====================  =============================  ==========
    8 x 2048            264 TFLOP/s            314 TFLOP/s                    495 (cuDNN)
    8192 after 24576    335 TFLOP/s            416 TFLOP/s                    279 (mask)
    64 x 5 after 2048   576 us (16, 32, 4)     176 us (32, 64, 2, 3, 4)       1341 us
    ==================  =====================  =============================  ==========

    A launch with fewer 256-row tiles than the device has ``processors`` (a mixed step's one
    prompt chunk of up to 1024 tokens at 32 heads) takes 64-row packed tiles, four times the
    programs: one 512-token chunk 19.0 us vs 28.4, one of 1024 38.3 vs 47.7 (an H200, 132
    processors; ``benchmarks.mixed_step``, device time)."""
    packed = head_dim == 128 and group % 4 == 0
    if max_extend <= 32:
        return (32, 64, 2, 3, True, 4) if packed else (16, 64 if head_dim <= 64 else 32, 4, 2, False)
    if packed and extends * (heads // 4) * triton.cdiv(max_extend, 64) < processors:
        return (64, 64, 4, 3, True, 4)
    return (256, 64, 16, 3, True, 4) if packed else (64, 64, 4, 3, True)


@functools.cache
def processors(index: int) -> int:
    """Streaming multiprocessors of CUDA device ``index``."""
    return torch.cuda.get_device_properties(index).multi_processor_count


def extend_attention(
    q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, table: torch.Tensor,
    rows: torch.Tensor, prefix_lens: torch.Tensor, extend_lens: torch.Tensor, q_starts: torch.Tensor,
    max_extend: int, scale: float, out: torch.Tensor | None = None,
    config: tuple[int, int, int, int, bool] | None = None, window: int = 0, softcap: float = 0.0,
    k_scale: float = 1.0, v_scale: float = 1.0, slot_map: torch.Tensor | None = None,
    tree_mask: torch.Tensor | None = None, tree_offsets: torch.Tensor | None = None,
) -> torch.Tensor:
    """``q`` [T, H, D]: the new tokens of R requests laid back to back (request r's start in
    ``q_starts``) -> [T, H, D]. ``config``: (BLOCK_M, BLOCK_N, num_warps, num_stages, K_ROWS[,
    PACK]): PACK query heads of a KV head's group share a program's BLOCK_M rows (1 if left
    out).
    ``window`` > 0: a query at position p sees keys ``(p - window, p]``; ``softcap`` > 0:
    scores soft-capped (``softcap * tanh(score / softcap)``); ``k_scale``/``v_scale``: the
    layer's scales of an fp8 pool; ``slot_map``: as ``decode_attention``'s. ``tree_mask``
    (flat bool) and ``tree_offsets`` [R]: a request r with ``tree_offsets[r]`` >= 0 has its
    new tokens' mask ([extend_len, extend_len], row-major: which of them each sees, causal
    and no window) from there; its prefix is seen whole."""
    T, H, D = q.shape
    Hkv = k_buf.shape[1]
    if out is None:
        out = torch.empty_like(q)
    R = rows.numel()
    block_m, block_n, warps, stages, k_rows, *pack = config or extend_config(D, max_extend, H // Hkv, H, R,
                                                                              processors(q.get_device()) if q.is_cuda else 0)
    pack = pack[0] if pack else 1
    group = H // Hkv
    if group % pack or block_m % pack:
        raise ValueError(f"extend_attention: a pack of {pack} query heads must divide the group ({group}) "
                         f"and BLOCK_M ({block_m})")
    block_d = triton.next_power_of_2(D)
    grid = (R, H // pack, triton.cdiv(max_extend, block_m // pack))
    _extend_kernel[grid](
        q, k_buf, v_buf, out, table, table if slot_map is None else slot_map, rows, prefix_lens, extend_lens,
        q_starts, tree_mask if tree_mask is not None else q_starts, tree_offsets if tree_offsets is not None
        else q_starts, scale * k_scale * _LOG2E, v_scale,
        q.stride(0), q.stride(1), k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1),
        out.stride(0), out.stride(1), table.stride(0),
        GROUP=group, BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=D, BLOCK_D=block_d,
        K_ROWS=k_rows, PACK=pack, WINDOW=window, SOFTCAP=softcap * _LOG2E, MAPPED=slot_map is not None,
        TREE=tree_offsets is not None, num_warps=warps,
        num_stages=stages,
    )
    return out


@triton.jit
def _kv_indices_kernel(Table, Rows, Indptr, Indices, stride_tr, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    row = tl.load(Rows + b)
    start = tl.load(Indptr + b)
    n = tl.load(Indptr + b + 1) - start
    for i in range(0, n, BLOCK):
        offs = i + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(Indices + start + offs, tl.load(Table + row * stride_tr + offs, mask=mask), mask=mask)


def build_kv_indices(table: torch.Tensor, rows: torch.Tensor, seq_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Flatten ``table[rows[b], :seq_lens[b]]`` for every b: (indptr [B+1], indices [sum])."""
    indptr = torch.zeros(rows.numel() + 1, dtype=torch.int64, device=table.device)
    indptr[1:] = torch.cumsum(seq_lens.to(torch.int64), 0)
    total = int(indptr[-1])
    indices = torch.empty(total, dtype=table.dtype, device=table.device)
    if total:
        _kv_indices_kernel[(rows.numel(),)](table, rows, indptr, indices, table.stride(0), BLOCK=512)
    return indptr, indices
