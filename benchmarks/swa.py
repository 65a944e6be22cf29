"""Sliding-window KV on a CUDA GPU: Gemma-3-12B's text shape with random bf16 weights (48
layers, 40 of them with a 1024-token window; no downloads) decoding at 8k context, with the
window layers' KV in its own region freed behind the windows (``swa_pool``) against the same
model keeping every layer's KV for every token (``swa_full_tokens_ratio = 0``: what a model
without windows stores).

    python -m benchmarks.swa --out DIR [--batches 1,16] [--context 8192] [--quick]

For each batch size and both pools: prompts of ``context - new`` tokens, ``new`` greedy tokens
each; the KV bytes of the pool's buffers, the most KV bytes held during the run (slots not
free, each region at its own bytes per token: what requests and the radix cache hold) and
the least held by the running requests alone (cached KV that may be evicted left out), and
decode tokens/s (from the last request's first token to the last token). Writes
DIR/swa.json.

``--quick``: a tiny Gemma-3 shape on the CPU (float32, the torch attention backend, a window
of 8 at a 64-token context): the script's logic, not a figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
from pathlib import Path

from benchmarks.common import CPU_ENGINE, CUDA_ENGINE, environment, free, generate_all, write_json
from radixd import Engine
from radixd.core.kv_manager import FREE_EVERY
from radixd.core.kv_pool import kv_bytes_per_token

# Gemma-3-12B's text config (google/gemma-3-12b-pt, text_config)
GEMMA3_12B = dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", hidden_size=3840,
                  num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=8, head_dim=256,
                  intermediate_size=15360, vocab_size=262208, max_position_embeddings=131072,
                  query_pre_attn_scalar=256, sliding_window=1024, sliding_window_pattern=6,
                  rope_theta=1000000.0, rope_local_base_freq=10000.0,
                  rope_scaling={"rope_type": "linear", "factor": 8.0}, hidden_activation="gelu_pytorch_tanh",
                  rms_norm_eps=1e-6, tie_word_embeddings=True, eos_token_id=1)
QUICK = {**GEMMA3_12B, "hidden_size": 64, "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 16, "intermediate_size": 128, "vocab_size": 512, "max_position_embeddings": 4096,
         "query_pre_attn_scalar": 16, "sliding_window": 8}


class Run:
    def __init__(self, args):
        self.quick = args.quick
        self.shape = QUICK if args.quick else GEMMA3_12B
        self.out = Path(args.out)
        self.path = self.out / "checkpoint"
        write_json(self.path / "config.json", self.shape)
        self.context = 64 if args.quick else args.context
        self.new = 20 if args.quick else args.new
        self.batches = [2] if args.quick else [int(b) for b in args.batches.split(",")]
        self.chunk = 16 if args.quick else 2048
        self.window = self.shape["sliding_window"]

    def engine(self, batch: int, ratio: float) -> Engine:
        kw = dict(kv_cache_tokens=self.tokens(batch), max_running_requests=max(batch, 2), chunked_prefill_size=self.chunk,
                  max_prefill_tokens=self.chunk, swa_full_tokens_ratio=ratio, schedule_conservativeness=0.0)
        base = CPU_ENGINE if self.quick else {**CUDA_ENGINE, "cuda_graphs": True}
        return Engine(model=str(self.path), tokenizer="none", load_format="dummy", **{**base, **kw})

    def tokens(self, batch: int) -> int:
        """Pool slots: every request's tokens and a few prefill chunks."""
        return batch * (self.context + self.new) + 4 * self.chunk

    def window_ratio(self, batch: int) -> float:
        """The window region: each request's window, a batch of freeing (``FREE_EVERY``) and
        its new token, and two prefill chunks; the cache's window KV is evicted when short."""
        need = batch * (self.window + FREE_EVERY + 2) + 2 * self.chunk
        return min(1.0, need / self.tokens(batch))


def pool_bytes(eng: Engine) -> dict:
    """The pool's buffers, and bytes per slot of each region."""
    pool = eng.worker.pool
    cfg = eng.model_cfg
    elem = pool.k_buffers[0].element_size()
    per = lambda layers: kv_bytes_per_token(layers, cfg.num_kv_heads, cfg.head_dim, pool.dtype)  # noqa: E731
    window_layers = sum(1 for w in cfg.layer_windows if w) if pool.window_slots else 0
    buffers = sum(2 * b.numel() * elem for b in pool.k_buffers)
    return {"buffers": buffers, "slot": per(cfg.num_layers - window_layers), "window_slot": per(window_layers)}


def held_bytes(acc: dict, sizes: dict, *, cached: bool) -> int:
    """KV bytes held: slots not free (``cached``), or held by running requests only."""
    def region(prefix: str) -> int:
        if cached:
            return acc[prefix + "total"] - acc[prefix + "free"]
        return acc[prefix + "locked"] + acc[prefix + "private"]

    out = region("") * sizes["slot"]
    if "window_total" in acc:
        out += region("window_") * sizes["window_slot"]
    return out


def case(run: Run, batch: int, windows: bool) -> dict:
    ratio = run.window_ratio(batch) if windows else 0.0
    eng = run.engine(batch, ratio)
    sizes = pool_bytes(eng)
    held = {"max": 0, "max_running": 0, "window_freed": 0}
    last_free = [None]

    def hook(step):
        acc = eng.scheduler.accounting()
        held["max"] = max(held["max"], held_bytes(acc, sizes, cached=True))
        held["max_running"] = max(held["max_running"], held_bytes(acc, sizes, cached=False))
        if "window_free" in acc:
            if last_free[0] is not None and acc["window_free"] > last_free[0]:
                held["window_freed"] += acc["window_free"] - last_free[0]
            last_free[0] = acc["window_free"]
        if run.quick:
            eng.check_accounting()

    rng = random.Random(batch)
    vocab = min(40000, run.shape["vocab_size"])
    loop = asyncio.new_event_loop()
    try:
        warm = [[rng.randrange(100, vocab) for _ in range(run.chunk)] for _ in range(2)]
        loop.run_until_complete(generate_all(eng, warm, 4))
        eng.flush_cache()
        eng.step_hook = hook
        prompts = [[rng.randrange(100, vocab) for _ in range(run.context - run.new)] for _ in range(batch)]
        r = loop.run_until_complete(generate_all(eng, prompts, run.new))
    finally:
        loop.run_until_complete(eng.stop())
        loop.close()
    out = {"batch": batch, "windows_freed": windows, "swa_full_tokens_ratio": round(ratio, 4),
           "pool_buffers_bytes": sizes["buffers"], "held_max_bytes": held["max"],
           "held_by_running_max_bytes": held["max_running"], "window_slots_freed": held["window_freed"],
           "decode_tok_s": round(batch * (run.new - 1) / (r["end"] - r["all_first"]), 1)}
    print(json.dumps(out), flush=True)
    eng = None
    free()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--quick", action="store_true", help="a tiny shape on the CPU: the script's logic, not a figure")
    args = ap.parse_args(argv)
    run = Run(args)
    cases = [case(run, b, w) for b in run.batches for w in (True, False)]
    for b in run.batches:
        hybrid, whole = (c for c in cases if c["batch"] == b)
        for key in ("pool_buffers_bytes", "held_max_bytes", "held_by_running_max_bytes"):
            hybrid[key.replace("_bytes", "_vs_whole")] = round(hybrid[key] / whole[key], 4)
        hybrid["tok_s_vs_whole"] = round(hybrid["decode_tok_s"] / whole["decode_tok_s"], 3)
    doc = {"environment": environment(), "shape": run.shape, "context": run.context, "new_tokens": run.new,
           "cases": cases}
    write_json(run.out / "swa.json", doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
