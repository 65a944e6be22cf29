"""Prompt attention on the CPU: radixd's C kernel (``cpu_kernels.extend``, AVX2) against torch's
SDPA over each request's gathered KV (what the torch backend runs without it), on the default
model's heads (9 query heads, 3 KV heads of 64) over a float32 pool, threads as an engine sets them:

  fresh_544     one 544-token prompt, nothing cached (SDPA's causal mode, no mask)
  fresh_3x544   three of them in one step
  question_1    one 32-token question after a cached 512-token prefix (SDPA under a mask)
  question_3    three such questions over one shared prefix
  question_8    eight of them
  fresh_2048    one 2048-token prompt
  fresh_8192    one 8192-token prompt (``--reps`` // 4 calls)

Each case's kernel output is checked against the SDPA path's first; times are medians of
``--reps`` calls; GFLOP/s count the causal multiply-adds only (4 x heads x head_dim per
query-key pair attended).

    python -m benchmarks.cpu_extend --out benchmarks/results/cpu_extend.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.common import environment, write_json
from radixd.core import cpu_kernels, cpu_setup

HEADS, KV_HEADS, DIM, SCALE = 9, 3, 64, 0.125
CASES = {
    "fresh_544": [(0, 544)],
    "fresh_3x544": [(0, 544)] * 3,
    "question_1": [(512, 32)],
    "question_3": [(512, 32)] * 3,
    "question_8": [(512, 32)] * 8,
    "fresh_2048": [(0, 2048)],
    "fresh_8192": [(0, 8192)],
}


def median_ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def case(extends: list[tuple[int, int]], k_buf: torch.Tensor, v_buf: torch.Tensor, reps: int) -> dict:
    """Extends of (cached prefix, new rows); the cached prefixes are one shared run of slots."""
    rows = sum(e for _, e in extends)
    q = torch.randn(rows, HEADS, DIM)
    out = torch.empty_like(q)
    prefix = torch.arange(1, 513)
    slots, meta, row, off, nxt = [], [], 0, 0, 1000
    for p, e in extends:
        own = torch.arange(nxt, nxt + (e if p else p + e))
        nxt += own.numel()
        slots.append(torch.cat((prefix[:p], own)))
        meta.append((row, e, p, off))
        row += e
        off += p + e
    slots_t, meta_t = torch.cat(slots), torch.tensor(meta, dtype=torch.int64)

    def kernel():
        cpu_kernels.extend(q, k_buf, v_buf, slots_t, meta_t, SCALE, out)

    def sdpa():
        res = torch.empty_like(q)
        for (p, e), sl, (r0, *_) in zip(extends, slots, meta, strict=True):
            qi = q[r0 : r0 + e].transpose(0, 1)[None]
            k = torch.index_select(k_buf, 0, sl).transpose(0, 1)[None]
            v = torch.index_select(v_buf, 0, sl).transpose(0, 1)[None]
            if p == 0:
                o = F.scaled_dot_product_attention(qi, k, v, is_causal=True, scale=SCALE, enable_gqa=True)
            else:
                mask = torch.arange(p + e)[None, :] <= torch.arange(p, p + e)[:, None]
                o = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, scale=SCALE, enable_gqa=True)
            res[r0 : r0 + e] = o[0].transpose(0, 1)
        return res

    kernel()
    err = float((out - sdpa()).abs().max())
    assert err < 1e-4, f"kernel vs SDPA: max abs difference {err}"
    flops = sum(HEADS * DIM * 4 * (e * p + e * (e + 1) / 2) for p, e in extends)
    k_ms, s_ms = median_ms(kernel, reps), median_ms(sdpa, reps)
    return {"kernel_ms": round(k_ms, 3), "sdpa_ms": round(s_ms, 3), "kernel_gflops": round(flops / k_ms / 1e6, 1),
            "sdpa_gflops": round(flops / s_ms / 1e6, 1), "speedup": round(s_ms / k_ms, 2), "max_abs_diff": err}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    if cpu_kernels.library() is None or not cpu_kernels.avx2():
        raise SystemExit("cpu_extend: radixd's AVX2 kernels are not available here")
    cpu_setup.step_threads(cpu_setup.PREFILL_TOKENS)  # (torch's threads as an engine's prompt steps set them)
    kernel_threads = cpu_kernels.set_threads(cpu_setup.kernel_threads())
    torch.manual_seed(0)
    k_buf, v_buf = torch.randn(10_000, KV_HEADS, DIM), torch.randn(10_000, KV_HEADS, DIM)
    results = {}
    for name, extends in CASES.items():
        results[name] = case(extends, k_buf, v_buf, a.reps // 4 if name == "fresh_8192" else a.reps)
        print(name, results[name], flush=True)
    doc = {"environment": environment(), "torch_threads": torch.get_num_threads(), "kernel_threads": kernel_threads,
           "cases": results}
    if a.out:
        write_json(a.out, doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
