"""The most cache-aware routing can gain over round robin on a shared-prefix burst, from the
hardware's limits alone (no implementation overheads).

Two replicas of a dense model, each with a KV pool that holds every prefix (so round robin
loses nothing to eviction). For one replica's share of the burst it adds, at the device's
matmul rate and copy bandwidth:

- prefill: the share's uncached prompt tokens (cache-aware: half the system prompts once, each
  request's question; round robin: every system prompt once, each request's question), at
  2 x parameters + attention FLOPs per token;
- decode, linear layers: each step the longer of reading the weights and computing the
  batch's rows (the same under both routers);
- decode, attention: each step reads every distinct prefix in the batch once (cascade
  decoding) plus each request's own tokens.

The ratio of the two totals is what a perfect implementation would show; a real one adds
costs both routers pay (submission, kernel launches, tails), which pull the ratio down.

    python3 -m benchmarks.dp_bound [--copy-tbps 4.09 --matmul-tflops 757 --max-running 256]
"""

from __future__ import annotations

import argparse
import json
from math import comb

# Llama-3-8B
LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB = 32, 4096, 32, 8, 128, 14336, 128256
LAYER_PARAMS = HIDDEN * (HEADS + 2 * KV_HEADS) * HEAD_DIM + HEADS * HEAD_DIM * HIDDEN + 3 * HIDDEN * INTER
LINEAR_PARAMS = LAYERS * LAYER_PARAMS + VOCAB * HIDDEN   # what a decode step reads (not the embedding)
KV_BYTES = LAYERS * 2 * KV_HEADS * HEAD_DIM * 2         # K and V of one token, all layers, bf16


def attn_flops(ctx: float) -> float:
    """Attention FLOPs of one query token over ``ctx`` keys, all layers (QK^T and PV)."""
    return LAYERS * 4 * ctx * HEADS * HEAD_DIM


def distinct(groups: int, per_group: int, batch: int) -> float:
    """Expected distinct groups among ``batch`` requests drawn from ``groups`` x ``per_group``."""
    n = groups * per_group
    batch = min(batch, n)
    return groups * (1 - comb(n - per_group, batch) / comb(n, batch))


def replica_seconds(groups: int, per_group: int, system: int, question: int, new: int, *, max_running: int,
                    copy: float, flops: float) -> dict:
    """One replica's ideal seconds for ``groups`` system prompts x ``per_group`` requests."""
    n = groups * per_group
    prefill = (groups * system * (2 * LAYERS * LAYER_PARAMS + attn_flops(system / 2))
               + n * question * (2 * LAYERS * LAYER_PARAMS + attn_flops(system + question / 2))
               + n * 2 * VOCAB * HIDDEN) / flops
    linear = attention = 0.0
    for start in range(0, n, max_running):
        batch = min(max_running, n - start)
        step_linear = max(2 * LINEAR_PARAMS / copy, batch * 2 * LINEAR_PARAMS / flops)
        prefixes = distinct(groups, per_group, batch) * system * KV_BYTES
        for t in range(new):
            linear += step_linear
            attention += (prefixes + batch * (question + t) * KV_BYTES) / copy
    return {"prefill_s": round(prefill, 3), "decode_linear_s": round(linear, 3),
            "decode_attention_s": round(attention, 3), "total_s": round(prefill + linear + attention, 3)}


def add_workload_args(ap: argparse.ArgumentParser) -> None:
    """The shared-prefix burst (``radixd bench``'s defaults) and the running requests per replica."""
    ap.add_argument("--groups", type=int, default=64)
    ap.add_argument("--per-group", type=int, default=16)
    ap.add_argument("--system", type=int, default=2048)
    ap.add_argument("--question", type=int, default=128)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--max-running", type=int, default=256)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(ap)
    ap.add_argument("--copy-tbps", type=float, default=4.09, help="device copy bandwidth, TB/s")
    ap.add_argument("--matmul-tflops", type=float, default=757.0, help="bf16 matmul rate, TFLOP/s")
    a = ap.parse_args()
    kw = dict(max_running=a.max_running, copy=a.copy_tbps * 1e12, flops=a.matmul_tflops * 1e12)
    # cache-aware: each replica serves half the groups whole; round robin: every group, half of each
    ca = replica_seconds(a.groups // 2, a.per_group, a.system, a.question, a.new, **kw)
    rr = replica_seconds(a.groups, a.per_group // 2, a.system, a.question, a.new, **kw)
    out = {"args": vars(a), "cache_aware": ca, "round_robin": rr,
           "cache_aware_over_round_robin": round(rr["total_s"] / ca["total_s"], 3)}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
