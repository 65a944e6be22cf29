"""cuDNN attention with torch's bucketed plans (``TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1``, what
``dense_prefill`` runs on) against its exact-shape plans, on a CUDA GPU at the 8B shape (32
query heads, 8 KV heads, head dim 128, bf16). Two child processes, since torch reads the
variable once: ``plain`` (unset) and ``bucketed`` (set). Each times the first call of a shape
(a plan built, or not) and the warm call (device time behind a busy device), with q/k/v in
BSHD layout (bucketed where the variable is set) and BHSD (exact shapes either way); the
bucketed child also checks outputs and log-sum-exps against a float64 reference, and times
``DensePlans.warm_up`` for the engine's default limits and ``long_prefill``'s (start-up cost).
``--host``: a third child (bucketed) times what one call costs the host, its launches queued
behind a long sleep kernel (so that nothing waits for the device), and whether it waits for
the device: a fused call with a bucketed and an exact-shape plan, the extend kernel, the
rotary kernel.

    python3 -m benchmarks.cudnn_buckets --out OUT [--host]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

H, HKV, D = 32, 8, 128
# (name, batch, query length, key length, causal, log-sum-exp)
WARM = [("8x2048 causal", 8, 2048, 2048, True, False), ("8x2000 causal", 8, 2000, 2000, True, False),
        ("1x8192 causal lse", 1, 8192, 8192, True, True), ("8192 over 24576 lse", 1, 8192, 24576, False, True),
        ("1x512 causal", 1, 512, 512, True, False), ("1x300 causal", 1, 300, 300, True, False)]
# first calls in order: the bucketed child should build a plan for the first of each bucket only
FIRST = [(1, 512, 512, True, False), (1, 300, 300, True, False), (1, 400, 400, True, False), (1, 513, 513, True, False),
         (1, 777, 777, True, False), (1, 2048, 2048, True, False), (1, 1500, 1500, True, False),
         (2, 1500, 1500, True, False), (2, 1100, 1100, True, False), (1, 600, 9000, False, True),
         (1, 700, 12000, False, True), (1, 1000, 9000, False, True)]


def child(mode: str) -> dict:
    import torch

    from benchmarks.common import cuda_device_s
    from radixd.core.attention import dense_prefill

    if mode == "bucketed":
        dense_prefill.enable_buckets()
    g = torch.Generator(device="cuda").manual_seed(1)
    big_k = torch.randn(80000, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g)
    big_v = torch.randn(80000, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g)
    big_q = torch.randn(40000, H, D, device="cuda", dtype=torch.bfloat16, generator=g)

    def tensors(b, sq, skv, layout):
        q, k, v = big_q[:b * sq], big_k[:b * skv], big_v[:b * skv]
        q, k, v = dense_prefill.bshd(q, b), dense_prefill.bshd(k, b), dense_prefill.bshd(v, b)
        if layout == "BHSD":
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        return q, k, v

    def call(b, sq, skv, causal, lse, layout):
        q, k, v = tensors(b, sq, skv, layout)
        return lambda: dense_prefill.fused(q, k, v, causal, D**-0.5, lse)

    def wall_ms(fn) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return round((time.perf_counter() - t0) * 1e3, 3)

    call(1, 256, 256, True, False, "BHSD")()  # (the libraries load)
    out = {"mode": mode, "torch": torch.__version__, "cudnn": torch.backends.cudnn.version(),
           "env": os.environ.get(dense_prefill.BUCKET_ENV), "first_ms": [], "warm_us": {}}
    for layout in ("BSHD", "BHSD"):
        for b, sq, skv, causal, lse in FIRST:
            out["first_ms"].append([layout, b, sq, skv, causal, lse, wall_ms(call(b, sq, skv, causal, lse, layout))])
    for name, b, sq, skv, causal, lse in WARM:
        for layout in ("BSHD", "BHSD"):
            fn = call(b, sq, skv, causal, lse, layout)
            fn()
            t = cuda_device_s(fn, reps=30)
            flops = b * 4 * H * D * sq * (skv - sq + (sq + 1) / 2 if causal else skv)
            out["warm_us"][f"{name} {layout}"] = [round(t * 1e6, 1), round(flops / t / 1e12, 1)]
    if mode == "bucketed":
        out["check"] = check(tensors)
        out["warm_up"] = warm_ups()
    return out


def host() -> dict:
    """Host microseconds per call (the mean of 20, queued behind a 50 ms sleep kernel) and
    whether a call waited for the sleep (it synchronized)."""
    import torch

    from radixd.core.attention import dense_prefill

    dense_prefill.enable_buckets()
    cycles = int(torch.cuda.get_device_properties(0).clock_rate * 1e3 * 0.05)  # (clock_rate: kHz)
    res = {}
    for n, b in ((512, 1), (2048, 1), (2048, 8)):
        res.update(host_case(n, b, cycles))
    return res


def host_case(n: int, b: int, cycles: int) -> dict:
    import torch

    from radixd.core.attention import dense_prefill
    from radixd.core.attention.triton_kernels import extend_attention
    from radixd.core.models.layers import Rotary
    from radixd.core.triton_ops import rope_store

    t = b * n
    qkv = torch.randn(t, (H + 2 * HKV) * D, device="cuda", dtype=torch.bfloat16)
    strided = qkv[:, :H * D].view(t, H, D)
    q = strided.contiguous()
    kb = torch.randn(t + 1, HKV, D, device="cuda", dtype=torch.bfloat16)
    vb = torch.randn_like(kb)
    k, v = (dense_prefill.bshd(x[1:], b) for x in (kb, vb))
    table = torch.arange(1, t + 1, device="cuda").view(b, n)
    i64 = dict(dtype=torch.int64, device="cuda")
    rows, prefix, lens, starts = torch.arange(b, **i64), torch.zeros(b, **i64), torch.full((b,), n, **i64), \
        torch.arange(b, **i64) * n
    rot = Rotary(D, 8192, 500000.0, None).to("cuda")
    pos = torch.arange(n, device="cuda").repeat(b)
    loc = torch.arange(1, t + 1, device="cuda")
    kh, vh = qkv[:, H * D:(H + HKV) * D].view(t, HKV, D), qkv[:, (H + HKV) * D:].view(t, HKV, D)
    calls = {
        "fused_bucketed": lambda: dense_prefill.fused(dense_prefill.bshd(q, b), k, v, True, D**-0.5, False),
        "fused_exact": lambda: dense_prefill.fused(dense_prefill.bshd(strided, b), k, v, True, D**-0.5, False),
        "extend_kernel": lambda: extend_attention(q, kb, vb, table, rows, prefix, lens, starts, n, D**-0.5),
        "rope_store": lambda: rope_store(strided, kh, vh, pos, rot.cos, rot.sin, kb, vb, loc, q_out=q),
    }
    res = {}
    for name, fn in calls.items():
        fn()  # (plans built, kernels compiled)
        torch.cuda.synchronize()
        torch.cuda._sleep(cycles)
        t0 = time.perf_counter()
        fn()
        first = time.perf_counter() - t0
        for _ in range(19):
            fn()
        each = (time.perf_counter() - t0) / 20
        torch.cuda.synchronize()
        res[f"{b}x{n} {name}"] = {"host_us": round(each * 1e6, 1), "waited": first > 0.03}
    return res


def check(tensors) -> list:
    """Bucketed outputs and log-sum-exps against float64 (GQA heads repeated), a few shapes."""
    import torch

    from radixd.core.attention import dense_prefill

    res = []
    for b, sq, skv, causal in ((2, 777, 777, True), (1, 300, 1300, False), (1, 1500, 1500, True)):
        q, k, v = tensors(b, sq, skv, "BSHD")
        o, lse = dense_prefill.fused(q, k, v, causal, D**-0.5, True)
        qd, kd, vd = q.double(), k.double().repeat_interleave(H // HKV, 1), v.double().repeat_interleave(H // HKV, 1)
        s = (qd @ kd.transpose(-1, -2)) * D**-0.5
        if causal:
            s = s.masked_fill(torch.ones(sq, skv, dtype=torch.bool, device="cuda").triu(1), float("-inf"))
        ref_lse = torch.logsumexp(s, -1, keepdim=True)
        ref = torch.softmax(s, -1) @ vd
        res.append({"shape": [b, sq, skv, causal], "out_rel_err": float((o.double() - ref).norm() / ref.norm()),
                    "lse_max_abs_err": float((lse.double() - ref_lse).abs().max())})
    return res


def warm_ups() -> list:
    import torch

    from radixd.core.attention.dense_prefill import DensePlans
    from radixd.core.kv_pool import KVPool

    res = []
    for chunk, budget, context in ((2048, 4096, 131072), (8192, 16384, 131072)):
        pool = KVPool(num_layers=1, num_slots=140000, num_kv_heads=HKV, head_dim=D, max_rows=2,
                      max_context_len=context, dtype=torch.bfloat16, device=torch.device("cuda"))
        plans = DensePlans(heads=H, head_dim=D, dtype=torch.bfloat16, device=torch.device("cuda"),
                           max_extend=chunk, max_tokens=budget, max_context=context)
        w = plans.warm_up(pool.k_buffers[0], pool.v_buffers[0])
        res.append({"limits": [chunk, budget, context], "keys": len(plans.keys), "built": w.plans,
                    "seconds": round(w.seconds, 3), "bucketed": w.bucketed})
        del pool
        torch.cuda.empty_cache()
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="")
    ap.add_argument("--host", action="store_true", help="only the host-time child")
    ap.add_argument("--child", choices=("plain", "bucketed", "host"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(host() if args.child == "host" else child(args.child)))
        return 0
    from benchmarks.common import write_json

    res = {}
    for mode in ("host",) if args.host else ("plain", "bucketed"):
        env = {k: v for k, v in os.environ.items() if k != "TORCH_CUDNN_SDPA_AVOID_RECOMPILE"}
        p = subprocess.run([sys.executable, "-m", "benchmarks.cudnn_buckets", "--child", mode], env=env,
                           capture_output=True, text=True, timeout=900)
        if p.returncode:
            print(p.stderr[-4000:])
            res[mode] = {"error": p.stderr[-2000:]}
            continue
        res[mode] = json.loads(p.stdout.strip().splitlines()[-1])
        if mode == "host":
            for k, v in res[mode].items():
                print(f"   host {k:28s} {v['host_us']:8.1f} us a call{'  (waited for the device)' if v['waited'] else ''}")
            continue
        print(f"== {mode}: torch {res[mode]['torch']} cudnn {res[mode]['cudnn']} env {res[mode]['env']}")
        for row in res[mode]["first_ms"]:
            print(f"   first {row[0]} b={row[1]} q={row[2]} kv={row[3]} causal={row[4]} lse={row[5]}: {row[6]} ms")
        for k, v in res[mode]["warm_us"].items():
            print(f"   warm {k:32s} {v[0]:9.1f} us {v[1]:6.1f} TFLOP/s")
        for k in ("check", "warm_up"):
            if k in res[mode]:
                print(f"   {k}: {json.dumps(res[mode][k])}")
    if args.out:
        write_json(f"{args.out}/cudnn_{'host' if args.host else 'buckets'}.json", res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
