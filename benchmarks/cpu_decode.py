"""Where one CPU decode step of the default model goes, and how fast it runs.

The default model (SmolLM2-135M-Instruct) decodes a batch of ``--batch`` requests, each with
``--context`` tokens of KV: in ``shared`` layout every request reads the same first
``--shared`` slots (a system prompt from the radix cache) and its own after them; in
``random`` layout each reads its own. One run prints and writes JSON:

- ``step_ms``: the wall and process time of one forward step (median of ``--steps``);
- ``profile``: CPU time per op kind (``torch.profiler``) of one step, top entries first;
- with ``--ab N``: ``ab``, the step under each ``--variant`` (environment settings, e.g.
  ``RADIXD_CPU_ISA=baseline``; ``""`` is radixd as shipped), alternated N times in this
  process: one model per variant, loaded under its settings (weights are packed for the
  kernels the settings allow), each step run under them (min and median of each turn's 4
  steps, ratios to the first variant). Without ``--variant``: as shipped against
  ``RADIXD_CPU_KERNELS=off`` (torch's paths only).

    python -m benchmarks.cpu_decode --layout shared --batch 8 --out benchmarks/results/cpu_decode.json
    python -m benchmarks.cpu_decode --layout random --batch 1 --gguf-weights native --ab 6
    python -m benchmarks.cpu_decode --layout random --batch 8 --gguf-weights native --kv-cache-dtype float16
    python -m benchmarks.cpu_decode --layout random --batch 8 --gguf-weights native --ab 6 \
        --variant "" --variant RADIXD_CPU_FUSED=off --variant RADIXD_CPU_ISA=baseline
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
from pathlib import Path

import torch

from radixd.core import cpu_kernels, cpu_setup
from radixd.core.assembly import pick_dtype
from radixd.core.attention import make_backend
from radixd.core.cascade import chain, plan
from radixd.core.forward_batch import ForwardBatch
from radixd.core.kv_pool import KVPool
from radixd.core.kv_quant import kv_format
from radixd.core.model_loader import load_model, resolve_model
from radixd.core.models.config import ModelConfig


def decode_batch(pool: KVPool, cfg: ModelConfig, layout: str, batch: int, context: int, shared: int,
                 cascade_members: int) -> ForwardBatch:
    """``batch`` decodes at position ``context`` (their KV filled with random values)."""
    table = pool.req_to_token
    slot = 1
    prefix = torch.arange(slot, slot + shared)
    if layout == "shared":
        slot += shared
    for b in range(batch):
        if layout == "shared":
            own = torch.arange(slot, slot + context - shared + 1)
            table[b, :context + 1] = torch.cat((prefix, own))
        else:
            own = torch.arange(slot, slot + context + 1)
            table[b, :context + 1] = own
        slot += own.numel()
    gen = torch.Generator().manual_seed(0)
    for k, v in zip(pool.k_buffers, pool.v_buffers, strict=True):
        k.copy_(torch.randn(k.shape, generator=gen).to(k.dtype))
        v.copy_(torch.randn(v.shape, generator=gen).to(v.dtype))
    rows = list(range(batch))
    fb = ForwardBatch(input_ids=torch.randint(0, cfg.vocab_size, (batch,), generator=gen),
                      positions=torch.full((batch,), context, dtype=torch.int64),
                      out_cache_loc=table[torch.arange(batch), context].clone(), rows=rows,
                      prefix_lens=[context] * batch, extend_lens=[1] * batch, sample_indices=rows)
    if cascade_members:
        fb.shared = plan([chain(table[b], context) for b in rows], rows, cascade_members)
    return fb


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layout", choices=("shared", "random"), default="shared")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=560)
    ap.add_argument("--shared", type=int, default=512)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--backend", default="torch")
    ap.add_argument("--kv-cache-dtype", default="auto", help="the pool's (kv_cache_dtype; e.g. float16 under float32)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--gather", action="store_true", help="decode attention by gathering each request's KV")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch threads (default: torch's); radixd's kernels' as an engine's (RADIXD_CPU_KERNEL_THREADS)")
    ap.add_argument("--gguf-weights", choices=("fp32", "native"), default="fp32",
                    help="the GGUF converted (fp32) or served as shipped (native)")
    ap.add_argument("--ab", type=int, default=0, metavar="N",
                    help="also time the step under each --variant, alternated N times")
    ap.add_argument("--variant", action="append", metavar="ENV",
                    help='environment settings of one side of --ab ("K=V K2=V2"; "" as shipped); repeatable')
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cpu_kernels.set_threads(cpu_setup.kernel_threads())  # (as an engine on the CPU does)
    dtype = pick_dtype(args.dtype, torch.device("cpu"))
    path = resolve_model("default", progress=False, gguf_weights=args.gguf_weights)
    cfg = ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
    step = make_step(args, path, cfg)
    for _ in range(3):
        step()
    wall, cpu = [], []
    for _ in range(args.steps):
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step()
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events)
    top = [{"op": e.key, "calls": e.count, "self_cpu_ms": e.self_cpu_time_total / 1e3,
            "share": e.self_cpu_time_total / total} for e in events[: args.top]]
    result = {"args": {k: str(v) for k, v in vars(args).items()}, "dtype": str(dtype),
              "threads": torch.get_num_threads(), "kernel_threads": cpu_setup.kernel_threads(),
              "step_ms": 1e3 * statistics.median(wall), "step_cpu_ms": 1e3 * statistics.median(cpu), "profiled_self_cpu_ms": total / 1e3, "profile": top}
    if args.ab:
        variants = args.variant or ["", f"{cpu_kernels.ENV}=off"]
        result["ab"] = ab(args, path, cfg, variants, args.ab)
        for v, r in result["ab"].items():
            print(f"  {v or '(as shipped)':<40} min {r['min_ms']:7.2f} ms  median {r['median_ms']:7.2f} ms  "
                  f"x{r['median_vs_first']:.2f} of the first's median")
    print(f"{args.layout} batch {args.batch} {dtype} KV {args.kv_cache_dtype} {args.backend}{' gather' * args.gather}: step {result['step_ms']:.1f} ms wall, "
          f"{result['step_cpu_ms']:.1f} ms cpu ({torch.get_num_threads()} torch threads, "
          f"{result['kernel_threads']} for radixd's kernels)")
    for t in top:
        print(f"  {t['op']:<40} {t['calls']:>6} {t['self_cpu_ms']:9.2f} ms {100 * t['share']:5.1f}%")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")


def make_step(args, path: Path, cfg: ModelConfig):
    """A model, pool and decode batch as ``args`` say; returns the step (one forward)."""
    device = torch.device("cpu")
    dtype = pick_dtype(args.dtype, device)
    model = load_model(path, cfg, dtype, device)
    slots = args.batch * (args.context + 1) + args.shared + 2
    pool = KVPool(num_layers=cfg.num_layers, num_slots=slots, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                  max_rows=args.batch, max_context_len=args.context + 1, dtype=dtype, device=device,
                  kv_format=kv_format(args.kv_cache_dtype, dtype, cfg.num_layers))
    attn = make_backend(args.backend, pool, num_heads=cfg.num_heads, head_dim=cfg.head_dim,
                        scale=cfg.attention_scale, cascade=True)
    fb = decode_batch(pool, cfg, args.layout, args.batch, args.context, args.shared, attn.cascade_members)
    idx = fb.logits_indices()

    @torch.inference_mode()
    def step() -> None:
        attn.begin(fb)
        if args.gather:
            attn.decode_runs = attn.decode_lens = None
            attn.decode_all = False
        model(fb.input_ids, fb.positions, attn, idx)

    return step


@contextlib.contextmanager
def environment(variant: str):
    """``variant``'s settings ("K=V K2=V2") in os.environ (radixd's probes forgotten before and
    after, so that they read them)."""
    pairs = dict(kv.split("=", 1) for kv in variant.split())
    saved = {k: os.environ.get(k) for k in pairs}
    os.environ.update(pairs)
    cpu_kernels.reset()
    cpu_kernels.set_threads(cpu_setup.kernel_threads())
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        cpu_kernels.reset()
        cpu_kernels.set_threads(cpu_setup.kernel_threads())


def ab(args, path: Path, cfg: ModelConfig, variants: list[str], rounds: int) -> dict:
    """The step under each variant, alternated ``rounds`` times (module docstring)."""
    steps = {}
    for v in variants:
        with environment(v):
            steps[v] = make_step(args, path, cfg)
            steps[v]()
    times: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(rounds):
        for v in variants:
            with environment(v):
                steps[v]()
                for _ in range(4):
                    t0 = time.perf_counter()
                    steps[v]()
                    times[v].append(1e3 * (time.perf_counter() - t0))
    first = statistics.median(times[variants[0]])
    return {v: {"min_ms": min(t), "median_ms": statistics.median(t), "median_vs_first": statistics.median(t) / first,
                "steps_ms": t} for v, t in times.items()}


if __name__ == "__main__":
    main()
