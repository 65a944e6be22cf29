"""The fp8 KV cache against the bf16 one in the same run: decode speed at a large batch of
long contexts, and the tokens each pool holds in the same memory.

Llama-3-8B's shape (32 query heads, 8 KV heads, head dim 128) with random bf16 weights, no
downloads. One engine per KV dtype (``kv_cache_dtype`` "auto" = bf16, then "fp8_e4m3"), each
given the same pool budget: the bytes fp8 needs for ``--batch`` x ``--context`` tokens. Per
engine:

- ``pool_tokens``: the tokens its pool holds in that budget;
- ``step_ms``/``tok_s``: the decode CUDA graph of the batch's bucket replayed alone, each
  request ``--context`` tokens of context (as ``benchmarks.decode_profile``'s ``step``
  section measures a step), and ``batch / step`` tokens/s;
- ``bytes_GB``/``fraction``: what a step must read (weights but the embedding table, and the
  batch's KV in the pool's dtype) and that over the copy bandwidth measured in the run.

A bf16 pool of that budget cannot hold ``batch`` x ``context`` tokens (half of them): its
requests' table rows go round the pool again and share slots (``slots_shared``), each still
reading its own ``context`` tokens, every one of them from HBM (one request's KV, 512 MiB at
the defaults, is ten times the L2 cache), so the step reads what distinct slots would.

    python -m benchmarks.fp8_kv --out benchmarks/results/fp8_kv/h200.json
    python -m benchmarks.fp8_kv --quick --out /tmp/fp8_kv.json   # a tiny CPU model: the logic only

``--quick``: a two-layer model on the CPU (float32 weights, the torch backend, eager steps
timed on the wall clock): the script's logic, not a figure.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import torch

from benchmarks import gpu_bench
from benchmarks.common import SHAPES, checkpoint_dir, cuda_median_s, environment, free, write_json
from benchmarks.decode_profile import bucket_state
from radixd.core.forward_batch import ForwardBatch
from radixd.core.kv_pool import kv_bytes_per_token
from radixd.core.kv_quant import FP8_DTYPES

KV_DTYPES = ("auto", "fp8_e4m3")
QUICK_SHAPE = dict(SHAPES["llama3-8b"], hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, intermediate_size=256, vocab_size=512)


def budget_bytes(shape: dict, batch: int, context: int) -> int:
    """The pool budget of both engines: what fp8 needs for ``batch`` x ``context`` tokens
    (plus one step's new tokens and the padding slot)."""
    head_dim = shape["hidden_size"] // shape["num_attention_heads"]
    per_token = kv_bytes_per_token(shape["num_hidden_layers"], shape["num_key_value_heads"], head_dim,
                                   FP8_DTYPES["fp8_e4m3"])
    return (batch * (context + 1) + 1) * per_token


def run_one(path: str, kv: str, budget: int, batch: int, context: int, copy_bps: float | None) -> dict:
    eng = gpu_bench.engine(path, kv_cache_bytes=budget, kv_cache_dtype=kv, max_running_requests=batch,
                           max_context_len=context + 16)
    loop = asyncio.new_event_loop()
    try:
        pool = eng.worker.pool
        held = pool.num_slots - 1
        per_tok = gpu_bench.pool_kv_bytes_per_token(eng)
        step_s = graph_step_s(eng, batch, context) if copy_bps is not None else eager_step_s(eng, batch, context)
        by = gpu_bench.read_bytes(eng) + batch * context * per_tok
        out = {"kv_dtype": str(pool.dtype).removeprefix("torch."), "pool_tokens": held, "kv_bytes_per_token": per_tok,
               "slots_shared": held < batch * context, "step_ms": round(step_s * 1e3, 3),
               "tok_s": round(batch / step_s, 1), "bytes_GB": round(by / 1e9, 3)}
        if copy_bps is not None:
            out["roofline_ms"] = round(by / copy_bps * 1e3, 3)
            out["fraction"] = round(by / copy_bps / step_s, 3)
        return out
    finally:
        loop.run_until_complete(eng.stop())
        loop.close()


def graph_step_s(eng, batch: int, context: int) -> float:
    """Median device time of the batch's decode graph, every request ``context`` tokens long."""
    with bucket_state(eng, batch, context) as g:
        graph, _ = g.graphs[batch]
        return cuda_median_s(graph.replay, reps=20)


def eager_step_s(eng, batch: int, context: int) -> float:
    """(``--quick``) Median wall time of an eager decode forward of the same batch."""
    pool = eng.worker.pool
    rows = torch.arange(batch)
    pool.req_to_token[:batch, :context] = (rows[:, None] * context + torch.arange(context)) % (pool.num_slots - 1) + 1
    fb = ForwardBatch(input_ids=torch.zeros(batch, dtype=torch.int64), positions=torch.full((batch,), context - 1),
                      out_cache_loc=torch.zeros(batch, dtype=torch.int64), rows=list(range(batch)),
                      prefix_lens=[context - 1] * batch, extend_lens=[1] * batch, table_writes=[],
                      sample_indices=list(range(batch)), write_new_slots=False)
    times = []
    for _ in range(5):
        t = time.perf_counter()
        eng.worker.forward(fb)
        times.append(time.perf_counter() - t)
    pool.req_to_token[:batch, :context] = 0
    return sorted(times)[len(times) // 2]


SWEEP_CONFIGS = tuple((n, w, s) for n in (32, 64, 128) for w in (4, 8) for s in (2, 3, 4))


def sweep(batch: int, context: int, copy_bps: float, configs=SWEEP_CONFIGS, fp8_dot: bool = False) -> dict:
    """(``--sweep``) The decode kernel alone on one layer's K/V at the run's batch and context,
    bf16 against fp8, over stage 1's (tokens per tile, warps, stages): device time and the K/V
    bytes read over the copy bandwidth. Every request reads its own slots. ``fp8_dot``:
    fp8 with ``decode_attention``'s ``fp8_dot`` (q.K on the fp8 tensor cores) timed too."""

    from radixd.core.attention.triton_backend import decode_splits
    from radixd.core.attention.triton_kernels import (
        DECODE_CONFIG,
        FP8_DECODE_CONFIG,
        decode_attention,
    )

    heads, kv_heads, dim = 32, 8, 128
    dev = torch.device("cuda")
    slots = batch * context + 1
    table = torch.arange(batch * context, device=dev, dtype=torch.int64).view(batch, context) + 1
    rows = torch.arange(batch, device=dev, dtype=torch.int64)
    lens = torch.full((batch,), context, device=dev, dtype=torch.int64)
    q = torch.randn(batch, heads, dim, device=dev, dtype=torch.bfloat16)
    splits = decode_splits(batch, kv_heads, torch.cuda.get_device_properties(dev).multi_processor_count)
    out: dict = {"splits": splits, "default": list(DECODE_CONFIG), "fp8_default": list(FP8_DECODE_CONFIG), "configs": {}}
    ref = None
    kb = (torch.randn(slots, kv_heads, dim, device=dev) * 0.5).to(torch.bfloat16)
    vb = (torch.randn(slots, kv_heads, dim, device=dev) * 0.5).to(torch.bfloat16)
    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        k, v = kb.to(dtype), vb.to(dtype)
        by = 2 * batch * context * kv_heads * dim * k.element_size()
        name = str(dtype).removeprefix("torch.")
        variants = [(False, False), (True, False)] + [(False, True)] * fp8_dot if k.element_size() == 1 else [(False, False)]
        for f16, f8 in variants:
            tag = name + (" fp16 products" if f16 else "") + (" fp8 q.K" if f8 else "")
            best = None
            for cfg in configs:
                def call(cfg=cfg, k=k, v=v, f16=f16, f8=f8):
                    return decode_attention(q, k, v, table, rows, lens, dim ** -0.5, num_splits=splits, config=cfg,
                                            fp16_dot=f16, fp8_dot=f8)
                try:
                    o = call()
                    if dtype == torch.bfloat16 and cfg == tuple(DECODE_CONFIG):
                        ref = o.float()
                    s = cuda_median_s(call, reps=10)
                except Exception as e:  # (a config the compiler refuses: reported, the sweep goes on)
                    out["configs"][f"{tag} {cfg}"] = {"error": repr(e)[:200]}
                    continue
                row = {"us": round(s * 1e6, 1), "fraction": round(by / copy_bps / s, 3)}
                if ref is not None and dtype != torch.bfloat16:  # (the same values, rounded to fp8)
                    row["rel_err_vs_bf16"] = round(float((o.float() - ref).norm() / ref.norm()), 4)
                out["configs"][f"{tag} {cfg}"] = row
                if best is None or s < best[1]:
                    best = (cfg, s)
                print(f"sweep {tag} {cfg}: {row}", flush=True)
            if best is None:
                continue
            out[f"best {tag}"] = {"config": list(best[0]), "us": round(best[1] * 1e6, 1),
                                  "fraction": round(by / copy_bps / best[1], 3)}
        del k, v
        free()
    print("sweep best:", {k: v for k, v in out.items() if k.startswith("best")}, flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="the JSON file to write")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--quick", action="store_true", help="a tiny model on the CPU (the logic, not a figure)")
    ap.add_argument("--sweep", action="store_true", help="first, the decode kernel alone over its tile configs")
    ap.add_argument("--sweep-configs", default="", help="the sweep's configs, 'tokens,warps,stages;...' (default: 18)")
    ap.add_argument("--sweep-fp8-dot", action="store_true", help="the sweep times fp8 with fp8_dot too")
    ap.add_argument("--sweep-only", action="store_true", help="the sweep alone, no engines")
    args = ap.parse_args(argv)
    if args.quick:
        gpu_bench.DEVICE["name"] = "cpu"
        shape, batch, context, copy_bps = QUICK_SHAPE, min(args.batch, 8), min(args.context, 64), None
        doc = {"quick": True}
    else:
        shape, batch, context = SHAPES["llama3-8b"], args.batch, args.context
        ctx: dict = {}
        doc = {"ceilings": gpu_bench.ceilings(None, ctx)}
        copy_bps = ctx["copy_Bps"]
        if args.sweep or args.sweep_only:
            configs = (tuple(tuple(map(int, c.split(","))) for c in args.sweep_configs.split(";"))
                       if args.sweep_configs else SWEEP_CONFIGS)
            doc["sweep"] = sweep(args.batch, args.context, copy_bps, configs, args.sweep_fp8_dot)
            write_json(Path(args.out), doc)
            if args.sweep_only:
                return 0
    path = checkpoint_dir(shape, prefix="radixd-fp8kv-")
    budget = budget_bytes(shape, batch, context)
    doc.update(environment=environment(), model="llama3-8b" if not args.quick else "tiny", batch=batch,
               context=context, pool_budget_bytes=budget)
    runs = {}
    for kv in KV_DTYPES:
        runs[kv] = run_one(path, kv, budget, batch, context, copy_bps)
        free()  # (the engine is gone: its pool's memory goes back before the next one)
    doc["runs"] = runs
    bf16, fp8 = runs["auto"], runs["fp8_e4m3"]
    doc["fp8_over_bf16"] = {"tok_s": round(fp8["tok_s"] / bf16["tok_s"], 3),
                            "pool_tokens": round(fp8["pool_tokens"] / bf16["pool_tokens"], 3)}
    print(f"fp8_kv batch {batch} x {context}: bf16 {bf16['tok_s']} tok/s ({bf16['pool_tokens']} tokens), "
          f"fp8 {fp8['tok_s']} tok/s ({fp8['pool_tokens']} tokens): {doc['fp8_over_bf16']}", flush=True)
    write_json(Path(args.out), doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
