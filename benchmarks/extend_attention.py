"""The extend-attention kernel's tile configurations on a CUDA GPU, at the 8B shape (32 query
heads, 8 KV heads, head dim 128, bf16), against torch's SDPA and the bf16 matmul rate:

  prefill_8x2048   8 prompts of 2048 tokens, no prefix, slots in order (gpu_bench's row)
  prefill_8x2000   8 prompts of 2000 tokens (not a power of two: a bucketed plan's padding)
  permuted_8x2048  the same with the slots shuffled (a pool after churn)
  chunk_32k        one 8192-token chunk after a 24576-token prefix (a 32k prompt's last chunk)
  verify_64x5      64 requests, 5 new tokens each after 2048 cached (a speculative verify step)

Every configuration's output is checked against SDPA's (relative error) before it is timed;
times are device times with the launches queued behind a busy device (``cuda_device_s``).
SDPA runs on q/k/v in BHSD layout (contiguous copies): torch's exact-shape cuDNN plans even
with bucketed plans asked for in this process. For the long cases, ``radixd_exact`` and
``radixd_bucketed`` are what a step of such extends runs with the engine option
``dense_prefill`` (``dense_prefill.attend`` after ``warm_up``: q strided as projected with
exact-shape plans, contiguous as the rotary kernel writes it with bucketed plans; K/V read
from the pool, a prefix gathered through the table), timed the same way; without the option
serving runs the ``default`` row (the extend kernel).

  python -m benchmarks.extend_attention --out OUT [--configs "(64,64,4,3,True,4);..."] [--small-configs ...]
      [--baseline FILE.py]   (another revision's triton_kernels.py, timed with its default)
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import math
import warnings

import torch
import torch.nn.functional as F

from benchmarks.common import cuda_device_s, environment, write_json
from radixd.core.attention import dense_prefill, triton_backend
from radixd.core.attention import triton_kernels as tk

H, HKV, D = 32, 8, 128
BIG = [(64, 64, 4, 3, True, 1), (128, 64, 8, 3, True, 1), (128, 128, 8, 3, True, 1),
       (64, 64, 4, 3, True, 4), (128, 64, 8, 3, True, 4), (128, 64, 4, 3, True, 4), (128, 128, 8, 3, True, 4),
       (128, 128, 8, 2, True, 4), (64, 128, 4, 3, True, 4), (128, 64, 8, 4, True, 4), (128, 64, 8, 3, False, 4),
       (128, 64, 8, 3, True, 2), (256, 64, 8, 3, True, 4)]
SMALL = [(16, 32, 4, 2, False, 1), (16, 64, 4, 2, False, 1), (16, 32, 4, 2, False, 4), (32, 32, 4, 2, False, 4),
         (32, 64, 4, 2, False, 4), (32, 64, 4, 3, True, 4), (64, 64, 4, 2, False, 4)]


def case(name: str, reqs: int, prefix: int, ext: int, permute: bool) -> dict:
    slots = reqs * (prefix + ext) + 1
    g = torch.Generator(device="cuda").manual_seed(reqs + prefix + ext)
    kb = torch.randn(slots, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g)
    vb = torch.randn(slots, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g)
    order = torch.randperm(slots - 1, device="cuda", generator=g) if permute else torch.arange(slots - 1, device="cuda")
    table = (order + 1).view(reqs, prefix + ext)
    q = torch.randn(reqs * ext, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
    i64 = dict(dtype=torch.int64, device="cuda")
    args = (q, kb, vb, table, torch.arange(reqs, **i64), torch.full((reqs,), prefix, **i64),
            torch.full((reqs,), ext, **i64), torch.arange(reqs, **i64) * ext, ext, D**-0.5)
    # the reference: SDPA over each request's keys in order, bottom-right causal
    keys = table.reshape(-1)
    ks = kb[keys].view(reqs, prefix + ext, HKV, D).transpose(1, 2).contiguous()
    vs = vb[keys].view(reqs, prefix + ext, HKV, D).transpose(1, 2).contiguous()
    qs = q.view(reqs, ext, H, D).transpose(1, 2).contiguous()
    if prefix == 0:
        sdpa = lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)  # noqa: E731
    else:
        pos = torch.arange(prefix, prefix + ext, device="cuda")
        mask = torch.arange(prefix + ext, device="cuda")[None, :] <= pos[:, None]
        sdpa = lambda: F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, enable_gqa=True)  # noqa: E731
    ref = sdpa().transpose(1, 2).reshape(reqs * ext, H, D).float()
    flops = reqs * 4 * H * D * ext * (prefix + (ext + 1) / 2)
    return dict(name=name, args=args, sdpa=sdpa, ref=ref, flops=flops, causal_sdpa=prefix == 0)


def serving_path(c: dict):
    """The triton backend's attention for case ``c`` as a step runs it with ``dense_prefill``
    (its plans built first, for an engine whose chunk and step budget fit the case), by name:
    ``radixd_exact`` where the step has exact-shape plans (what serving runs then), and
    ``radixd_bucketed`` (what it runs otherwise, and for every other length of the buckets)."""
    from radixd.core.forward_batch import ForwardBatch
    from radixd.core.kv_pool import KVPool

    q, kb, vb, table, *_, ext, scale = c["args"]
    reqs, width = table.shape
    prefix = width - ext
    pool = KVPool(num_layers=1, num_slots=2 * kb.shape[0], num_kv_heads=HKV, head_dim=D, max_rows=reqs + 1,
                  max_context_len=width, dtype=torch.bfloat16, device=torch.device("cuda"))  # (room for every plan)
    attn = triton_backend.TritonAttention(pool, num_heads=H, head_dim=D, scale=scale, dense_prefill=True,
                                          prefill_limits=(ext, reqs * ext))
    attn.warm_up()  # (on the pool's zeros, before the case's K/V go in)
    pool.k_buffers[0][:kb.shape[0]].copy_(kb)
    pool.v_buffers[0][:vb.shape[0]].copy_(vb)
    pool.req_to_token[:reqs, :width] = table
    loc = table[:, prefix:].reshape(-1)
    zeros = torch.zeros(reqs * ext, dtype=torch.int64)
    fb = ForwardBatch(input_ids=zeros, positions=zeros, out_cache_loc=loc.cpu(), rows=list(range(reqs)),
                      prefix_lens=[prefix] * reqs, extend_lens=[ext] * reqs)
    attn.begin(fb)
    step = attn.dense
    assert step is not None and not step.rest, "the case does not take the fused path"
    whole = len(step.fresh) == 1 and not (step.joined or step.split) and step.fresh[0][1] * step.fresh[0][2] == q.shape[0]

    def attend(qs: torch.Tensor):
        return lambda: dense_prefill.attend(step, qs, pool.k_buffers[0], pool.v_buffers[0], attn.out_cache_loc,
                                            pool.req_to_token, scale, None if whole else torch.empty_like(q))

    paths = {"radixd_bucketed": attend(q.contiguous())}  # (q as the rotary kernel writes it for bucketed plans)
    if step.exact:  # (q as projected, a strided view of the q/k/v rows: the exact-shape plans)
        qkv = torch.empty(q.shape[0], (H + 2 * HKV) * D, device="cuda", dtype=q.dtype)
        qs = qkv[:, :H * D].view(q.shape)
        qs.copy_(q)
        assert qs.stride() == attn.plans.q_strides
        paths["radixd_exact"] = attend(qs)
    return paths


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b).norm() / b.norm())


def run(c: dict, fn) -> dict:
    out = torch.full_like(c["args"][0], float("nan"))
    fn(out)
    err = rel(out, c["ref"])
    if not math.isfinite(err) or err > 2e-2:
        return {"error": f"relative error {err:.3g}"}
    t = cuda_device_s(lambda: fn(out), reps=30)
    return {"us": round(t * 1e6, 1), "TFLOPs": round(c["flops"] / t / 1e12, 1), "rel_err": round(err, 5)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--configs", default="", help="';'-separated tuples in place of the built-in list for long extends")
    ap.add_argument("--small-configs", default="", help="the same for the verify case")
    ap.add_argument("--baseline", default="", help="another triton_kernels.py, timed with its own default config")
    args = ap.parse_args()
    warnings.filterwarnings("ignore", message=".*(kernel not used|runtime disabled|same num_heads)")
    dense_prefill.enable_buckets()  # (before the first cuDNN attention: torch reads it then)
    base = None
    if args.baseline:
        spec = importlib.util.spec_from_file_location("baseline_kernels", args.baseline)
        base = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(base)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm = 2 * 8192**3 / cuda_device_s(lambda: a @ a)
    res = {"env": environment(), "matmul_TFLOPs": round(mm / 1e12, 1), "cases": {}}
    cases = [case("prefill_8x2048", 8, 0, 2048, False), case("prefill_8x2000", 8, 0, 2000, False),
             case("permuted_8x2048", 8, 0, 2048, True),
             case("chunk_32k", 1, 24576, 8192, False), case("verify_64x5", 64, 2048, 5, False)]
    given = [ast.literal_eval(x) for x in args.configs.split(";") if x.strip()]
    given_small = [ast.literal_eval(x) for x in args.small_configs.split(";") if x.strip()]
    for c in cases:
        row = res["cases"][c["name"]] = {}
        t = cuda_device_s(c["sdpa"], reps=30)
        row["sdpa"] = {"us": round(t * 1e6, 1), "TFLOPs": round(c["flops"] / t / 1e12, 1),
                       "kind": "is_causal" if c["causal_sdpa"] else "boolean mask"}
        if c["causal_sdpa"]:
            from torch.nn.attention import SDPBackend, sdpa_kernel
            for name, be in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                             ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
                try:
                    with sdpa_kernel(be):
                        tb = cuda_device_s(c["sdpa"], reps=30)
                    row[f"sdpa_{name}"] = {"us": round(tb * 1e6, 1), "TFLOPs": round(c["flops"] / tb / 1e12, 1)}
                except Exception as exc:  # (a backend that does not take this shape)
                    row[f"sdpa_{name}"] = {"error": repr(exc)[:160]}
        if c["args"][8] >= dense_prefill.MIN_TOKENS:
            for name, fn in serving_path(c).items():
                err = rel(fn(), c["ref"])
                tr = cuda_device_s(fn, reps=30)
                row[name] = {"us": round(tr * 1e6, 1), "TFLOPs": round(c["flops"] / tr / 1e12, 1), "rel_err": round(err, 5)}
        row["default"] = run(c, lambda o, c=c: tk.extend_attention(*c["args"], out=o))
        if base is not None:
            row["baseline_default"] = run(c, lambda o, c=c: base.extend_attention(*c["args"], out=o))
        configs = (given_small or SMALL) if c["name"].startswith("verify") else (given or BIG)
        for cfg in configs:
            try:
                row[str(cfg)] = run(c, lambda o, c=c, cfg=cfg: tk.extend_attention(*c["args"], out=o, config=cfg))
            except Exception as exc:  # (a tile that does not compile: too many registers or shared memory)
                row[str(cfg)] = {"error": repr(exc)[:160]}
        sd = row["sdpa"]["us"]
        print(f"== {c['name']}: sdpa {sd} us {row['sdpa']['TFLOPs']} TFLOP/s (matmul {res['matmul_TFLOPs']})")
        for k, v in row.items():
            if k != "sdpa":
                extra = f"  sdpa/this {sd / v['us']:.3f}" if "us" in v else ""
                print(f"   {k:28s} {v}{extra}")
    write_json(f"{args.out}/extend_attention.json", res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
