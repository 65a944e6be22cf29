"""CPU decode attention that reads cached KV where it lies: no copy of a request's prefix.

A request's slots often come in runs: a prompt's prefill takes consecutive free slots, and
requests that share a cached prefix (the radix tree) hold the very same slots for it. Per
decode request, the plan splits its KV in two:

    positions  0 ............ run-1 | run ............ len-1
               leading run: slots    | tail: gathered through the table, padded to the
               s, s+1, ..., s+run-1  | batch's longest tail, attended in one batched call
               (a view of the pool)  |

Requests whose runs start at the same slot share it (a slot belongs to one position of one
path of the radix tree, so both hold ``s + j`` at position ``j`` up to the shorter run): the
*segment* ``[s, s + min run)`` is attended once for all of them. The two partial softmaxes
are merged by their log-sum-exp, which equals attending over the whole sequence.

Contract: ``plan`` is built once per batch (``TorchAttention.begin``) from the decode
requests' padded slot matrix; ``attend`` is called per layer with that layer's buffers and
only reads them. The tail always holds a request's newest token (stored before ``attend``),
so no softmax is empty.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MIN_RUN = 32  # a shorter leading run is gathered with the tail (a call of its own costs more)
_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu  # returns the log-sum-exp too


@dataclass
class Segment:
    start: int                    # first slot
    length: int                   # slots (positions 0 .. length-1 of every member)
    members: list[int]            # decode indices of the requests that read it
    index: torch.Tensor | None    # the same as a tensor (None: one member)


@dataclass
class RunPlan:
    segments: list[Segment]
    tail_idx: torch.Tensor        # [Bd, S] slots of each request's tail (0 past its end)
    tail_mask: torch.Tensor       # [Bd, 1, 1, S] additive: 0 on the tail, -inf past its end


def plan(kv_idx: torch.Tensor, lens: list[int], dtype: torch.dtype, min_run: int = MIN_RUN) -> RunPlan | None:
    """The runs of a decode batch whose request ``b`` reads slots ``kv_idx[b, :lens[b]]``;
    None when no request has a leading run of ``min_run`` slots (all is tail)."""
    bd, width = kv_idx.shape
    min_run = max(min_run, 1)
    if width <= min_run:  # a run leaves the newest token to the tail: none can be long enough
        return None
    lens_t = torch.tensor(lens, dtype=torch.int64)
    breaks = kv_idx[:, 1:] - kv_idx[:, :-1] != 1
    runs = torch.where(breaks.any(1), breaks.to(torch.uint8).argmax(1) + 1, width)
    runs = torch.minimum(runs, lens_t - 1)  # the newest token stays in the tail
    groups: dict[int, list[int]] = {}
    for b, (first, run) in enumerate(zip(kv_idx[:, 0].tolist(), runs.tolist(), strict=True)):
        if run >= min_run:
            groups.setdefault(first, []).append(b)
    if not groups:
        return None
    run_list = runs.tolist()
    starts = [0] * bd
    segments = []
    for first, members in groups.items():
        length = min(run_list[b] for b in members)
        for b in members:
            starts[b] = length
        index = torch.tensor(members, dtype=torch.int64) if len(members) > 1 else None
        segments.append(Segment(first, length, members, index))
    starts_t = torch.tensor(starts, dtype=torch.int64)
    span = int((lens_t - starts_t).max())
    cols = starts_t[:, None] + torch.arange(span)[None, :]
    valid = cols < lens_t[:, None]
    tail_idx = torch.where(valid, kv_idx.gather(1, cols.clamp(max=width - 1)), 0)
    tail_mask = torch.zeros(valid.shape, dtype=dtype).masked_fill_(~valid, float("-inf"))[:, None, None, :]
    return RunPlan(segments, tail_idx, tail_mask)


def attend(p: RunPlan, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, scale: float) -> torch.Tensor:
    """Decode attention of ``q`` [Bd, H, D] (request b's query in row b) over the plan's
    KV in ``k_buf``/``v_buf`` [slots, Hkv, D] -> [Bd, H, D]."""
    bd, heads, dim = q.shape
    kv_heads = k_buf.shape[1]
    group = heads // kv_heads
    qg = q.view(bd, kv_heads, group, dim)  # head h reads KV head h // group
    k = k_buf[p.tail_idx].transpose(1, 2)  # [Bd, Hkv, S, D]
    v = v_buf[p.tail_idx].transpose(1, 2)
    out, lse = _flash(qg, k, v, attn_mask=p.tail_mask, scale=scale)  # [Bd, Hkv, G, D], [Bd, Hkv, G]
    seg_out = torch.zeros_like(out)
    seg_lse = torch.full_like(lse, float("-inf"))
    for s in p.segments:
        ks = k_buf[s.start : s.start + s.length].transpose(0, 1)[None]  # [1, Hkv, n, D], a view
        vs = v_buf[s.start : s.start + s.length].transpose(0, 1)[None]
        if s.index is None:
            b = s.members[0]
            o, lse_s = _flash(qg[b : b + 1], ks, vs, scale=scale)
            seg_out[b : b + 1] = o
            seg_lse[b : b + 1] = lse_s
            continue
        m = len(s.members)
        qs = qg[s.index].transpose(0, 1).reshape(1, kv_heads, m * group, dim)  # members' queries side by side
        o, lse_s = _flash(qs, ks, vs, scale=scale)
        seg_out[s.index] = o.view(kv_heads, m, group, dim).transpose(0, 1)
        seg_lse[s.index] = lse_s.view(kv_heads, m, group).transpose(0, 1)
    top = torch.maximum(lse, seg_lse)
    w_tail = (lse - top).exp_()[..., None]
    w_seg = (seg_lse - top).exp_()[..., None]
    merged = (out.float() * w_tail + seg_out.float() * w_seg) / (w_tail + w_seg)
    return merged.to(q.dtype).view(bd, heads, dim)
