"""fp8 per-channel weights at decode batch sizes (16..256 rows), Llama-3-8B's projections: every
candidate kernel against the bf16 path in one run, each checked against a float64 product.

Candidates per (projection, rows):

- ``bf16``: the 16-bit model's own path (``triton_ops.linear_weight``: ``rows_linear`` where
  tuned, else cuBLAS; the gate/up projection with SiLU * up as ``gate_up_silu`` chooses);
- ``gemm``: ``fp8_gemm`` (per-token activation quantization, then the fp8 GEMM), what
  ``ops.fp8_linear`` took before ``fp8_rows``; ``silu_mul`` after it for gate/up;
- ``scaled_mm``: the same activation quantization, then ``torch._scaled_mm`` with row-wise
  scales (cuBLASLt's fp8 GEMM);
- ``rows a8w8`` / ``rows w8a16``: ``quant.fp8_rows`` in each mode over a few tiles (weight rows
  per program, K step, warps, stages, K splits).

Each time is the median replay of a CUDA graph of launches rotating over enough weight copies
to overflow the L2 (each launch reads its weights from HBM), per launch. ``--write-tuned``
merges each (shape, row bucket)'s fastest fp8 candidate into ``radixd/core/tuned/fp8_rows.json``
under the GPU's name (``fp8_rows.choose`` reads it).

    python -m benchmarks.fp8_rows --out DIR/fp8_rows.json [--rows 16,64] [--write-tuned FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from benchmarks.common import environment

SHAPES = {"qkv": (6144, 4096, False), "o": (4096, 4096, False), "gate_up": (28672, 4096, True),
          "down": (4096, 14336, False)}
ROWS = (16, 32, 64, 128, 256)
A8W8_TILES = ((64, 128, 4, 4), (64, 256, 4, 3), (64, 256, 4, 4), (128, 128, 4, 4), (128, 256, 4, 3),
              (64, 128, 8, 4), (32, 256, 4, 4))
W8A16_TILES = ((32, 256, 4, 4), (64, 128, 4, 4), (64, 256, 4, 3), (128, 128, 4, 4))


def graph_time_us(fns, reps: int = 15) -> float:
    """Median per-launch time of a CUDA graph replaying ``fns`` (one launch each) in order,
    warmed up and captured on one side stream (split-K scratch is made per stream)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        for f in fns:
            f()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / len(fns))
    del g
    return sorted(times)[len(times) // 2]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def splits_for(n: int, k: int, bn: int) -> list[int]:
    """K splits worth timing: more programs where the tiles alone are too few for an H200."""
    tiles = -(-n // bn)
    return [s for s in (1, 2, 4, 8) if s == 1 or (tiles * s <= 1100 and k // s >= 512 and tiles < 264)]


def candidates(x, w_c, wq_c, ws, n, k, silu, sweep: bool) -> dict:
    """label -> (choice for ``fp8_rows.choose`` or None, function of one weight copy, copies)."""
    from radixd.core import triton_ops
    from radixd.core.quant import fp8_gemm, fp8_rows

    m = x.shape[0]

    def bf16(wc):
        if not silu:
            return triton_ops.linear_weight(x, wc)
        tiles = triton_ops.few_rows(x, wc, silu=True)
        if tiles:
            return triton_ops.rows_linear(x, wc, silu=True, tiles=tiles)
        return triton_ops.silu_mul(torch.nn.functional.linear(x, wc))

    def gemm(wc):
        y = fp8_gemm.fp8_gemm(x, wc, ws, None, None)
        return triton_ops.silu_mul(y) if silu else y

    def smm(wc):
        y = fp8_rows.scaled_mm(x, wc, ws)
        return triton_ops.silu_mul(y) if silu else y

    def rows(mode, tiles):
        return lambda wc: fp8_rows.fp8_rows(x, wc, ws, silu=silu, mode=mode, tiles=tiles)

    out = {"bf16": (None, bf16, w_c), "gemm": (["gemm"], gemm, wq_c), "scaled_mm": (["scaled_mm"], smm, wq_c)}
    if m > fp8_rows.ROWS_MAX_M:
        return out
    for mode, name, tiles_list in ((1, "a8w8", A8W8_TILES), (0, "w8a16", W8A16_TILES)):
        for bn, bk, warps, stages in (tiles_list if sweep else tiles_list[:1]):
            if silu and bn == 128 and m >= 128:
                continue
            if mode == 0 and m > 32 and (bn, bk) != (64, 128):
                continue
            for split in splits_for(n, k, bn):
                t = (bn, bk, warps, stages, split)
                out[f"rows {name} {t}"] = (["rows", mode, *t], rows(mode, t), wq_c)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", default=",".join(map(str, ROWS)))
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--sweep-rows", default="16,32,64,128", help="rows at which fp8_rows' tiles are swept")
    ap.add_argument("--write-tuned", default="", help="merge each case's fastest fp8 kernel into this JSON file")
    args = ap.parse_args(argv)

    from radixd.core.quant import fp8_rows, ops

    dev = torch.device("cuda")
    doc: dict = {"environment": environment(), "shapes": {}}
    sweep_rows = {int(r) for r in args.sweep_rows.split(",") if r}
    summary, tuned = [], {}
    for name in args.shapes.split(","):
        n_all, k, silu = SHAPES[name]
        n = n_all // 2 if silu else n_all
        w = (torch.randn(n_all, k, device=dev) * k**-0.5).to(torch.bfloat16)
        wq, ws = ops.quantize_fp8(w.float(), "channel")
        w_deq = ops.dequantize_fp8(wq, ws)
        wq_c = [wq.clone() for _ in range(max(2, -(-256 * 2**20 // wq.numel())))]
        w_c = [w.clone() for _ in range(max(2, -(-256 * 2**20 // (2 * w.numel()))))]
        res: dict = {"N_K": [n_all, k], "silu": silu}
        doc["shapes"][name] = res
        for m in map(int, args.rows.split(",")):
            x = torch.randn(m, k, device=dev).to(torch.bfloat16)
            ref = x.double() @ w_deq.double().T
            if silu:
                ref = torch.nn.functional.silu(ref[:, :n]) * ref[:, n:]
            row: dict = {}
            res[f"M={m}"] = row
            cands = candidates(x, w_c, wq_c, ws, n, k, silu, m in sweep_rows)
            for label, (_, fn, copies) in cands.items():
                try:
                    y = fn(copies[0])
                    torch.cuda.synchronize()
                    err = rel_err(y, ref)
                    us = graph_time_us([lambda c=c, fn=fn: fn(c) for c in copies])
                    row[label] = {"us": round(us, 2), "rel_err_vs_weight_only": round(err, 5)}
                except Exception as e:  # (a config the compiler refuses: reported, the sweep goes on)
                    row[label] = {"error": repr(e)[:300]}
                print(name, m, label, row[label], flush=True)
            ok = {lb: r["us"] for lb, r in row.items() if "us" in r and r["rel_err_vs_weight_only"] < 0.05}
            best = min((lb for lb in ok if cands[lb][0] is not None), key=ok.get)
            row["best"] = {"label": best, "choice": cands[best][0], "us": ok[best],
                           "over_bf16": round(ok["bf16"] / ok[best], 3), "over_gemm": round(ok["gemm"] / ok[best], 3)}
            tuned.setdefault(fp8_rows.shape_key(n, k, silu), {})[str(m)] = cands[best][0]
            summary.append(f"{name:8s} M={m:<4d} bf16 {ok['bf16']:7.2f}  gemm {ok.get('gemm', 0):7.2f}  "
                           f"scaled_mm {ok.get('scaled_mm', 0):7.2f}  best {ok[best]:7.2f} {best}")
        del wq_c, w_c
        torch.cuda.empty_cache()
    doc["tuned"] = tuned
    Path(args.out).write_text(json.dumps(doc, indent=1))
    if args.write_tuned:
        path = Path(args.write_tuned)
        table = json.loads(path.read_text()) if path.exists() else {}
        gpu = table.setdefault(torch.cuda.get_device_name(dev), {})
        for key, buckets in tuned.items():
            gpu.setdefault(key, {}).update(buckets)
        path.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    print("\n".join(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
