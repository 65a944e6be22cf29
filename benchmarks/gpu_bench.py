"""radixd on a CUDA GPU, checked and timed in one run (random weights in real model shapes).

    python3 -m benchmarks.gpu_bench --out DIR [--model llama3-8b|smollm2-135m] [--sections ...]
                               [--peer PATH/TO/hf_baseline.py]

Sections (each writes DIR/<section>.json and a line to stdout; a failing section is reported
and the run goes on):
  ceilings   copy bandwidth (bytes read + written) and the bf16 matmul rate, measured now
  correct    triton backend (+CUDA graphs) vs the torch backend: logits along greedy decoding
  decode     output tokens/s at batch 1/16/64/256 (512-token prompts, 128 new tokens or
             --decode-new), and each as a fraction of its roofline (weights + KV bytes per
             step / copy bandwidth);
             GPU idle share between decode steps at batch 64 (CUDA events around each step)
  fusions    batch-1 decode with the one-row fusions (the GEMV epilogues: SiLU*up, rotary +
             KV store) on and off
  rows       decode at batch 16 and 64 with the few-row GEMM kernel on and off (cuBLAS)
  pdl        decode at batch 1 and 64 with programmatic dependent launch on and off
  merge      decode at batch 1 with decode attention's split merge in its first kernel on and
             off (PDL off, then on)
  prefill    8 x 2048-token prompts: tokens/s and the fraction of the measured matmul rate
  shared     shared-prefix workload in-process: radix on/off x fcfs/lpm
  kernels    decode attention bandwidth vs copy bandwidth; extend attention vs torch SDPA
  peer       the transformers generate() peer (a separate process) on the same shapes
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchmarks.common import (
    CPU_ENGINE,
    CUDA_ENGINE,
    SHAPES,
    checkpoint_dir,
    cuda_median_s,
    environment,
    free,
    timed_section,
    write_json,
)
from radixd import Engine, SamplingParams
from radixd.core.forward_batch import ForwardBatch
from radixd.core.kv_pool import kv_bytes_per_token


def model_dir(model: str) -> str:
    return checkpoint_dir(SHAPES[model], prefix=f"radixd-{model}-")


DEVICE = {"name": "cuda"}
VOCAB_HI = 40000  # random prompt token ids below every shape's vocabulary


def engine(path: str, **kw) -> Engine:
    if DEVICE["name"] == "cpu":  # a smoke run of the script's logic
        kw = {"kv_cache_tokens": 40_000, "max_running_requests": 64, **kw, **CPU_ENGINE}
    else:
        kw = {**CUDA_ENGINE, "kv_cache_tokens": 300_000, **kw}
    return Engine(model=path, tokenizer="none", load_format="dummy", **kw)


def param_bytes(eng: Engine) -> int:
    return sum(p.numel() * p.element_size() for p in eng.worker.model.parameters())


def read_bytes(eng: Engine) -> int:
    """Weight bytes one decode step reads: all but the embedding table, of which it reads a
    row per token (unless the table is tied to the lm_head, which reads all of it)."""
    model = eng.worker.model
    n = param_bytes(eng)
    if not model.cfg.tie_word_embeddings:
        n -= model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
    return n


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


# ----------------------------------------------------------------------------- sections


def ceilings(args, ctx) -> dict:
    x = torch.randn(1024**3 // 2, device="cuda", dtype=torch.bfloat16)  # 1 GiB
    y = torch.empty_like(x)
    t = cuda_median_s(lambda: y.copy_(x), reps=20)
    bw = 2 * x.numel() * x.element_size() / t
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    tm = cuda_median_s(lambda: a @ b, reps=10)
    ctx["copy_Bps"] = bw
    ctx["matmul_flops"] = 2 * n**3 / tm
    return {"copy_TBps": round(bw / 1e12, 3), "bf16_matmul_TFLOPs": round(2 * n**3 / tm / 1e12, 1),
            "gpu": torch.cuda.get_device_name(), "torch": torch.__version__}


def _manual_logits(eng: Engine, prompt: list[int], steps: int, tokens: list[int] | None) -> tuple[list[torch.Tensor], list[int]]:
    """Prefill ``prompt`` then decode ``steps`` tokens through the worker directly; feeds
    ``tokens`` (teacher forcing) when given, else its own argmax. Returns per-step logits."""
    w = eng.worker
    row = 0
    slots = eng.allocator.alloc(len(prompt) + steps)
    b = ForwardBatch(input_ids=torch.tensor(prompt), positions=torch.arange(len(prompt)),
                     out_cache_loc=slots[: len(prompt)], rows=[row], prefix_lens=[0], extend_lens=[len(prompt)],
                     table_writes=[(row, 0, slots[: len(prompt)])], sample_indices=[0])
    out = [w.forward(b)[0].float().clone()]  # a graph's output buffer is reused by the next replay
    _sync()  # forward() stages inputs in two alternating pinned arenas
    chosen = []
    for i in range(steps):
        tok = tokens[i] if tokens is not None else int(out[-1].argmax())
        chosen.append(tok)
        pos = len(prompt) + i
        b = ForwardBatch(input_ids=torch.tensor([tok]), positions=torch.tensor([pos]), out_cache_loc=slots[pos : pos + 1],
                         rows=[row], prefix_lens=[pos], extend_lens=[1], table_writes=[(row, pos, slots[pos : pos + 1])],
                         sample_indices=[0])
        out.append(w.forward(b)[0].float().clone())
        _sync()
    eng.allocator.free(slots)
    return out, chosen


def correct(args, ctx) -> dict:
    out = {dtype: _correct(ctx["path"], dtype) for dtype in ("bfloat16", "float32")}
    out["ok"] = all(v["ok"] for v in out.values())
    return out


def _correct(path: str, dtype: str) -> dict:
    """Triton backend (+CUDA graphs) against the torch backend, teacher-forced on the fast
    path's greedy tokens. float32 isolates the kernels from bf16 rounding (Triton's fp32 dot
    uses TF32, so ~1e-3 is expected there)."""
    fast = engine(path, kv_cache_tokens=8192, max_running_requests=8, dtype=dtype)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, VOCAB_HI) for _ in range(n)] for n in (7, 300, 1500)]
    runs = [_manual_logits(fast, p, 24, None) for p in prompts]
    fast = None
    free()
    ref = engine(path, kv_cache_tokens=8192, max_running_requests=8, attention_backend="torch", cuda_graphs=False,
                 dtype=dtype)
    res = []
    for p, (logits, chosen) in zip(prompts, runs, strict=True):
        ref_logits, _ = _manual_logits(ref, p, 24, chosen)  # teacher-forced on the fast path's tokens
        rel = [float((a - b).norm() / b.norm()) for a, b in zip(logits, ref_logits, strict=True)]
        agree = margin_ok = 0
        for a, b in zip(logits, ref_logits, strict=True):
            top2 = b.topk(2).values
            if int(a.argmax()) == int(b.argmax()):
                agree += 1
            elif float(top2[0] - top2[1]) < 0.05 * float(b.abs().max()):
                margin_ok += 1  # a near-tie in bf16: either token is a correct pick
        res.append({"prompt": len(p), "steps": len(logits), "max_rel_err": round(max(rel), 5),
                    "argmax_equal": agree, "near_ties": margin_ok})
    ref = None
    free()
    tol = 1e-1 if dtype == "bfloat16" else 1e-2
    ok = all(r["max_rel_err"] < tol and r["argmax_equal"] + r["near_ties"] == r["steps"] for r in res)
    return {"ok": ok, "tolerance": tol, "cases": res}


async def _run_batch(eng: Engine, prompts: list[list[int]], new: int) -> dict:
    t0 = time.perf_counter()
    firsts, ends = [], []

    cpu_last_first = 0.0  # the loop thread's CPU seconds when the last request got its first token

    async def one(p):
        nonlocal cpu_last_first
        first = None
        async for out in eng.generate(input_ids=p, params=SamplingParams(max_new_tokens=new, temperature=0, ignore_eos=True)):
            if first is None and out.token_ids:
                first = time.perf_counter()
                cpu_last_first = time.thread_time()
        firsts.append(first)
        ends.append(time.perf_counter())

    await asyncio.gather(*(one(p) for p in prompts))
    return {"t0": t0, "all_first": max(firsts), "end": max(ends), "ttft": [f - t0 for f in firsts],
            "loop_cpu_decode_s": time.thread_time() - cpu_last_first}


def decode(args, ctx) -> dict:
    eng = engine(ctx["path"])
    ctx["param_bytes"] = param_bytes(eng)
    ctx["read_bytes"] = read_bytes(eng)
    per_tok = pool_kv_bytes_per_token(eng)
    rng = random.Random(1)
    out = {"weights_GB": round(ctx["param_bytes"] / 1e9, 3), "weights_read_per_step_GB": round(ctx["read_bytes"] / 1e9, 3),
           "kv_bytes_per_token": per_tok, "cases": []}
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(_run_batch(eng, [[rng.randrange(100, VOCAB_HI) for _ in range(64)] for _ in range(4)], 8))
        for bs in args.batches:
            prompts = [[rng.randrange(100, VOCAB_HI) for _ in range(512)] for _ in range(bs)]
            gpu_times: list[float] = []
            host_times: list[float] = []  # each launch's host seconds
            if bs == 64:
                _instrument(eng, gpu_times, host_times)
            r = loop.run_until_complete(_run_batch(eng, prompts, args.decode_new))
            if bs == 64:
                _uninstrument(eng, gpu_times)
            dec_t = r["end"] - r["all_first"]
            dec_tok_s = bs * (args.decode_new - 1) / dec_t
            avg_ctx = 512 + args.decode_new // 2
            step_bytes = ctx["read_bytes"] + bs * avg_ctx * per_tok
            roof = bs / (step_bytes / ctx["copy_Bps"])
            case = {"batch": bs, "decode_tok_s": round(dec_tok_s, 1), "roofline_tok_s": round(roof, 1),
                    "roofline_fraction": round(dec_tok_s / roof, 3),
                    "e2e_out_tok_s": round(bs * args.decode_new / (r["end"] - r["t0"]), 1),
                    "ttft_p50_s": round(statistics.median(r["ttft"]), 3)}
            if gpu_times:
                case["gpu_busy_s"] = round(sum(gpu_times), 4)
                case["decode_wall_s"] = round(dec_t, 4)
                decode_steps = gpu_times[-(args.decode_new - 1):]
                case["gpu_idle_fraction_decode"] = round(1 - sum(decode_steps) / dec_t, 3)
                # the host's side of those steps: the worker thread's time inside each launch
                # (staging, replay; the GIL held) and the event loop thread's CPU per step
                host = sorted(host_times[-(args.decode_new - 1):])
                case["launch_host_ms_p50"] = round(host[len(host) // 2] * 1e3, 3)
                case["launch_host_ms_p90"] = round(host[int(len(host) * 0.9)] * 1e3, 3)
                case["device_step_ms_p50"] = round(sorted(decode_steps)[len(decode_steps) // 2] * 1e3, 3)
                case["loop_cpu_ms_per_step"] = round(r["loop_cpu_decode_s"] / (args.decode_new - 1) * 1e3, 3)
            out["cases"].append(case)
            print(json.dumps(case), flush=True)
    finally:
        loop.run_until_complete(eng.stop())
        loop.close()
        eng = None
        free()
    return out


def fusions(args, ctx) -> dict:
    """Batch-1 decode tokens/s with the one-row fusions on and off, alternating, twice each
    (a fresh engine each: graphs are captured with the switch as it is), each the best of
    three 128-token runs."""
    return _switch_ab(ctx, "fuse_one_row", 1)


def rows(args, ctx) -> dict:
    """Decode tokens/s at batch 16 and 64 with the few-row GEMM kernel (``rows_linear``) on
    and off (cuBLAS), as ``fusions`` compares its switch."""
    return {f"batch_{bs}": _switch_ab(ctx, "rows_kernel", bs) for bs in (16, 64)}


def pdl(args, ctx) -> dict:
    """Decode tokens/s at batch 1 and 64 with programmatic dependent launch (the engine
    option ``pdl``) on and off, as ``fusions`` compares its switch."""
    return {f"batch_{bs}": _switch_ab(ctx, "pdl", bs) for bs in (1, 64)}


def merge(args, ctx) -> dict:
    """Batch-1 decode tokens/s with decode attention's splits merged in its first kernel (the
    engine option ``decode_merge_in_kernel``) on and off, as ``fusions`` compares its switch;
    with programmatic dependent launch off, then on (Hopper or later)."""
    out = {"pdl_off": _switch_ab(ctx, "decode_merge_in_kernel", 1)}
    if torch.cuda.get_device_capability()[0] >= 9:
        out["pdl_on"] = _switch_ab(ctx, "decode_merge_in_kernel", 1, pdl=True)
    return out


def _switch_ab(ctx, switch: str, batch: int, **base) -> dict:
    """Decode tokens/s (512-token prompts, 128 new tokens) at ``batch`` with the engine option
    ``switch`` on and off, alternating twice; each the best of three runs. ``base``: engine
    options both ways."""
    rng = random.Random(2)
    prompts = [[rng.randrange(100, VOCAB_HI) for _ in range(512)] for _ in range(batch)]
    out: dict = {"on": [], "off": []}
    loop = asyncio.new_event_loop()
    try:
        for on in (True, False, True, False):
            eng = engine(ctx["path"], max_running_requests=max(4, batch), kv_cache_tokens=max(16384, batch * 704),
                         **base, **{switch: on})
            try:
                ctx.setdefault("read_bytes", read_bytes(eng))
                ctx.setdefault("kv_per_tok", pool_kv_bytes_per_token(eng))
                best = 0.0
                for _ in range(3):
                    r = loop.run_until_complete(_run_batch(eng, prompts, 128))
                    best = max(best, batch * 127 / (r["end"] - r["all_first"]))
            finally:
                loop.run_until_complete(eng.stop())
                eng = None
                free()
            out["on" if on else "off"].append(round(best, 1))
        roof = batch / ((ctx["read_bytes"] + batch * 576 * ctx["kv_per_tok"]) / ctx["copy_Bps"])
        for k in ("on", "off"):
            out[f"{k}_roofline_fraction"] = round(max(out[k]) / roof, 3)
    finally:
        loop.close()
    return out


def pool_kv_bytes_per_token(eng: Engine) -> int:
    """KV bytes a token holds in the engine's pool (all layers, K and V)."""
    pool = eng.worker.pool
    k = pool.k_buffers[0]
    return kv_bytes_per_token(len(pool.k_buffers), k.shape[1], k.shape[2], k.dtype)


def _instrument(eng: Engine, sink: list, host: list[float]) -> None:
    """Bracket each launched step with CUDA events (no synchronisation, so overlap stays):
    the time between the pair is the device's time on that step; summed and compared with
    the wall time of the decode phase it gives the device's idle share."""
    w = eng.worker
    orig = w.launch

    def timed(batch, prev=None):
        if DEVICE["name"] == "cpu":
            t = time.perf_counter()
            res = orig(batch, prev)
            sink.append(time.perf_counter() - t)
            host.append(sink[-1])
            return res
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t = time.perf_counter()
        a.record()
        res = orig(batch, prev)
        b.record()
        host.append(time.perf_counter() - t)
        sink.append((a, b))
        return res

    w._orig_launch = orig
    w.launch = timed


def _uninstrument(eng: Engine, sink: list) -> None:
    eng.worker.launch = eng.worker._orig_launch
    if DEVICE["name"] != "cpu":
        _sync()
        sink[:] = [a.elapsed_time(b) / 1000 for a, b in sink]


def prefill(args, ctx) -> dict:
    eng = engine(ctx["path"], max_prefill_tokens=16384, chunked_prefill_size=16384)
    rng = random.Random(2)
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(_run_batch(eng, [[rng.randrange(100, VOCAB_HI) for _ in range(2048)] for _ in range(8)], 1))
        eng.flush_cache()
        prompts = [[rng.randrange(100, VOCAB_HI) for _ in range(2048)] for _ in range(8)]
        r = loop.run_until_complete(_run_batch(eng, prompts, 1))
    finally:
        loop.run_until_complete(eng.stop())
        loop.close()
    t = r["end"] - r["t0"]
    tokens = 8 * 2048
    n_params = ctx["param_bytes"] / 2
    cfg = SHAPES[args.model]
    hd = cfg["hidden_size"] // cfg["num_attention_heads"]
    attn = 8 * 2 * 2 * cfg["num_hidden_layers"] * cfg["num_attention_heads"] * hd * 2048 * 2048 / 2
    flops = 2 * n_params * tokens + attn
    eng = None
    free()
    return {"tokens": tokens, "seconds": round(t, 4), "tok_s": round(tokens / t, 1),
            "matmul_fraction": round(flops / t / ctx["matmul_flops"], 3)}


def shared(args, ctx) -> dict:
    G, P, S, Q, NEW = args.groups, args.per_group, args.system, args.question, args.new
    rng = random.Random(3)
    systems = [[rng.randrange(100, VOCAB_HI) for _ in range(S)] for _ in range(G)]
    prompts = [sysp + [rng.randrange(100, VOCAB_HI) for _ in range(Q)] for sysp in systems for _ in range(P)]
    rng.shuffle(prompts)
    res = {"workload": dict(groups=G, per_group=P, system=S, question=Q, new=NEW),
           "theoretical_hit_rate": round(G * (P - 1) * S / (G * P * (S + Q)), 4), "configs": []}
    for radix in (True, False):
        for policy in ("lpm", "fcfs"):
            eng = engine(ctx["path"], radix_cache=radix, policy=policy)
            loop = asyncio.new_event_loop()
            try:
                loop.run_until_complete(_run_batch(eng, [[5, 6, 7, 8]] * 2, 4))
                q0, h0 = eng.cache.queried_tokens, eng.cache.hit_tokens
                r = loop.run_until_complete(_run_batch(eng, prompts, NEW))
                q1, h1 = eng.cache.queried_tokens - q0, eng.cache.hit_tokens - h0
            finally:
                loop.run_until_complete(eng.stop())
                loop.close()
                eng = None
                free()
            t = r["end"] - r["t0"]
            ttft = sorted(r["ttft"])
            c = {"radix": radix, "policy": policy, "seconds": round(t, 3),
                 "out_tok_s": round(len(prompts) * NEW / t, 1),
                 "total_tok_s": round(len(prompts) * (S + Q + NEW) / t, 1),
                 "ttft_p50_s": round(ttft[len(ttft) // 2], 3), "ttft_p99_s": round(ttft[int(len(ttft) * 0.99) - 1], 3),
                 "hit_rate": round(h1 / q1, 4) if q1 else 0.0}
            res["configs"].append(c)
            print(json.dumps(c), flush=True)
    by = {(c["radix"], c["policy"]): c for c in res["configs"]}
    res["radix_on_over_off"] = {p: round(by[(True, p)]["out_tok_s"] / by[(False, p)]["out_tok_s"], 2) for p in ("lpm", "fcfs")}
    return res


def kernels(args, ctx) -> dict:
    import torch.nn.functional as F

    from radixd.core.attention.triton_kernels import decode_attention, extend_attention

    cfg = SHAPES[args.model]
    H, Hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    D = cfg["hidden_size"] // H
    res = {}
    B, L = 64, 4096
    slots = B * L + 1
    kb = torch.randn(slots, Hkv, D, device="cuda", dtype=torch.bfloat16)
    vb = torch.randn_like(kb)
    table = (torch.randperm(slots - 1, device="cuda") + 1).view(B, L)
    rows = torch.arange(B, device="cuda")
    lens = torch.full((B,), L, device="cuda")
    q = torch.randn(B, H, D, device="cuda", dtype=torch.bfloat16)
    for splits in (4, 8, 16, 32):
        t = cuda_median_s(lambda s=splits: decode_attention(q, kb, vb, table, rows, lens, D**-0.5, num_splits=s))
        kv_bytes = 2 * B * L * Hkv * D * 2 + table.numel() * 8
        res[f"decode_B{B}_L{L}_splits{splits}"] = {"ms": round(t * 1e3, 3), "TBps": round(kv_bytes / t / 1e12, 3),
                                                   "fraction_of_copy": round(kv_bytes / t / ctx["copy_Bps"], 3)}
    # extend: 8 x 2048 new tokens, no prefix, vs SDPA (flash) on contiguous tensors
    R, N = 8, 2048
    kb2 = torch.randn(R * N + 1, Hkv, D, device="cuda", dtype=torch.bfloat16)
    vb2 = torch.randn_like(kb2)
    table2 = (torch.arange(R * N, device="cuda") + 1).view(R, N)
    qx = torch.randn(R * N, H, D, device="cuda", dtype=torch.bfloat16)
    t_ext = cuda_median_s(lambda: extend_attention(qx, kb2, vb2, table2, torch.arange(R, device="cuda"),
                                                 torch.zeros(R, dtype=torch.int64, device="cuda"),
                                                 torch.full((R,), N, device="cuda"),
                                                 torch.arange(R, device="cuda") * N, N, D**-0.5))
    qs = qx.view(R, N, H, D).transpose(1, 2)
    ks = kb2[1:].view(R, N, Hkv, D).transpose(1, 2)
    vs = vb2[1:].view(R, N, Hkv, D).transpose(1, 2)
    t_sdpa = cuda_median_s(lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True))
    flops = R * 4 * H * D * N * N / 2
    res["extend_8x2048"] = {"ms": round(t_ext * 1e3, 3), "TFLOPs": round(flops / t_ext / 1e12, 1),
                            "sdpa_ms": round(t_sdpa * 1e3, 3), "sdpa_over_radixd": round(t_sdpa / t_ext, 3)}
    return res


def peer(args, ctx) -> dict:
    if not args.peer or not Path(args.peer).exists():
        return {"skipped": "no --peer script"}
    out = {}
    for flavour in args.peer_flavours:
        dest = Path(args.out) / f"peer_{flavour}.json"
        cmd = [sys.executable, args.peer, "--model", args.model, "--flavour", flavour, "--batches",
               ",".join(map(str, args.peer_batches)), "--prompt", "512", "--out", "128", "--json", str(dest)]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.peer_timeout)
        if p.returncode != 0:
            out[flavour] = {"error": p.stderr[-2000:]}
            continue
        out[flavour] = json.loads(dest.read_text())
    return out


SECTIONS = {"ceilings": ceilings, "correct": correct, "decode": decode, "fusions": fusions, "rows": rows, "pdl": pdl,
            "merge": merge,
            "prefill": prefill, "shared": shared, "kernels": kernels, "peer": peer}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="llama3-8b", choices=sorted(SHAPES))
    ap.add_argument("--sections", default="ceilings,correct,decode,prefill,kernels,shared,peer")
    ap.add_argument("--batches", default="1,16,64,256", help="decode: batch sizes (one may repeat: runs again)")
    ap.add_argument("--decode-new", type=int, default=128, help="decode: new tokens per request")
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--per-group", type=int, default=16)
    ap.add_argument("--system", type=int, default=1024)
    ap.add_argument("--question", type=int, default=64)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--peer", default=None, help="path to the transformers peer script (hf_baseline.py)")
    ap.add_argument("--peer-flavours", default="plain")
    ap.add_argument("--peer-batches", default="1,16,64")
    ap.add_argument("--peer-timeout", type=int, default=300)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a smoke run of the logic")
    args = ap.parse_args()
    DEVICE["name"] = args.device
    if args.device == "cuda":
        from radixd.core.attention import dense_prefill

        dense_prefill.enable_buckets()  # (before the first cuDNN attention: torch reads it then)
    args.batches = [int(b) for b in args.batches.split(",")]
    args.peer_batches = [int(b) for b in args.peer_batches.split(",")]
    args.peer_flavours = args.peer_flavours.split(",")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    ctx: dict = {"path": model_dir(args.model)}
    summary: dict = {"environment": environment()}
    if args.device == "cpu":  # no ceilings to measure: placeholders so the logic runs
        ctx.update(copy_Bps=1e10, matmul_flops=1e11)
    for name in args.sections.split(","):
        if name != "ceilings" and "copy_Bps" not in ctx:
            summary["ceilings"] = ceilings(args, ctx)
        res = timed_section(lambda name=name: SECTIONS[name](args, ctx))
        summary[name] = res
        write_json(Path(args.out, f"{name}.json"), res)
        print(f"== {name}: {json.dumps(res)[:1500]}", flush=True)
    write_json(Path(args.out, "summary.json"), summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
