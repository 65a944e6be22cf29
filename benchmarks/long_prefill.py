"""One long prompt's prefill on a CUDA GPU, timed and taken apart by phase (8B shape, random
weights): what limits a 32k-token TTFT.

    python -m benchmarks.long_prefill --out OUT [--tokens 32768] [--chunk 8192] [--budget 16384]
                                      [--dense-prefill on|off]

The engine is set as ``gpu_long.sh``'s (``chunked_prefill_size`` 8192, ``max_prefill_tokens``
16384). After a warm-up prompt, ``--prompts`` prompts of ``--tokens`` random tokens run one at a
time (one output token each): TTFT, and its FLOPs (the projections' 2 x parameters per token,
the causal attention's 4 x heads x head dim x keys per query) over the bf16 matmul rate measured
in the same run. One more prompt runs under ``torch.profiler``: device time per phase
(matrix products, attention, the rest) with each phase's FLOP rate, so the figure's shortfall
is placed. Writes OUT/long_prefill.json and prints ``==`` lines."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys

from benchmarks import gpu_bench
from benchmarks.common import SHAPES, checkpoint_dir, environment, write_json

GEMM_NAMES = ("gemm", "gemv", "cutlass", "sm90", "nvjet", "cublas", "_linear")
ATTN_NAMES = ("extend", "flash", "fmha", "cudnn", "attention", "sdpa")


def phase(kernel: str) -> str:
    name = kernel.lower()
    if any(s in name for s in ATTN_NAMES):  # first: cuDNN's attention kernels carry "sm90" too
        return "attention"
    if any(s in name for s in GEMM_NAMES):
        return "matmul"
    return "other"


def flops(cfg: dict, params: int, tokens: int) -> tuple[float, float]:
    """(projections, attention) FLOPs of one ``tokens``-long prompt's prefill."""
    hd = cfg["hidden_size"] // cfg["num_attention_heads"]
    attn = 4 * cfg["num_hidden_layers"] * cfg["num_attention_heads"] * hd * tokens * (tokens + 1) / 2
    return 2 * params * tokens, attn


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--budget", type=int, default=16384)
    ap.add_argument("--dense-prefill", default="on", choices=("on", "off"),
                    help="the engine option (default on): chunks in cuDNN's kernels")
    args = ap.parse_args()
    from radixd.core.attention import dense_prefill

    dense_prefill.enable_buckets()  # (before the first cuDNN attention: torch reads it then)
    ctx: dict = {}
    res = {"env": environment(), "ceilings": gpu_bench.ceilings(args, ctx),
           "engine": {"chunked_prefill_size": args.chunk, "max_prefill_tokens": args.budget,
                      "dense_prefill": args.dense_prefill == "on"}}
    cfg = {**SHAPES["llama3-8b"], "max_position_embeddings": max(131072, args.tokens + 16)}
    eng = gpu_bench.engine(checkpoint_dir(cfg, prefix="radixd-long-"), chunked_prefill_size=args.chunk,
                           max_prefill_tokens=args.budget, kv_cache_tokens=4 * args.tokens, max_running_requests=8,
                           dense_prefill=args.dense_prefill == "on")
    model = eng.worker.model
    # the projections' parameters (the embedding table is read a row per token, the LM head
    # computes the last token's logits only)
    params = gpu_bench.read_bytes(eng) // 2 - model.lm_head.weight.numel()
    proj, attn = flops(cfg, params, args.tokens)
    rng = random.Random(5)
    loop = asyncio.new_event_loop()

    def prompt() -> list[int]:
        return [rng.randrange(100, gpu_bench.VOCAB_HI) for _ in range(args.tokens)]

    def one() -> float:
        r = loop.run_until_complete(gpu_bench._run_batch(eng, [prompt()], 1))
        return r["ttft"][0]

    try:
        one()  # warm-up: kernels compiled, the pool touched
        ttft = [one() for _ in range(args.prompts)]
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            one()
    finally:
        loop.run_until_complete(eng.stop())
        loop.close()
    t = statistics.median(ttft)
    mm = ctx["matmul_flops"]
    res["ttft_s"] = [round(x, 4) for x in ttft]
    res["ttft_median_s"] = round(t, 4)
    res["flops"] = {"projections_T": round(proj / 1e12, 1), "attention_T": round(attn / 1e12, 1)}
    res["matmul_fraction"] = round((proj + attn) / t / mm, 3)
    phases: dict[str, float] = {}
    for ev in prof.key_averages():
        if str(getattr(ev, "device_type", "")).split(".")[-1] != "CUDA":
            continue
        us = getattr(ev, "self_device_time_total", None)
        us = ev.self_cuda_time_total if us is None else us
        phases[phase(ev.key)] = phases.get(phase(ev.key), 0.0) + us / 1e6
    kernels = sorted(((ev.key[:80], (getattr(ev, "self_device_time_total", 0) or 0) / 1e3) for ev in prof.key_averages()
                      if str(getattr(ev, "device_type", "")).split(".")[-1] == "CUDA"), key=lambda r: -r[1])
    device = sum(phases.values())
    res["profile"] = {
        "device_s": round(device, 4),
        "phases": {k: {"s": round(v, 4), "share": round(v / device, 3)} for k, v in sorted(phases.items())},
        "matmul_rate_fraction": round(proj / phases.get("matmul", float("inf")) / mm, 3),
        "attention_rate_fraction": round(attn / phases.get("attention", float("inf")) / mm, 3),
        "attention_TFLOPs": round(attn / phases.get("attention", float("inf")) / 1e12, 1),
        "top_kernels_ms": [[k, round(ms, 2)] for k, ms in kernels[:12]],
        # what the TTFT would be with attention at the matmul phase's own rate
        "ttft_if_attention_at_matmul_rate_s": round(t - phases.get("attention", 0.0)
                                                    + attn * phases.get("matmul", 0.0) / max(proj, 1.0), 4),
    }
    write_json(f"{args.out}/long_prefill.json", res)
    print(f"== long_prefill: TTFT {t:.3f} s, {res['matmul_fraction']} of the matmul rate "
          f"({res['ceilings']['bf16_matmul_TFLOPs']} TFLOP/s)", flush=True)
    print(f"== long_prefill profile: {json.dumps(res['profile'])}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
