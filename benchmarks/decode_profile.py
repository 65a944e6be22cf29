"""Where batch-1 decode time goes on a GPU, and what the kernels could reach.

One run (random bf16 weights in Llama-3-8B's shape, no downloads) prints and writes JSON:

- ``step``: the decode CUDA graph replayed alone at batch 1 and 64 (device time per step;
  each request 576 tokens of context in distinct slots),
  against the bytes a step really reads (layer weights, final norm, lm_head and the KV; the
  embedding table is not read, only one row of it);
- ``kernels``: one eager decode forward at batch 1 and 64 under ``torch.profiler``: device
  time per kernel family, their sum and the count of launches;
- ``attn``: decode attention alone at batch 64 and 256, swept over splits and tiles;
- ``gemv``: the step's matrix-vector products alone (every layer's qkv, o, gate_up, down and
  the lm_head) captured in one CUDA graph, through cuBLAS (``F.linear``) and through a Triton
  GEMV swept over tile sizes: the ceiling the weights' reads allow with each;
- ``shapes``: each projection shape at tp=1 and tp=2, 32 distinct weights per CUDA graph:
  cuBLAS vs Triton tiles per GEMV;
- ``fused``: the one-row fusions at tp=1 and tp=2 shapes, 32 distinct weights per CUDA
  graph: the q/k/v GEMV + ``rope_store`` and the gate/up GEMV + ``silu_mul`` as two kernels
  against the fused kernel (``gemv_rope_store``, ``gemv_silu_mul``) swept over tiles;
- ``rows``: the projections at 4..128 rows (decode batches), cuBLAS against
  ``triton_ops.rows_linear`` swept over tiles, 32 distinct weights per CUDA graph;
- ``extend``: the extend-attention kernel's tile configurations swept on 8 x 2048 against SDPA;
- ``cascade``: decode attention of requests in groups sharing a 2048-token prefix, plain
  against cascade decoding swept over the shared level's splits and tiles;
- ``merge``: decode attention as the engine splits it at batch 1, 8 and 64, 32 calls per
  CUDA graph: stage 2 as its own kernel against the split merge in stage 1's last program
  (``merge_in_kernel``), with programmatic dependent launch off and on.

    python -m benchmarks.decode_profile --out results/dir
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks import gpu_bench
from benchmarks.common import (
    SHAPES,
    checkpoint_dir,
    cuda_median_s,
    environment,
    time_graph,
    timed_section,
    write_json,
)
from benchmarks.quant import SCHEMES
from radixd.core import triton_ops
from radixd.core.cuda_graph import LEN, ROW
from radixd.core.sampling_params import SamplingParams
from radixd.core.triton_ops import gemv


def triton_gemv(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, bn: int, bk: int, warps: int) -> torch.Tensor:
    """radixd's one-row GEMV kernel with the given tiles."""
    return gemv(x, w, tiles=(bn, bk, warps), out=out)


CTX = 576  # tokens of context per request in the step and kernels sections (512 + 64)


@contextlib.contextmanager
def bucket_state(eng, bs: int, ctx: int = CTX):
    """Bucket ``bs``'s graph inputs as ``bs`` requests of ``ctx`` tokens each in their own
    table rows and slots (so the KV a step reads is ``bs`` x ``ctx`` distinct tokens, from
    HBM); a pool of fewer slots is gone round again (requests then share slots, each still
    reading its own ``ctx`` of them)."""
    g = eng.worker.graphs
    block = g.inputs[bs]
    table = eng.worker.pool.req_to_token
    rows = torch.arange(bs, device=block.device)
    table[:bs, :ctx] = (rows[:, None] * ctx + torch.arange(ctx, device=block.device)) % (eng.worker.pool.num_slots - 1) + 1
    block[ROW].copy_(rows)
    block[LEN].fill_(ctx)
    try:
        yield g
    finally:
        block[ROW].zero_()
        block[LEN].fill_(1)
        table[:bs, :ctx] = 0


def section_step(eng, ctx) -> dict:
    loop = ctx["loop"]
    p = [[1000 + i for i in range(512)]]
    loop.run_until_complete(_gen(eng, p, 64))
    out = {}
    for bs in ctx["batches"]:
        with bucket_state(eng, bs) as g:
            graph, _ = g.graphs[bs]
            t = cuda_median_s(graph.replay, reps=50)
        by = gpu_bench.read_bytes(eng) + bs * CTX * ctx["kv_per_tok"]
        out[f"b{bs}"] = {"graph_ms": round(t * 1e3, 3), "bytes_GB": round(by / 1e9, 3),
                         "roofline_ms": round(by / ctx["copy"] * 1e3, 3), "fraction": round(by / ctx["copy"] / t, 3)}
    return out


async def _gen(eng, prompts, new):
    async def one(p):
        async for _ in eng.generate(input_ids=p, params=SamplingParams(max_new_tokens=new, temperature=0, ignore_eos=True)):
            pass
    import asyncio
    await asyncio.gather(*(one(p) for p in prompts))


def section_kernels(eng, ctx) -> dict:
    return {f"b{bs}": _kernel_families(eng, bs) for bs in ctx["batches"]}


def device_kernels(eng, bs: int) -> list[tuple[str, float, int]]:
    """One eager decode forward of bucket ``bs`` under the profiler (after three unprofiled):
    each kernel's name, device µs and launches."""
    from torch.profiler import ProfilerActivity, profile

    model = eng.worker.model
    with bucket_state(eng, bs) as g, torch.inference_mode():
        args = g._bucket_args(bs)  # (points the attention backend at the bucket's inputs)
        for _ in range(3):
            model(*args)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            model(*args)
            torch.cuda.synchronize()
    out = []
    for ev in prof.key_averages():
        if str(getattr(ev, "device_type", "")).split(".")[-1] != "CUDA":
            continue
        us = getattr(ev, "self_device_time_total", None)
        out.append((ev.key, ev.self_cuda_time_total if us is None else us, ev.count))
    return out


def _kernel_families(eng, bs: int) -> dict:
    """One eager decode forward of bucket ``bs`` under the profiler: device time per family."""
    fam: dict[str, list[float]] = {}
    for name, us, count in device_kernels(eng, bs):
        key = ("gemm/gemv" if any(s in name.lower() for s in ("gemm", "gemv", "cutlass", "sm90", "nvjet", "cublas"))
               else name[:60])
        fam.setdefault(key, [0.0, 0])
        fam[key][0] += us
        fam[key][1] += count
    rows = sorted(((k, v[0], v[1]) for k, v in fam.items()), key=lambda r: -r[1])
    total = sum(r[1] for r in rows)
    return {"kernel_us_total": round(total, 1), "launches": sum(r[2] for r in rows),
            "families": [{"name": k, "us": round(us, 1), "count": n, "share": round(us / total, 3)} for k, us, n in rows[:16]]}


ATTN_CASES = [(64, 576), (64, 4096), (256, 576)]  # (requests, context tokens)


def section_attn(eng, ctx) -> dict:
    """Decode attention alone (scattered slots), swept over split counts and stage 1's
    (tile, warps, stages); 8 calls per CUDA graph so launch overhead is amortised. Per case:
    the default's time, the best few and their fraction of the copy bandwidth."""
    from radixd.core.attention import triton_kernels as tk

    cfg = eng.worker.model.cfg
    H, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    procs = torch.cuda.get_device_properties(0).multi_processor_count
    res = {}
    for B, L in ATTN_CASES:
        slots = B * L + 1
        kb = torch.randn(slots, Hkv, D, device="cuda", dtype=torch.bfloat16)
        vb = torch.randn_like(kb)
        table = (torch.randperm(slots - 1, device="cuda") + 1).view(B, L)
        args = (torch.randn(B, H, D, device="cuda", dtype=torch.bfloat16), kb, vb, table,
                torch.arange(B, device="cuda"), torch.full((B,), L, device="cuda"), D**-0.5)
        kv_bytes = 2 * B * L * Hkv * D * 2
        times = {}
        for splits in (1, 2, 4, 8):
            for conf in [(bn, w, st) for bn in (32, 64, 128) for w in (4, 8) for st in (1, 2, 3)]:
                try:
                    t = time_graph(lambda a=args, s=splits, c=conf: [tk.decode_attention(*a, num_splits=s, config=c)
                                                                     for _ in range(8)], reps=20) / 8
                except Exception as exc:  # (a tile that does not fit)
                    times[(splits, conf)] = repr(exc)[:80]
                    continue
                times[(splits, conf)] = t
        from radixd.core.attention.triton_backend import decode_splits

        default = (decode_splits(B, Hkv, procs), tk.DECODE_CONFIG)
        ok = sorted((t, k) for k, t in times.items() if isinstance(t, float))
        case = {"default": {"splits": default[0], "config": default[1], "us": round(times[default] * 1e6, 1),
                            "fraction_of_copy": round(kv_bytes / times[default] / ctx["copy"], 3)},
                "best": [{"splits": k[0], "config": k[1], "us": round(t * 1e6, 1),
                          "fraction_of_copy": round(kv_bytes / t / ctx["copy"], 3)} for t, k in ok[:6]]}
        res[f"B{B}_L{L}"] = case
        print(f"attn B{B}_L{L}", json.dumps(case), flush=True)
        del kb, vb
        torch.cuda.empty_cache()
    return res


MERGE_CASES = [(1, 576), (1, 4096), (8, 576), (64, 576)]  # (requests, context tokens)


def section_merge(eng, ctx) -> dict:
    """Decode attention as the engine splits it, 32 calls (a step's layers, each on its own
    K/V, together past the L2) per CUDA graph: stage 2 as a kernel of its own against the
    partials merged by stage 1's last program (``merge_in_kernel``), each with programmatic
    dependent launch off and on (on: Hopper or later only). µs per call and the saving."""
    res = {}
    for B, L in MERGE_CASES:
        case = _merge_case(eng.worker.model.cfg, B, L)
        res[f"B{B}_L{L}"] = case
        print(f"merge B{B}_L{L}", json.dumps(case), flush=True)
        torch.cuda.empty_cache()
    return res


def _merge_case(cfg, B: int, L: int) -> dict:
    from radixd.core.attention import triton_kernels as tk
    from radixd.core.attention.triton_backend import decode_splits

    H, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    slots = B * L + 1
    n = max(2, min(32, -(-200 * 2**20 // (2 * slots * Hkv * D * 2))))  # distinct K/V buffers, cycled
    kvs = [(torch.randn(slots, Hkv, D, device="cuda", dtype=torch.bfloat16),
            torch.randn(slots, Hkv, D, device="cuda", dtype=torch.bfloat16)) for _ in range(n)]
    table = (torch.randperm(slots - 1, device="cuda") + 1).view(B, L)
    q = torch.randn(B, H, D, device="cuda", dtype=torch.bfloat16)
    rows, lens = torch.arange(B, device="cuda"), torch.full((B,), L, device="cuda")
    splits = decode_splits(B, Hkv, torch.cuda.get_device_properties(0).multi_processor_count)
    mid_o = torch.empty((B, H, splits, D), dtype=torch.float32, device="cuda")
    mid_lse = torch.empty((B, H, splits), dtype=torch.float32, device="cuda")
    counters = torch.zeros((B, Hkv), dtype=torch.int32, device="cuda")
    outs = [torch.empty_like(q) for _ in range(32)]

    def step(pdl: bool, merged: bool) -> None:
        for i, out in enumerate(outs):
            kb, vb = kvs[i % n]
            tk.decode_attention(q, kb, vb, table, rows, lens, D**-0.5, num_splits=splits, out=out, mid_o=mid_o,
                                mid_lse=mid_lse, pdl=pdl, merge_in_kernel=merged, counters=counters)

    case = {"splits": splits, "kv_buffers": n}
    for pdl in (False, True) if torch.cuda.get_device_capability()[0] >= 9 else (False,):
        tag = "_pdl" if pdl else ""
        for merged in (False, True):
            us = time_graph(lambda pdl=pdl, merged=merged: step(pdl, merged)) / 32 * 1e6
            case[f"{'merged' if merged else 'two_stage'}{tag}_us"] = round(us, 2)
        case[f"saved{tag}_us"] = round(case[f"two_stage{tag}_us"] - case[f"merged{tag}_us"], 2)
    return case


CASCADE_CASES = [(256, 32, 2048, 260), (256, 64, 2048, 260), (64, 8, 2048, 260)]  # (requests, groups, prefix, own)


def section_cascade(eng, ctx) -> dict:
    """Decode attention of requests in groups sharing a prefix (scattered slots): plain
    split-KV decoding (every request reads its whole sequence) against cascade decoding
    (each group's prefix read once per item), swept over the shared level's splits and
    tiles; 8 calls per CUDA graph. Bytes: the distinct KV a step must read (each prefix once)."""
    res = {}
    for B, G, P, own in CASCADE_CASES:
        case = _cascade_case(eng, ctx, B, G, P, own)
        res[f"B{B}_G{G}_P{P}_own{own}"] = case
        print(f"cascade B{B} G{G}", json.dumps({k: v for k, v in case.items() if k != "cascade"}), flush=True)
        torch.cuda.empty_cache()
    return res


def _cascade_case(eng, ctx, B: int, G: int, P: int, own: int) -> dict:
    from radixd.core.attention import triton_kernels as tk
    from radixd.core.attention.triton_backend import decode_splits

    cfg = eng.worker.model.cfg
    H, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    procs = torch.cuda.get_device_properties(0).multi_processor_count
    per_item = tk.prefix_members(H // Hkv)
    slots = G * P + B * own + 1
    kb = torch.randn(slots, Hkv, D, device="cuda", dtype=torch.bfloat16)
    vb = torch.randn_like(kb)
    perm = torch.randperm(slots - 1, device="cuda") + 1
    prefixes = perm[: G * P].view(G, P)
    group = torch.arange(B, device="cuda") % G
    table = torch.cat((prefixes[group], perm[G * P :].view(B, own)), 1)
    items = []
    for g in range(G):
        mem = [b for b in range(B) if b % G == g]
        items += [(mem[0], mem[k : k + per_item]) for k in range(0, len(mem), per_item)]
    members = torch.full((per_item, B), -1, dtype=torch.int64)
    for i, (_, mem) in enumerate(items):
        members[: len(mem), i] = torch.tensor(mem)
    item_rows = torch.tensor([r for r, _ in items] + [0] * (B - len(items)), device="cuda")
    item_lens = torch.tensor([P] * len(items) + [0] * (B - len(items)), device="cuda")
    q = torch.randn(B, H, D, device="cuda", dtype=torch.bfloat16)
    rows, lens = torch.arange(B, device="cuda"), torch.full((B,), P + own, device="cuda")
    splits = decode_splits(B, Hkv, procs)
    distinct = 2 * (G * P + B * own) * Hkv * D * 2
    whole = 2 * B * (P + own) * Hkv * D * 2
    plain = time_graph(lambda: [tk.decode_attention(q, kb, vb, table, rows, lens, D**-0.5, num_splits=splits)
                                for _ in range(8)], reps=20) / 8
    case = {"plain_us": round(plain * 1e6, 1), "plain_fraction_of_copy": round(whole / plain / ctx["copy"], 3),
            "distinct_MB": round(distinct / 1e6, 1), "cascade": []}
    shares = torch.full((B,), P, device="cuda")
    mem_t = members.cuda()
    default = tk.PREFIX_CONFIG
    for psplits in (1, 2, 4, 8):
        parts = torch.full((B,), psplits, device="cuda")
        for conf in [(64, 4, 3), (32, 4, 3), (64, 8, 3), (128, 8, 2), (64, 4, 2)]:
            tk.PREFIX_CONFIG = conf
            try:
                t = time_graph(lambda parts=parts: [tk.cascade_decode_attention(
                    q, kb, vb, table, rows, lens, D**-0.5, shares, parts, item_rows, item_lens, mem_t,
                    num_splits=splits, prefix_splits=8) for _ in range(8)], reps=20) / 8
            except Exception as exc:  # (a tile that does not fit)
                case["cascade"].append({"prefix_splits": psplits, "config": conf, "error": repr(exc)[:80]})
                continue
            finally:
                tk.PREFIX_CONFIG = default
            case["cascade"].append({"prefix_splits": psplits, "config": conf, "us": round(t * 1e6, 1),
                                    "fraction_of_copy": round(distinct / t / ctx["copy"], 3)})
    case["best"] = sorted((c for c in case["cascade"] if "us" in c), key=lambda c: c["us"])[:4]
    return case


def section_gemv(eng, ctx) -> dict:
    model = eng.worker.model
    ws = []
    for layer in model.layers:
        ws += [layer.self_attn.qkv_proj.weight, layer.self_attn.o_proj.weight,
               layer.mlp.gate_up_proj.weight, layer.mlp.down_proj.weight]
    ws.append(model.lm_head.weight)
    by = sum(w.numel() * w.element_size() for w in ws)
    xs = {w.shape[1]: torch.randn(1, w.shape[1], device="cuda", dtype=w.dtype) for w in ws}
    outs = [torch.empty(w.shape[0], device="cuda", dtype=w.dtype) for w in ws]
    res = {"bytes_GB": round(by / 1e9, 3)}

    def cublas():
        for w in ws:
            F.linear(xs[w.shape[1]], w)

    t = time_graph(cublas)
    res["cublas"] = {"ms": round(t * 1e3, 3), "fraction_of_copy": round(by / t / ctx["copy"], 3)}
    best = None
    for bn, bk, warps in [(4, 512, 4), (8, 512, 4), (8, 256, 4), (16, 256, 4), (16, 512, 8), (32, 128, 4),
                          (8, 1024, 8), (4, 1024, 4), (16, 128, 4)]:
        def tri(bn=bn, bk=bk, warps=warps):
            for w, o in zip(ws, outs, strict=True):
                triton_gemv(xs[w.shape[1]][0], w, o, bn, bk, warps)
        try:
            t = time_graph(tri)
        except Exception as exc:  # a tile that does not compile is a result too
            res[f"triton_{bn}x{bk}_w{warps}"] = {"error": repr(exc)[:200]}
            continue
        r = {"ms": round(t * 1e3, 3), "fraction_of_copy": round(by / t / ctx["copy"], 3)}
        res[f"triton_{bn}x{bk}_w{warps}"] = r
        if best is None or t < best[1]:
            best = (f"{bn}x{bk}_w{warps}", t)
    w = ws[2]
    ref = F.linear(xs[w.shape[1]], w)[0]
    bn, bk, warps = (int(best[0].split("x")[0]), int(best[0].split("x")[1].split("_")[0]), int(best[0].split("_w")[1]))
    got = triton_gemv(xs[w.shape[1]][0], w, torch.empty_like(ref), bn, bk, warps)
    res["best_triton"] = best[0]
    res["triton_max_rel_err"] = round(float((got.float() - ref.float()).abs().max() / ref.float().abs().max()), 5)
    # per-shape: cuBLAS vs best Triton
    for name, w in [("qkv", ws[0]), ("o", ws[1]), ("gate_up", ws[2]), ("down", ws[3]), ("lm_head", ws[-1])]:
        b = w.numel() * w.element_size()
        tc = time_graph(lambda w=w: F.linear(xs[w.shape[1]], w), reps=50)
        tt = time_graph(lambda w=w: triton_gemv(xs[w.shape[1]][0], w, torch.empty(w.shape[0], device="cuda", dtype=w.dtype), bn, bk, warps), reps=50)
        res[f"shape_{name}"] = {"N_K": list(w.shape), "cublas_frac": round(b / tc / ctx["copy"], 3),
                                "triton_frac": round(b / tt / ctx["copy"], 3)}
    return res


def section_shapes(eng, ctx) -> dict:
    """Each projection shape of the 8B model at tp=1 and tp=2, as a decode step meets it: 32
    distinct weights (one per layer, so nothing is read from L2) in one CUDA graph, batch 1;
    microseconds per GEMV and the fraction of the copy bandwidth, cuBLAS vs Triton tiles."""
    cfg = eng.worker.model.cfg
    h, d = cfg.hidden_size, cfg.head_dim
    shapes = {}
    for tp in (1, 2):
        shapes[f"tp{tp}_qkv"] = ((cfg.num_heads + 2 * cfg.num_kv_heads) * d // tp, h)
        shapes[f"tp{tp}_o"] = (h, cfg.num_heads * d // tp)
        shapes[f"tp{tp}_gate_up"] = (2 * cfg.intermediate_size // tp, h)
        shapes[f"tp{tp}_down"] = (h, cfg.intermediate_size // tp)
    tiles = [(4, 512, 4), (4, 1024, 4), (8, 512, 4), (2, 1024, 4), (2, 2048, 8), (1, 2048, 4), (4, 256, 2)]
    res = {}
    for name, (n, k) in shapes.items():
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(32)]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(n, device="cuda", dtype=torch.bfloat16)
        by = 32 * n * k * 2
        row = {"N_K": [n, k]}
        t = time_graph(lambda ws=ws, x=x: [F.linear(x, w) for w in ws])
        row["cublas_us"] = round(t / 32 * 1e6, 2)
        row["cublas_frac"] = round(by / t / ctx["copy"], 3)
        for bn, bk, warps in tiles:
            if k % bk:  # (the kernel reads whole K tiles)
                continue
            try:
                t = time_graph(lambda ws=ws, x=x, out=out, bn=bn, bk=bk, warps=warps:
                               [triton_gemv(x[0], w, out, bn, bk, warps) for w in ws])
            except Exception as exc:
                row[f"triton_{bn}x{bk}_w{warps}"] = repr(exc)[:120]
                continue
            row[f"triton_{bn}x{bk}_w{warps}_us"] = round(t / 32 * 1e6, 2)
        best = min((v, kk) for kk, v in row.items() if kk.startswith("triton") and isinstance(v, float))
        row["best_triton"] = best[1]
        row["best_triton_frac"] = round(by / (best[0] * 32 / 1e6) / ctx["copy"], 3)
        res[name] = row
        print(name, json.dumps(row), flush=True)
        del ws
        torch.cuda.empty_cache()
    return res


FUSED_TILES = [(2048, 4), (2048, 8), (1024, 4), (1024, 2), (512, 2)]


def section_fused(eng, ctx) -> dict:
    res = {}
    for tp in (1, 2):
        for name, case in _fused_cases(eng.worker.model, tp).items():
            res[f"tp{tp}_{name}"] = row = _time_fused(*case)
            print(f"tp{tp}_{name}", json.dumps(row), flush=True)
            torch.cuda.empty_cache()
    return res


def _fused_cases(model, tp: int) -> dict:
    """name -> (weight rows, hidden, unfused(w), fused(w, tiles)) at a tp shard's shapes."""
    cfg, rot = model.cfg, model.rotary
    h, d = cfg.hidden_size, cfg.head_dim
    heads, kv_heads, inter = cfg.num_heads // tp, cfg.num_kv_heads // tp, cfg.intermediate_size // tp
    pos = torch.tensor([600], device="cuda")
    loc = torch.tensor([3], device="cuda")
    kb = torch.zeros(8, kv_heads, d, device="cuda", dtype=torch.bfloat16)
    vb = torch.zeros_like(kb)
    x = torch.randn(1, h, device="cuda", dtype=torch.bfloat16)
    split = (heads * d, kv_heads * d, kv_heads * d)

    def qkv_unfused(w):
        q, k, v = gemv(x, w).split(split, dim=-1)
        triton_ops.rope_store(q.view(1, heads, d), k.view(1, kv_heads, d), v.view(1, kv_heads, d), pos,
                              rot.cos, rot.sin, kb, vb, loc)

    def qkv_fused(w, tiles):
        triton_ops.gemv_rope_store(x, w, None, pos, rot.cos, rot.sin, kb, vb, loc, num_heads=heads, tiles=tiles)

    return {"qkv_rope": ((heads + 2 * kv_heads) * d, h, qkv_unfused, qkv_fused),
            "gate_up_silu": (2 * inter, h, lambda w: triton_ops.silu_mul(gemv(x, w)),
                             lambda w, tiles: triton_ops.gemv_silu_mul(x, w, tiles=tiles))}


def _time_fused(n: int, k: int, unfused, fused) -> dict:
    """Microseconds per call over 32 distinct [n, k] weights in one CUDA graph."""
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(32)]
    row = {"N_K": [n, k], "unfused_us": round(time_graph(lambda: [unfused(w) for w in ws]) / 32 * 1e6, 2)}
    for tiles in FUSED_TILES:
        t = time_graph(lambda tiles=tiles: [fused(w, tiles) for w in ws])
        row[f"fused_{tiles[0]}_w{tiles[1]}_us"] = round(t / 32 * 1e6, 2)
    return row


ROWS_M = (4, 16, 32, 64, 128)
ROWS_WIN = 1.02  # --rows-write keeps a tile only if it beats cuBLAS by this much
ROWS_TILES = [(32, 256, 4, 4, 1), (64, 256, 4, 3, 1), (64, 128, 4, 4, 1), (128, 128, 4, 3, 1), (128, 64, 8, 4, 1),
              (64, 128, 4, 4, 2), (64, 128, 4, 4, 4), (64, 256, 4, 3, 2), (128, 128, 8, 3, 4), (64, 64, 4, 3, 4),
              (64, 64, 4, 4, 2), (64, 64, 4, 3, 8), (32, 128, 4, 3, 4), (32, 64, 4, 4, 4), (64, 128, 4, 2, 4),
              (128, 64, 4, 3, 2), (64, 64, 8, 4, 4), (32, 128, 4, 3, 2), (64, 128, 4, 3, 3), (128, 64, 8, 3, 2)]


def section_rows(eng, ctx) -> dict:
    """The decode step's projections at 4..128 rows (batch sizes), 32 distinct weights per
    CUDA graph (nothing read from L2): cuBLAS (``F.linear``; gate/up followed by
    ``silu_mul``) against ``triton_ops.rows_linear`` swept over tiles; microseconds per call,
    the fraction of the copy bandwidth, and the best tile per shape and row count."""
    cfg = eng.worker.model.cfg
    h, d, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    shapes = {"qkv": ((cfg.num_heads + 2 * cfg.num_kv_heads) * d, h, False), "o": (h, cfg.num_heads * d, False),
              "gate_up_silu": (2 * inter, h, True), "down": (h, inter, False),
              "lm_head": (eng.worker.model.lm_head.weight.shape[0], h, False)}
    if ctx["rows_shapes"]:
        shapes = {name: shapes[name] for name in ctx["rows_shapes"]}
    tile_list = ctx["rows_tiles"] or ROWS_TILES
    res = {}
    for name, (n, k, silu) in shapes.items():
        copies = 4 if name == "lm_head" else 32
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        by = copies * n * k * 2
        shape = res[name] = {"N_K": [n, k], "silu": silu}
        for m in ctx["rows_m"] or ROWS_M:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = F.linear(x, ws[0])
            if silu:
                ref = triton_ops.silu_mul(ref)
            row = {}
            t = time_graph(lambda ws=ws, x=x, silu=silu: [triton_ops.silu_mul(F.linear(x, w)) if silu else F.linear(x, w)
                                               for w in ws])
            row["cublas"] = (round(t / copies * 1e6, 2), round(by / t / ctx["copy"], 3))
            for tiles in tile_list:
                try:
                    got = triton_ops.rows_linear(x, ws[0], silu=silu, tiles=tiles)
                    err = float((got.float() - ref.float()).abs().max() / ref.float().abs().max())
                    if tiles[4] > 1 and not all(torch.equal(got, triton_ops.rows_linear(x, ws[0], silu=silu, tiles=tiles))
                                                for _ in range(20)):
                        err = float("nan")  # (a split-K race would show as a result that varies)
                    t = time_graph(lambda ws=ws, x=x, tiles=tiles, silu=silu: [triton_ops.rows_linear(x, w, silu=silu, tiles=tiles)
                                                                    for w in ws])
                except Exception as exc:  # (a tile that does not fit)
                    row[str(tiles)] = repr(exc)[:80]
                    continue
                row[str(tiles)] = (round(t / copies * 1e6, 2), round(by / t / ctx["copy"], 3), round(err, 4))
            ok = sorted((v[0], kk) for kk, v in row.items() if kk != "cublas" and isinstance(v, tuple))
            row["best"] = ok[0][1] if ok else None
            row["best_over_cublas"] = round(row["cublas"][0] / ok[0][0], 3) if ok else None
            default = str(triton_ops.rows_tiles(m, n // 2 if silu else n, k, silu=silu))
            row["default"] = default
            row["default_over_cublas"] = (round(row["cublas"][0] / row[default][0], 3)
                                          if isinstance(row.get(default), tuple) else None)
            shape[f"M{m}"] = row
            print(f"rows {name} M{m}", json.dumps(row), flush=True)
        del ws
        torch.cuda.empty_cache()
    if ctx["rows_write"]:
        table = json.loads(triton_ops.ROWS_TUNED.read_text()) if triton_ops.ROWS_TUNED.exists() else {}
        table.setdefault(torch.cuda.get_device_name(), {}).update(rows_table(res))
        path = Path(ctx["rows_write"])
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    return res


def rows_table(res: dict) -> dict:
    """``triton_ops.ROWS_TUNED``'s entries for one GPU from the rows section's results: per
    shape and row count, the fastest tiles if they beat cuBLAS by ROWS_WIN, else None."""
    tuned = {}
    for shape in res.values():
        (n, k), silu = shape["N_K"], shape["silu"]
        key = triton_ops.rows_shape_key(n // 2 if silu else n, k, silu)
        for m, row in shape.items():
            if m.startswith("M"):
                win = row["best"] and row["best_over_cublas"] >= ROWS_WIN
                tuned.setdefault(key, {})[m[1:]] = list(ast.literal_eval(row["best"])) if win else None
    return tuned


def section_extend(eng, ctx) -> dict:
    from radixd.core.attention import triton_kernels as tk

    cfg = eng.worker.model.cfg
    H, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    R, N = 8, 2048
    kb = torch.randn(R * N + 1, Hkv, D, device="cuda", dtype=torch.bfloat16)
    vb = torch.randn_like(kb)
    table = (torch.arange(R * N, device="cuda") + 1).view(R, N)
    q = torch.randn(R * N, H, D, device="cuda", dtype=torch.bfloat16)
    rows = torch.arange(R, device="cuda")
    pre = torch.zeros(R, dtype=torch.int64, device="cuda")
    ext = torch.full((R,), N, device="cuda")
    starts = torch.arange(R, device="cuda") * N
    qs = q.view(R, N, H, D).transpose(1, 2)
    ks = kb[1:].view(R, N, Hkv, D).transpose(1, 2)
    vs = vb[1:].view(R, N, Hkv, D).transpose(1, 2)
    t_sdpa = cuda_median_s(lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True))
    ref = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True).transpose(1, 2).reshape(R * N, H, D)
    flops = R * 4 * H * D * N * N / 2
    res = {"sdpa_ms": round(t_sdpa * 1e3, 3), "sdpa_TFLOPs": round(flops / t_sdpa / 1e12, 1)}
    t0 = cuda_median_s(lambda: tk.extend_attention(q, kb, vb, table, rows, pre, ext, starts, N, D**-0.5))
    res["current"] = {"ms": round(t0 * 1e3, 3), "sdpa_over": round(t_sdpa / t0, 3)}
    if hasattr(tk, "EXTEND_CONFIGS"):
        for cfg_ in tk.EXTEND_CONFIGS:
            try:
                fn = lambda c=cfg_: tk.extend_attention(q, kb, vb, table, rows, pre, ext, starts, N, D**-0.5, config=c)  # noqa: E731
                out = fn()
                err = float((out.float() - ref.float()).abs().max())
                t = cuda_median_s(fn)
            except Exception as exc:
                res[str(cfg_)] = {"error": repr(exc)[:200]}
                continue
            res[str(cfg_)] = {"ms": round(t * 1e3, 3), "sdpa_over": round(t_sdpa / t, 3), "max_abs_err": round(err, 4)}
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="llama3-8b", choices=sorted(SHAPES))
    ap.add_argument("--sections", default="step,kernels,gemv,extend")
    ap.add_argument("--batches", default="1,64", help="step and kernels sections: decode batch sizes")
    ap.add_argument("--quant", default="", choices=["", *SCHEMES],
                    help="the step and kernels sections on weights quantized in-process (benchmarks.quant's schemes)")
    ap.add_argument("--rows-m", default="", help=f"rows section: row counts (default {','.join(map(str, ROWS_M))})")
    ap.add_argument("--rows-shapes", default="", help="rows section: some of qkv,o,gate_up_silu,down,lm_head")
    ap.add_argument("--rows-tiles", default="", help="rows section: JSON list of [rows, K step, warps, stages, splits]")
    ap.add_argument("--rows-write", default="", help="rows section: write radixd/core/tuned/rows_linear.json with "
                    "this GPU's fastest tiles per shape and row count (None where cuBLAS is within 2%%) to this path")
    args = ap.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    import asyncio
    loop = asyncio.new_event_loop()
    ctx = {"loop": loop, "rows_m": [int(m) for m in args.rows_m.split(",") if m],
           "rows_shapes": [s for s in args.rows_shapes.split(",") if s],
           "rows_tiles": [tuple(t) for t in json.loads(args.rows_tiles)] if args.rows_tiles else None,
           "rows_write": args.rows_write}
    gpu_bench.ceilings(None, ctx)
    ctx["copy"] = ctx["copy_Bps"]
    ctx["batches"] = [int(b) for b in args.batches.split(",")]
    path = gpu_bench.model_dir(args.model)
    if args.quant and SCHEMES[args.quant]:
        path = checkpoint_dir({**SHAPES[args.model], "quantization_config": SCHEMES[args.quant]},
                              prefix=f"radixd-{args.model}-{args.quant}-")
    eng = gpu_bench.engine(path, max_running_requests=max(64, *ctx["batches"]))
    ctx["kv_per_tok"] = gpu_bench.pool_kv_bytes_per_token(eng)
    summary = {"environment": environment(), "copy_TBps": round(ctx["copy"] / 1e12, 3), "model": args.model,
               "quant": args.quant or None}
    fns = {"step": section_step, "kernels": section_kernels, "attn": section_attn, "gemv": section_gemv,
           "shapes": section_shapes, "rows": section_rows, "cascade": section_cascade,
           "fused": section_fused, "extend": section_extend, "merge": section_merge}
    for name in args.sections.split(","):
        summary[name] = timed_section(lambda name=name: fns[name](eng, ctx))
        print(f"== {name}: {json.dumps(summary[name])}", flush=True)
    write_json(Path(args.out, f"profile_{args.model}{'_' + args.quant if args.quant else ''}.json"), summary)
    loop.run_until_complete(eng.stop())
    return 0


if __name__ == "__main__":
    sys.exit(main())
