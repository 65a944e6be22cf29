"""Quantized weights at Llama-3-8B's shape on a CUDA GPU: random bf16 weights quantized in-process
(``load_format="dummy"`` of a config-only checkpoint that declares the scheme: each projection
quantized round-to-nearest by ``radixd.core.quant.ops``' helpers), the bf16 figures in the same
call.

    python -m benchmarks.quant --json PATH [--quick]

Schemes: ``bf16``; ``fp8-channel`` (compressed-tensors FP8_DYNAMIC: per-channel weight scales,
per-token activations); ``fp8-block`` (128 x 128 blocks, DeepSeek / Qwen3-FP8); ``int4-g128``
(GPTQ layout, symmetric, groups of 128). For each, through the engine with CUDA graphs:

* decode tok/s at batch 1 and 64 (512-token prompts, 128 new tokens), each against its roofline:
  the bytes a step reads (every parameter but the embedding table: quantized weights, their
  scales and zeros, norms, lm_head; and the KV of the batch) over the copy bandwidth measured
  in this call, and the fraction of it reached;
* prefill tok/s of 8 x 2048-token prompts;
* the speed-ups over bf16.

``--quick``: a tiny shape on the CPU (float32, the torch attention backend): the script's
logic, not a figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
from pathlib import Path

from benchmarks.common import (
    CPU_ENGINE,
    CUDA_ENGINE,
    LLAMA,
    SHAPES,
    environment,
    free,
    generate_all,
    timed_section,
    write_json,
)
from benchmarks.moe import ceilings
from radixd import Engine
from radixd.core.kv_pool import kv_bytes_per_token

FP8_DYNAMIC = {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": {
    "targets": ["Linear"],
    "weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel", "dynamic": False},
    "input_activations": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token", "dynamic": True}}},
    "ignore": ["lm_head"]}
SCHEMES = {
    "bf16": None,
    "fp8-channel": FP8_DYNAMIC,
    "fp8-block": {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128]},
    "int4-g128": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True},
}
TINY = dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=512, vocab_size=512, max_position_embeddings=4096, rope_theta=10000.0,
            tie_word_embeddings=False)


class Run:
    """One call's shape, device, checkpoints and the measured copy bandwidth."""

    def __init__(self, args):
        self.tiny = args.quick
        self.pdl = args.pdl
        self.shape = TINY if self.tiny else SHAPES["llama3-8b"]
        self.out = Path(args.json).with_suffix("")
        self.paths = {}
        for name, qc in SCHEMES.items():
            cfg = {**self.shape, **LLAMA, **({"quantization_config": qc} if qc else {})}
            self.paths[name] = write_json(self.out / name / "config.json", cfg).parent
        self.copy_Bps = 1e10 if self.tiny else None  # (a placeholder on the CPU: the logic runs)
        self.matmul_flops = None
        self.batches = [1, 2] if self.tiny else [1, 64]
        self.prompt, self.new = (16, 6) if self.tiny else (512, 128)
        self.prefill = (2, 64) if self.tiny else (8, 2048)

    def engine(self, scheme: str, **kw) -> Engine:
        if self.pdl:
            kw["pdl"] = True
        if self.tiny:
            kw = {"kv_cache_tokens": 4096, "max_running_requests": 16, **kw, **CPU_ENGINE}
        else:
            kw = {**CUDA_ENGINE, "kv_cache_tokens": 70_000, **kw}
        return Engine(model=str(self.paths[scheme]), tokenizer="none", load_format="dummy", **kw)

    def prompts(self, rng: random.Random, n: int, length: int) -> list[list[int]]:
        hi = min(40000, self.shape["vocab_size"])
        return [[rng.randrange(100, hi) for _ in range(length)] for _ in range(n)]


def step_weight_bytes(eng: Engine) -> int:
    """Bytes of parameters a decode step reads: all but the embedding table (a row per token)."""
    return sum(p.numel() * p.element_size() for name, p in eng.worker.model.named_parameters()
               if name != "embed_tokens.weight")


def scheme_figures(run: Run, scheme: str) -> dict:
    rng = random.Random(1)
    eng = run.engine(scheme)
    cfg = eng.model_cfg
    weights = step_weight_bytes(eng)
    kv_tok = kv_bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, eng.worker.model.norm.weight.dtype)
    out = {"weights_read_per_step_GB": round(weights / 1e9, 3), "decode": []}
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(generate_all(eng, run.prompts(rng, 4, 64), 4))  # warm-up
        for bs in run.batches:
            r = loop.run_until_complete(generate_all(eng, run.prompts(rng, bs, run.prompt), run.new))
            tok_s = bs * (run.new - 1) / (r["end"] - r["all_first"])
            step = weights + bs * (run.prompt + run.new // 2) * kv_tok
            roof = bs * run.copy_Bps / step
            case = {"batch": bs, "decode_tok_s": round(tok_s, 1), "roofline_tok_s": round(roof, 1),
                    "roofline_fraction": round(tok_s / roof, 3), "step_GB": round(step / 1e9, 3)}
            out["decode"].append(case)
            print(json.dumps({"scheme": scheme, **case}), flush=True)
        n, length = run.prefill
        eng.flush_cache()
        loop.run_until_complete(generate_all(eng, run.prompts(rng, n, length), 1))  # warm-up at this shape
        eng.flush_cache()
        r = loop.run_until_complete(generate_all(eng, run.prompts(rng, n, length), 1))
        out["prefill"] = {"prompts": n, "prompt_tokens": length, "tok_s": round(n * length / (r["end"] - r["t0"]), 1)}
        print(json.dumps({"scheme": scheme, "prefill": out["prefill"]}), flush=True)
    finally:
        loop.run_until_complete(eng.stop())
        loop.close()
        eng = None
        free()
    return out


def speedups(results: dict) -> dict:
    """Each scheme's decode (per batch) and prefill tok/s over bf16's."""
    base = results.get("bf16")
    if not isinstance(base, dict) or "decode" not in base:
        return {}
    out = {}
    for name, res in results.items():
        if name == "bf16" or not isinstance(res, dict) or "decode" not in res:
            continue
        out[name] = {f"decode_b{c['batch']}": round(c["decode_tok_s"] / b["decode_tok_s"], 3)
                     for c, b in zip(res["decode"], base["decode"], strict=True)}
        out[name]["prefill"] = round(res["prefill"]["tok_s"] / base["prefill"]["tok_s"], 3)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", required=True, help="where the results go (a JSON file)")
    ap.add_argument("--schemes", default=",".join(SCHEMES))
    ap.add_argument("--quick", action="store_true", help="a tiny shape on the CPU: the script's logic, not a figure")
    ap.add_argument("--pdl", action="store_true", help="every engine with programmatic dependent launch (pdl=True)")
    args = ap.parse_args(argv)
    if args.pdl and args.quick:
        ap.error("--pdl needs a GPU of compute capability 9.0+ (not --quick)")
    run = Run(args)
    doc: dict = {"environment": environment(), "shape": run.shape, "pdl": args.pdl, "ceilings": ceilings(run),
                 "schemes": {}}
    for name in args.schemes.split(","):
        doc["schemes"][name] = timed_section(lambda name=name: scheme_figures(run, name))
        write_json(args.json, doc)  # what is done so far survives a run stopped early
    doc["speedup_over_bf16"] = speedups(doc["schemes"])
    print(json.dumps(doc["speedup_over_bf16"]), flush=True)
    write_json(args.json, doc)
    return 1 if any("error" in v for v in doc["schemes"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
