"""Mixture-of-experts serving on a CUDA GPU: Qwen3-30B-A3B's shape with random bf16 weights
(48 layers, 128 experts, 8 per token; no downloads), timed in one run.

    python -m benchmarks.moe --out DIR [--sections ...] [--peer PATH/TO/hf_baseline.py] [--tiny]

Sections (each writes DIR/<section>.json and a line to stdout; a failing section is reported
and the run goes on):
  ceilings  copy bandwidth (bytes read + written) and the bf16 matmul rate, measured now
  kernel    one MoE layer (x [T, 2048] through 128 experts, top 8) at T = 1, 16, 64, 512, 4096:
            the fused Triton kernels (eager and in a CUDA graph) against a per-expert loop
            of cuBLAS GEMMs on the same routing (``moe_ops.experts_torch``); bytes of the
            distinct experts the routing touches over the time, as a fraction of the copy
            bandwidth
  gemv_tiles  the few-token GEMV kernels' tiles swept at 1 token (``experts_gemv``)
  profile   one batch-1 decode step with the one-row fusions off and on (fresh engines; use
            ``--layers`` for a shorter model): graph step time and the eager step's kernels
  decode    output tokens/s at batch 1, 16 and 64 (512-token prompts, 128 new tokens), each
            against its roofline: the bytes a step reads (attention weights, norms, routers,
            lm_head, the experts the batch touches: 8 per layer at batch 1, at batch B the
            expected distinct experts of B uniform top-8 draws, E(1 - (1 - k/E)^B); and the
            KV) over the copy bandwidth
  prefill   8 x 2048-token prompts: tokens/s and the fraction of the matmul rate (2 x the
            active parameters per token, plus causal attention)
  peer      the transformers generate() peer (``--peer``: hf_baseline.py --model
            qwen3-30b-a3b, batches 1 and 16, 512-token prompts, 32 new tokens), a separate
            process in the same run

``--quant fp8-block``: the decode and prefill sections on the layout of Qwen3-30B-A3B-FP8 (every
projection, experts included, in fp8 with 128 x 128 block scales; router and LM head bf16),
quantized in-process from the random weights; ``fp8-channel`` the same with per-row scales.

``--tiny``: a tiny Qwen3-MoE shape on the CPU (float32, the torch attention backend; the
fused kernel only where the Triton interpreter is on): the script's logic, not a figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import torch
from triton.runtime.errors import OutOfResources

from benchmarks.common import (
    CPU_ENGINE,
    CUDA_ENGINE,
    cuda_median_s,
    environment,
    free,
    generate_all,
    time_graph,
    timed_section,
    write_json,
)
from radixd import Engine
from radixd.core.kv_pool import kv_bytes_per_token
from radixd.core.moe_ops import (
    GEMV_MAX_TOKENS,
    PAIRS_UNSORTED,
    MoETiles,
    experts_gemv,
    experts_torch,
    experts_triton,
    moe_tiles,
)

# Qwen3-30B-A3B's config.json (the peer script builds the same shape)
QWEN3_30B_A3B = dict(architectures=["Qwen3MoeForCausalLM"], hidden_size=2048, num_hidden_layers=48,
                     num_attention_heads=32, num_key_value_heads=4, head_dim=128, intermediate_size=6144,
                     moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                     decoder_sparse_step=1, mlp_only_layers=[], vocab_size=151936, max_position_embeddings=40960,
                     rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False, eos_token_id=0)
TINY = {**QWEN3_30B_A3B, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128, "moe_intermediate_size": 32,
        "num_experts": 8, "num_experts_per_tok": 2, "vocab_size": 512, "max_position_embeddings": 4096}


FP8_CONFIGS = {
    "fp8-block": {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128]},
    "fp8-channel": {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
                    "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                        "num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel", "dynamic": False},
                        "input_activations": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token",
                                              "dynamic": True}}}},
}


class Run:
    """One run's shape, device and measured ceilings."""

    def __init__(self, args):
        self.tiny = args.tiny
        self.shape = TINY if args.tiny else QWEN3_30B_A3B
        self.device = "cpu" if args.tiny else "cuda"
        self.out = Path(args.out)
        self.path = self.out / "checkpoint"
        if args.layers:
            self.shape = {**self.shape, "num_hidden_layers": args.layers}
        quant = FP8_CONFIGS[args.quant] if args.quant else None
        write_json(self.path / "config.json", {**self.shape, **({"quantization_config": quant} if quant else {})})
        self.copy_Bps = 1e10 if args.tiny else None  # (placeholders on the CPU: the logic runs)
        self.matmul_flops = 1e11 if args.tiny else None
        self.batches = [1, 2] if args.tiny else [1, 16, 64]
        self.prompt, self.new = (16, 6) if args.tiny else (512, 128)
        self.args = args

    def engine(self, **kw) -> Engine:
        if self.tiny:
            kw = {"kv_cache_tokens": 4096, "max_running_requests": 16, **kw, **CPU_ENGINE}
        else:
            kw = {**CUDA_ENGINE, "kv_cache_tokens": 120_000, **kw}
        return Engine(model=str(self.path), tokenizer="none", load_format="dummy", **kw)

    def vocab_hi(self) -> int:
        return min(40000, self.shape["vocab_size"])

    def experts(self, seed: int) -> tuple[torch.dtype, torch.Generator, torch.Tensor, torch.Tensor]:
        """One layer's random experts in the run's shape: (dtype, the generator after them,
        gate_up [E, 2I, H], down [E, H, I])."""
        sh = self.shape
        e, h, i = sh["num_experts"], sh["hidden_size"], sh["moe_intermediate_size"]
        dtype = torch.float32 if self.tiny else torch.bfloat16
        g = torch.Generator(device=self.device).manual_seed(seed)
        gate_up = (torch.randn(e, 2 * i, h, device=self.device, generator=g) * h**-0.5).to(dtype)
        down = (torch.randn(e, h, i, device=self.device, generator=g) * i**-0.5).to(dtype)
        return dtype, g, gate_up, down


def expert_bytes(hidden: int, inter: int, dtype_bytes: int) -> int:
    """One expert's gate, up and down projections."""
    return 3 * hidden * inter * dtype_bytes


def distinct_experts(experts: int, top_k: int, batch: int) -> float:
    """Expected distinct experts ``batch`` tokens touch per layer under uniform top-k routing."""
    return experts * (1 - (1 - top_k / experts) ** batch)


# ----------------------------------------------------------------------------- sections


def ceilings(run: Run) -> dict:
    if run.tiny:
        return {"skipped": "--tiny: placeholders"}
    x = torch.randn(1024**3 // 2, device="cuda", dtype=torch.bfloat16)  # 1 GiB
    y = torch.empty_like(x)
    t = cuda_median_s(lambda: y.copy_(x), reps=20)
    run.copy_Bps = 2 * x.numel() * x.element_size() / t
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    run.matmul_flops = 2 * n**3 / cuda_median_s(lambda: a @ b, reps=10)
    return {"copy_TBps": round(run.copy_Bps / 1e12, 3), "bf16_matmul_TFLOPs": round(run.matmul_flops / 1e12, 1),
            "gpu": torch.cuda.get_device_name(), "torch": torch.__version__}


def _time(run: Run, fn, graph: bool = False) -> float:
    if run.tiny:
        fn()
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t
    return time_graph(fn, reps=50) if graph else cuda_median_s(fn, reps=20)


def kernel(run: Run) -> dict:
    sh = run.shape
    e, k, h, i = sh["num_experts"], sh["num_experts_per_tok"], sh["hidden_size"], sh["moe_intermediate_size"]
    dtype, g, gate_up, down = run.experts(0)
    fused_here = not run.tiny or os.environ.get("TRITON_INTERPRET") == "1"
    cases = []
    for t in ([1, 3, 40] if run.tiny else [1, 16, 64, 512, 4096]):
        x = torch.randn(t, h, device=run.device, generator=g).to(dtype)
        weights, ids = torch.randn(t, e, device=run.device, generator=g).softmax(-1).topk(k, dim=-1)
        touched = int(torch.unique(ids).numel())
        moved = touched * expert_bytes(h, i, x.element_size()) + 2 * t * k * (h + i) * x.element_size()
        case = {"tokens": t, "distinct_experts": touched}
        loop_s = _time(run, lambda x=x, w=weights, ids=ids: experts_torch(x, gate_up, down, w, ids))
        case["per_expert_loop_us"] = round(loop_s * 1e6, 1)
        if fused_here:
            ref = experts_torch(x, gate_up, down, weights, ids).float()
            got = experts_triton(x, gate_up, down, weights, ids).float()
            case["rel_err_vs_loop"] = round(float((got - ref).norm() / ref.norm()), 5)
            fused_s = _time(run, lambda x=x, w=weights, ids=ids: experts_triton(x, gate_up, down, w, ids))
            graph_s = fused_s if run.tiny else _time(run, lambda x=x, w=weights, ids=ids: experts_triton(
                x, gate_up, down, w, ids), graph=True)
            case.update(fused_us=round(fused_s * 1e6, 1), fused_graph_us=round(graph_s * 1e6, 1),
                        loop_over_fused=round(loop_s / graph_s, 2),
                        fused_graph_copy_fraction=round(moved / graph_s / run.copy_Bps, 3),
                        fused_graph_TFLOPs=round(6 * t * k * h * i / graph_s / 1e12, 2))
            if t <= GEMV_MAX_TOKENS:  # (the GEMV kernels' way against the tl.dot kernels', routing included)
                case.update(_few_tokens(run, x, gate_up, down, weights, ids, moved))
        cases.append(case)
        print(json.dumps(case), flush=True)
    return {"layer": dict(experts=e, top_k=k, hidden=h, inter=i), "cases": cases}


def _few_tokens(run: Run, x, gate_up, down, weights, ids, moved: int) -> dict:
    """A few tokens' MoE layer (CUDA graph time): the tl.dot kernels (``gemv=False``) and the
    GEMV kernels on the same routing; and the whole block after the router's GEMV as decode
    runs it, ``route``'s softmax and top-k kernels then the tl.dot kernels, against the GEMV
    kernels routing from the logits themselves."""
    from radixd.core.models.moe import route

    k = ids.shape[1]
    logits = torch.randn(x.shape[0], gate_up.shape[0], device=x.device).to(x.dtype)
    g = not run.tiny
    dot = _time(run, lambda: experts_triton(x, gate_up, down, weights, ids, gemv=False), graph=g)
    gemv = _time(run, lambda: experts_gemv(x, gate_up, down, weights=weights, ids=ids), graph=g)
    old = _time(run, lambda: experts_triton(x, gate_up, down, *route(logits, k, True), gemv=False), graph=g)
    new = _time(run, lambda: experts_gemv(x, gate_up, down, logits=logits, top_k=k, renormalize=True), graph=g)
    return {"dot_graph_us": round(dot * 1e6, 1), "gemv_graph_us": round(gemv * 1e6, 1),
            "dot_graph_copy_fraction": round(moved / dot / run.copy_Bps, 3),
            "gemv_graph_copy_fraction": round(moved / gemv / run.copy_Bps, 3),
            "route_then_dot_graph_us": round(old * 1e6, 1), "routed_gemv_graph_us": round(new * 1e6, 1)}


# (rows, K step, warps, prefetch): ``moe_ops.GemvTiles``
GEMV_UP = [(4, 256, 8), (4, 256, 8, 1), (4, 256, 16, 1), (4, 128, 16, 1), (8, 256, 16, 1), (4, 512, 16, 1),
           (2, 256, 16, 1), (4, 128, 8, 1), (8, 128, 16, 1), (4, 256, 32, 1)]
GEMV_DOWN = [(8, 128, 8), (8, 256, 8, 1), (4, 256, 8, 1), (8, 256, 16, 1), (16, 256, 16, 1), (8, 256, 4, 1),
             (4, 256, 4, 1), (2, 128, 4, 1), (16, 128, 16, 1)]
ROUTINGS = 4  # gemv_tiles: routings per timed graph (4 x 8 experts' 75 MB: no replay served from the L2)


def gemv_tiles(run: Run) -> dict:
    """The GEMV kernels' tiles at 1 token (CUDA graph time of ``ROUTINGS`` tokens routed
    apart): the gate/up kernel alone (routing from the logits in it) over ``GEMV_UP``, the
    down kernel alone over ``GEMV_DOWN``, each against its experts' bytes as a fraction of the
    copy bandwidth, with its output's error against the default tiles'; the best gate/up
    tiles again with the routing given (what routing in the kernel costs); and the two
    kernels together, the defaults against the best of each."""
    from radixd.core import moe_ops

    sh = run.shape
    e, k, h, i = sh["num_experts"], sh["num_experts_per_tok"], sh["hidden_size"], sh["moe_intermediate_size"]
    if run.tiny and os.environ.get("TRITON_INTERPRET") != "1":
        return {"skipped": "--tiny without the Triton interpreter"}
    dtype, g, gate_up, down = run.experts(3)
    xs = [torch.randn(1, h, device=run.device, generator=g).to(dtype) for _ in range(ROUTINGS)]
    logits = [torch.randn(1, e, device=run.device, generator=g).to(dtype) for _ in range(ROUTINGS)]
    esize = xs[0].element_size()
    routed = [moe_ops.gemv_gate_up(x, gate_up, logits=lg, top_k=k, renormalize=True) for x, lg in zip(xs, logits, strict=True)]

    def timed(calls) -> float:
        try:
            return _time(run, lambda: [c() for c in calls], graph=not run.tiny) / ROUTINGS
        except OutOfResources:
            return float("inf")

    def rel(a, b) -> float:
        return round(float((a.double() - b.double()).norm() / b.double().norm()), 5)

    up_ref = routed[0][0]
    down_ref = moe_ops.gemv_down(routed[0][0], down, *routed[0][1:], k)
    ups = GEMV_UP[:2] if run.tiny else GEMV_UP
    downs = GEMV_DOWN[:2] if run.tiny else GEMV_DOWN
    up_bytes, down_bytes = 2 * k * h * i * esize, k * h * i * esize
    up_sweep, down_sweep = {}, {}
    for c in ups:
        try:
            err = rel(moe_ops.gemv_gate_up(xs[0], gate_up, logits=logits[0], top_k=k, renormalize=True, tiles=c)[0],
                      up_ref)
        except OutOfResources:
            continue
        s = timed([lambda x=x, lg=lg, c=c: moe_ops.gemv_gate_up(x, gate_up, logits=lg, top_k=k, renormalize=True,
                                                                 tiles=c) for x, lg in zip(xs, logits, strict=True)])
        up_sweep[c] = s
        print(json.dumps({"up": c, "us": round(s * 1e6, 2), "copy_fraction": round(up_bytes / s / run.copy_Bps, 3),
                          "rel_err": err}), flush=True)
    for c in downs:
        try:
            err = rel(moe_ops.gemv_down(routed[0][0], down, *routed[0][1:], k, tiles=c), down_ref)
        except OutOfResources:
            continue
        s = timed([lambda r=r, c=c: moe_ops.gemv_down(r[0], down, *r[1:], k, tiles=c) for r in routed])
        down_sweep[c] = s
        print(json.dumps({"down": c, "us": round(s * 1e6, 2), "copy_fraction": round(down_bytes / s / run.copy_Bps, 3),
                          "rel_err": err}), flush=True)
    best_up = min(up_sweep, key=up_sweep.get)
    best_down = min(down_sweep, key=down_sweep.get)
    given = timed([lambda x=x, r=r: moe_ops.gemv_gate_up(x, gate_up, weights=r[2].view(1, k), ids=r[1].view(1, k),
                                                          tiles=best_up) for x, r in zip(xs, routed, strict=True)])

    def both(up, dn) -> float:
        return timed([lambda x=x, lg=lg: experts_gemv(x, gate_up, down, logits=lg, top_k=k, renormalize=True,
                                                      up_tiles=up, down_tiles=dn) for x, lg in zip(xs, logits, strict=True)])

    default = (moe_ops.GEMV_UP_TILES, moe_ops.GEMV_DOWN_TILES)
    default_s, best_s = both(*default), both(best_up, best_down)
    adopted = None
    if run.args.adopt_tiles and best_s < 0.97 * default_s:  # (the sections after use them)
        moe_ops.GEMV_UP_TILES, moe_ops.GEMV_DOWN_TILES = adopted = moe_ops.GemvTiles(*best_up), moe_ops.GemvTiles(*best_down)
    return {"adopted": adopted and [list(c) for c in adopted], "default": [list(c) for c in default],
            "default_us": round(default_s * 1e6, 1),
            "default_copy_fraction": round((up_bytes + down_bytes) / default_s / run.copy_Bps, 3),
            "best": [list(best_up), list(best_down)], "best_us": round(best_s * 1e6, 1),
            "best_copy_fraction": round((up_bytes + down_bytes) / best_s / run.copy_Bps, 3),
            "best_up_routing_given_us": round(given * 1e6, 2), "best_up_routed_us": round(up_sweep[best_up] * 1e6, 2),
            "up_sweep_us": {str(c): round(t * 1e6, 2) for c, t in up_sweep.items()},
            "down_sweep_us": {str(c): round(t * 1e6, 2) for c, t in down_sweep.items()}}


def profile(run: Run) -> dict:
    """One batch-1 decode step, with the one-row fusions off (the kernels before
    ``experts_gemv`` and the q/k norms in the rotary kernel) and on, each on a fresh engine of
    ``--layers`` layers: the captured step's device time (graph replay, 576 tokens of
    context), and one eager step under ``torch.profiler``: device time and launches per
    kernel, per layer. The bytes the step must read, over the copy bandwidth, for scale."""
    out = {"layers": run.shape["num_hidden_layers"]}
    loop = asyncio.new_event_loop()
    rng = random.Random(4)
    try:
        for fuse in (False, True):
            free()  # (what earlier sections left cached: two engines of 61 GB fit only just)
            eng = None
            try:
                eng = run.engine(fuse_one_row=fuse)
                loop.run_until_complete(generate_all(eng, [[rng.randrange(100, run.vocab_hi()) for _ in range(64)]], 8))
                case = {"fuse_one_row": fuse}
                if not run.tiny:
                    cfg = eng.model_cfg
                    fixed, per_expert = _weight_bytes(eng)
                    kv_tok = kv_bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16)
                    step_bytes = fixed + (cfg.num_layers - len(cfg.moe.dense_layers)) * cfg.moe.top_k * per_expert \
                        + 576 * kv_tok
                    t = _graph_step_s(eng)
                    case.update(graph_step_ms=round(t * 1e3, 3), step_bytes_GB=round(step_bytes / 1e9, 3),
                                roofline_ms=round(step_bytes / run.copy_Bps * 1e3, 3),
                                fraction=round(step_bytes / run.copy_Bps / t, 3))
                    case["kernels"] = _step_kernels(eng, run.shape["num_hidden_layers"])
                out["fused" if fuse else "unfused"] = case
                print(json.dumps(case)[:3000], flush=True)
            finally:
                if eng is not None:
                    loop.run_until_complete(eng.stop())
                eng = None
                free()
    finally:
        loop.close()
    return out


def _graph_step_s(eng) -> float:
    """The batch-1 decode graph's replay time (a function of its own: no reference to the
    engine's graphs outlives it, so the engine can be freed)."""
    from benchmarks.decode_profile import bucket_state

    with bucket_state(eng, 1) as g:
        return cuda_median_s(g.graphs[1][0].replay, reps=50)


def _step_kernels(eng, layers: int) -> dict:
    """One eager batch-1 decode forward under the profiler: per kernel name, device µs and
    launches in all, and per layer."""
    from benchmarks.decode_profile import device_kernels

    rows = [{"name": name[:90], "us": round(us, 1), "count": n, "us_per_call": round(us / max(n, 1), 2)}
            for name, us, n in device_kernels(eng, 1)]
    rows.sort(key=lambda r: -r["us"])
    total = sum(r["us"] for r in rows)
    return {"kernel_us_total": round(total, 1), "launches": sum(r["count"] for r in rows),
            "launches_per_layer": round(sum(r["count"] for r in rows) / layers, 2), "by_kernel": rows}


GEMM_TILES = [(bn, bk, 4, st) for bn in (16, 32, 64, 128) for bk in (64, 128, 256) for st in (3, 4) if bn * bk <= 16384]


def tiles(run: Run) -> dict:
    """The fused kernels' tiles swept per token count (CUDA graph time): the gate/up GEMM's
    over ``GEMM_TILES`` with the default down tiles, then the down GEMM's with the best
    gate/up tiles, for each BLOCK_M that suits the count; the best against the default."""
    sh = run.shape
    e, k, h = sh["num_experts"], sh["num_experts_per_tok"], sh["hidden_size"]
    if run.tiny and os.environ.get("TRITON_INTERPRET") != "1":
        return {"skipped": "--tiny without the Triton interpreter"}
    dtype, g, gate_up, down = run.experts(1)
    grid = GEMM_TILES[:1] if run.tiny else GEMM_TILES
    out = []
    for t in ([1, 40] if run.tiny else [1, 16, 64, 512]):
        x = torch.randn(t, h, device=run.device, generator=g).to(dtype)
        weights, ids = torch.randn(t, e, device=run.device, generator=g).softmax(-1).topk(k, dim=-1)

        def timed(choice: MoETiles, x=x, weights=weights, ids=ids) -> float:
            try:
                return _time(run, lambda: experts_triton(x, gate_up, down, weights, ids, tiles=choice),
                             graph=not run.tiny)
            except OutOfResources:  # (tiles whose pipeline stages exceed the shared memory)
                return float("inf")

        default = moe_tiles(t * k)
        default_s = timed(default)
        best = (default_s, default)
        for bm in ([16] if t * k <= PAIRS_UNSORTED else [16, 64]):
            base = MoETiles(bm, default.gate_up, default.down)
            up = min((timed(base._replace(gate_up=c)), c) for c in grid)[1]
            best = min(best, *((timed(base._replace(gate_up=up, down=c)), base._replace(gate_up=up, down=c))
                               for c in grid))
        case = {"tokens": t, "default": list(default), "default_us": round(default_s * 1e6, 1),
                "best": [best[1].block_m, list(best[1].gate_up), list(best[1].down)], "best_us": round(best[0] * 1e6, 1)}
        out.append(case)
        print(json.dumps(case), flush=True)
    return {"cases": out}


def _weight_bytes(eng: Engine) -> tuple[int, int]:
    """(bytes of the weights every decode step reads whatever the routing: all but the
    experts and the embedding table, of which it reads a row per token; one expert's bytes)."""
    model = eng.worker.model
    fixed = sum(p.numel() * p.element_size() for name, p in model.named_parameters()
                if ".experts." not in name and name != "embed_tokens.weight")
    experts = next(m for name, m in model.named_modules() if name.endswith(".experts"))  # (fp8: with its scales)
    return fixed, sum(p.numel() * p.element_size() for p in experts.parameters()) // eng.model_cfg.moe.num_experts


def decode(run: Run) -> dict:
    """The decode figures; with ``--baseline`` first batch 1 on an engine with the one-row
    fusions off (the kernels before ``experts_gemv`` and the fused q/k norms), same call;
    with ``--pdl`` then batch 1 and 16 on an engine with programmatic dependent launch."""
    out = {}
    if run.args.baseline:
        out["baseline_fuse_one_row_off"] = _decode_cases(run, [1], fuse_one_row=False)
    out = {**_decode_cases(run, run.batches), **out}
    if run.args.pdl:
        out["pdl_on"] = _decode_cases(run, run.batches[:2], pdl=True)
    return out


def _decode_cases(run: Run, batches: list[int], **kw) -> dict:
    free()
    eng = run.engine(**kw)
    cfg = eng.model_cfg
    fixed, per_expert = _weight_bytes(eng)
    moe_layers = cfg.num_layers - len(cfg.moe.dense_layers)
    kv_tok = kv_bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, eng.worker.model.embed_tokens.weight.dtype)
    rng = random.Random(1)
    out = {"fixed_weights_read_per_step_GB": round(fixed / 1e9, 3), "expert_MB": round(per_expert / 1e6, 3),
           "kv_bytes_per_token": kv_tok, "cases": []}
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(generate_all(eng, [[rng.randrange(100, run.vocab_hi()) for _ in range(64)]
                                                    for _ in range(4)], 4))
        for bs in batches:
            prompts = [[rng.randrange(100, run.vocab_hi()) for _ in range(run.prompt)] for _ in range(bs)]
            r = loop.run_until_complete(generate_all(eng, prompts, run.new))
            tok_s = bs * (run.new - 1) / (r["end"] - r["all_first"])
            experts = distinct_experts(cfg.moe.num_experts, cfg.moe.top_k, bs)
            step = fixed + moe_layers * experts * per_expert + bs * (run.prompt + run.new // 2) * kv_tok
            roof = bs * run.copy_Bps / step
            case = {"batch": bs, "decode_tok_s": round(tok_s, 1), "roofline_tok_s": round(roof, 1),
                    "roofline_fraction": round(tok_s / roof, 3), "experts_per_layer": round(experts, 2),
                    "step_GB": round(step / 1e9, 3)}
            out["cases"].append(case)
            print(json.dumps(case), flush=True)
    finally:
        loop.run_until_complete(eng.stop())
        loop.close()
        eng = None
        free()
    return out


def prefill(run: Run) -> dict:
    n, length = (2, 64) if run.tiny else (8, 2048)
    eng = run.engine(max_prefill_tokens=16384, chunked_prefill_size=16384)
    cfg = eng.model_cfg
    fixed, per_expert = _weight_bytes(eng)
    rng = random.Random(2)
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(generate_all(eng, [[rng.randrange(100, run.vocab_hi()) for _ in range(length)]
                                                    for _ in range(n)], 1))
        eng.flush_cache()
        r = loop.run_until_complete(generate_all(eng, [[rng.randrange(100, run.vocab_hi()) for _ in range(length)]
                                                        for _ in range(n)], 1))
    finally:
        loop.run_until_complete(eng.stop())
        loop.close()
        eng = None
        free()
    t = r["end"] - r["t0"]
    tokens = n * length
    moe_layers = cfg.num_layers - len(cfg.moe.dense_layers)
    active_params = (fixed + moe_layers * cfg.moe.top_k * per_expert) / 2
    attn = n * 2 * 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * length * length / 2
    flops = 2 * active_params * tokens + attn
    return {"prompts": n, "prompt_tokens": length, "seconds": round(t, 4), "tok_s": round(tokens / t, 1),
            "matmul_fraction": round(flops / t / run.matmul_flops, 3)}


def peer(run: Run) -> dict:
    script = run.args.peer
    if not script or not Path(script).exists():
        return {"skipped": "no --peer script"}
    dest = run.out / "peer_plain.json"
    cmd = [sys.executable, script, "--model", "qwen3-30b-a3b", "--batches", "1,16", "--prompt", "512", "--out", "32",
           "--json", str(dest)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=run.args.peer_timeout)
    if p.returncode != 0:
        return {"error": p.stderr[-2000:]}
    return {"cases": json.loads(dest.read_text())}


SECTIONS = {"ceilings": ceilings, "kernel": kernel, "tiles": tiles, "gemv_tiles": gemv_tiles, "profile": profile,
            "decode": decode, "prefill": prefill, "peer": peer}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--sections", default="ceilings,kernel,tiles,decode,prefill,peer")
    ap.add_argument("--peer", default=None, help="path to the transformers peer script (hf_baseline.py)")
    ap.add_argument("--peer-timeout", type=int, default=900)
    ap.add_argument("--tiny", action="store_true", help="a tiny shape on the CPU: the script's logic, not a figure")
    ap.add_argument("--layers", type=int, default=0, help="this many layers instead of the shape's (profile)")
    ap.add_argument("--baseline", action="store_true",
                    help="decode: batch 1 also with the one-row fusions off (fuse_one_row=False), same call")
    ap.add_argument("--pdl", action="store_true",
                    help="decode: batch 1 and 16 also with programmatic dependent launch (pdl=True), same call")
    ap.add_argument("--adopt-tiles", action="store_true",
                    help="gemv_tiles: the sections after it run with its best tiles where 3%% faster than the defaults")
    ap.add_argument("--quant", default="", choices=["", *FP8_CONFIGS],
                    help="decode and prefill on fp8 weights, experts included (Qwen3-30B-A3B-FP8's layout)")
    args = ap.parse_args(argv)
    if args.pdl and args.tiny:
        ap.error("--pdl needs a GPU of compute capability 9.0+ (not --tiny)")
    run = Run(args)
    summary: dict = {"environment": environment(), "shape": run.shape, "quant": args.quant or None}
    for name in args.sections.split(","):
        if name != "ceilings" and run.copy_Bps is None:
            summary["ceilings"] = ceilings(run)
        res = timed_section(lambda name=name: SECTIONS[name](run))
        summary[name] = res
        if name == "gemv_tiles":
            from radixd.core import moe_ops
            summary["gemv_tiles_after"] = [list(moe_ops.GEMV_UP_TILES), list(moe_ops.GEMV_DOWN_TILES)]
        write_json(run.out / f"{name}.json", res)
        print(f"== {name}: {json.dumps(res)[:1500]}", flush=True)
    # (a section's error is in its result; the exit status says whether any failed)
    write_json(run.out / "summary.json", summary)
    return 1 if any(isinstance(v, dict) and "error" in v for v in summary.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
