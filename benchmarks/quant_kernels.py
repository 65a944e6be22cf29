"""The quantized-weight kernels alone on a GPU, at Llama-3-8B's projection shapes, against bf16
cuBLAS and ``torch._scaled_mm`` in the same run (random weights quantized in-process).

    python -m benchmarks.quant_kernels [--out benchmarks/results/quant] [--rows 1,64,16384] [--sweep]
    python -m benchmarks.quant_kernels --quick --out DIR    # tiny shapes on the CPU: the logic only

For each shape (qkv 6144x4096, o 4096x4096, gate_up 28672x4096, down 4096x14336), each row
count M (1: batch-1 decode, 64: a decode batch, 16384: prefill of 8 x 2048 tokens) and each
format (bf16; fp8 per-channel and 128x128-block; int4 group 128, symmetric, asymmetric and
act-order; int8 group 128): the op's device time (``ops.fp8_linear`` / ``ops.int_weight_linear``,
CUDA-graph timer, the fp8 GEMMs' activation quantization included), its relative error
against the torch reference, at M = 1 the bytes of quantized weight + scales read over the
copy bandwidth measured at the start of the run (the roofline fraction), and TFLOP/s with
the speed-up over bf16 ``torch.matmul``. Where the weight read dominates (M <= 64), each
timed CUDA graph holds the op on several distinct weights (``weights_per_graph``, 512 MiB
of bf16 weights in all) so that neither the graph launch nor L2 flatters a small kernel. fp8 per-channel rows also time ``torch._scaled_mm``
(row-wise scales) on the same pre-quantized operands, and ``act_quant`` alone.
``--sweep`` also times each kernel over a few tile configurations and reports the fastest
(to fill the kernels' tile tables; ``--quick`` tries two). Results: ``<out>/quant_kernels.json`` and a table on
stdout; a case that fails is reported with its error and the run goes on.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.common import RESULTS, environment, time_graph, timed_section, write_json
from radixd.core.quant import fp8_gemm, gemv, int_gemm, ops

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
QUICK_SHAPES = {"tiny": (40, 512)}
ROWS = (1, 64, 16384)
QUICK_ROWS = (1, 20)
COPIES_BYTES = 512 << 20
# format -> (kind, quantize arguments)
FORMATS = {
    "fp8_channel": ("fp8", dict(granularity="channel")),
    "fp8_block": ("fp8", dict(granularity="block")),
    "int4_g128_sym": ("int", dict(bits=4, group_size=128, symmetric=True)),
    "int4_g128_asym": ("int", dict(bits=4, group_size=128, symmetric=False)),
    "int4_g128_actorder": ("int", dict(bits=4, group_size=128, symmetric=True, act_order=True)),
    "int8_g128": ("int", dict(bits=8, group_size=128, symmetric=True)),
}
SWEEP_GEMV = [(2, 1024, 4), (4, 1024, 4), (8, 1024, 4), (16, 1024, 8), (4, 2048, 4), (8, 2048, 8), (8, 512, 4),
              (16, 512, 4), (32, 1024, 8), (2, 2048, 4), (2, 4096, 4), (4, 4096, 4), (8, 4096, 8), (4, 1024, 2),
              (8, 1024, 2), (4, 2048, 2), (16, 2048, 8)]
SWEEP_FP8_GEMM = [(64, 128, 128, 4, 4), (128, 128, 128, 4, 4), (128, 64, 128, 4, 4), (32, 64, 128, 4, 4), (64, 32, 128, 4, 4), (64, 64, 128, 4, 3), (64, 64, 128, 4, 4),
                  (64, 128, 128, 4, 3), (128, 128, 128, 4, 3), (128, 128, 128, 8, 3), (128, 256, 128, 8, 3)]
SWEEP_INT_GEMM = [(16, 32, 128, 4, 4), (16, 64, 128, 4, 4), (32, 64, 128, 4, 4), (64, 32, 128, 4, 4),
                  (64, 64, 128, 4, 3), (64, 128, 128, 4, 3), (128, 128, 128, 8, 3), (64, 64, 256, 4, 3)]


class Run:
    """One run's device, shapes and measured copy bandwidth."""

    def __init__(self, args: argparse.Namespace):
        self.quick = args.quick
        self.device = "cpu" if args.quick else "cuda"
        self.dtype = torch.float32 if args.quick else torch.bfloat16
        # kernels on the CPU only through the interpreter
        self.kernels = not args.quick or os.environ.get("TRITON_INTERPRET") == "1"
        self.shapes = {k: v for k, v in (QUICK_SHAPES if args.quick else SHAPES).items()
                       if not args.shapes or k in args.shapes.split(",")}
        self.rows = [int(r) for r in args.rows.split(",")] if args.rows else list(QUICK_ROWS if args.quick else ROWS)
        self.formats = [f for f in FORMATS if not args.formats or f in args.formats.split(",")]
        self.sweep = args.sweep
        self.copy_Bps = 1e10  # (placeholder on the CPU)

    def time(self, fns: list[Callable[[], object]]) -> float:
        """Seconds per call of the ``fns`` (the same op on distinct weights) captured in one
        CUDA graph: a lone small kernel's time would be mostly the graph launch."""
        if self.quick:  # (one call: the interpreter is slow, and the figure means nothing)
            t = time.perf_counter()
            fns[0]()
            return time.perf_counter() - t
        return time_graph(lambda: [fn() for fn in fns], reps=30) / len(fns)

    def copies(self, n: int, k: int, m: int) -> int:
        """Distinct weights per timed graph: enough that their bf16 bytes pass COPIES_BYTES
        (no weight is read from L2) where the weight read dominates (M <= 64), else one."""
        if self.quick or m > 64:
            return 1
        return math.ceil(COPIES_BYTES / (2 * n * k))


def ceilings(run: Run) -> dict:
    if run.quick:
        return {"skipped": "--quick: placeholders"}
    x = torch.randn(1024**3 // 2, device="cuda", dtype=torch.bfloat16)  # 1 GiB
    y = torch.empty_like(x)
    run.copy_Bps = 2 * x.numel() * x.element_size() / time_graph(lambda: y.copy_(x), reps=20)
    return {"copy_TBps": round(run.copy_Bps / 1e12, 3), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30))


def quantized(run: Run, fmt: str, w: torch.Tensor) -> dict:
    """The op, its reference and its weight + scale bytes for one format of weight ``w``."""
    kind, q = FORMATS[fmt]
    if kind == "fp8":
        block = (128, 128) if q["granularity"] == "block" else None
        wq, s = ops.quantize_fp8(w, q["granularity"])
        return dict(op=lambda x: ops.fp8_linear(x, wq, s, block=block, use_triton=run.kernels),
                    ref=lambda x: ops.fp8_linear_reference(x, wq, s, block=block),
                    bytes=wq.numel() + s.numel() * 4, weight=wq, scale=s, block=block)
    k = w.shape[1]
    qw, s, z = ops.quantize_int(w, q["bits"], q["group_size"], q["symmetric"])
    perm = torch.randperm(k, device=w.device) if q.get("act_order") else None
    args = dict(bits=q["bits"], group_size=q["group_size"], perm=perm)
    return dict(op=lambda x: ops.int_weight_linear(x, qw, s, z, **args, use_triton=run.kernels),
                ref=lambda x: ops.int_weight_linear_reference(x, qw, s, z, **args),
                bytes=qw.numel() * qw.element_size() + (s.numel() + (z.numel() if z is not None else 0)) * s.element_size()
                + (perm.numel() * 8 if perm is not None else 0),
                tiled=lambda x, kern, tiles: kern(x, qw, s, z, q["bits"], q["group_size"], perm, None, tiles=tiles))


def sweep(run: Run, fmt: str, qzs: list[dict], x: torch.Tensor) -> dict:
    """Each candidate tile of the kernel this row count takes: {tiles: us}, fastest first."""
    m = x.shape[0]
    kind = FORMATS[fmt][0]
    if m <= gemv.GEMV_MAX_M:
        cands = SWEEP_GEMV
        kern = gemv.fp8_gemv if kind == "fp8" else gemv.int_gemv
    else:
        cands = SWEEP_FP8_GEMM if kind == "fp8" else SWEEP_INT_GEMM
        kern = fp8_gemm.fp8_gemm if kind == "fp8" else int_gemm.int_gemm
    if run.quick:  # two whose K step divides the tiny K
        step = 1 if m <= gemv.GEMV_MAX_M else 2
        cands = [t for t in cands if x.shape[1] % t[step] == 0][:2]
    out = {}
    for tiles in cands:
        if kind == "fp8":
            fns = [lambda qz=qz, tiles=tiles: kern(x, qz["weight"], qz["scale"], qz["block"], None, tiles=tiles)
                   for qz in qzs]
        else:
            fns = [lambda qz=qz, tiles=tiles: qz["tiled"](x, kern, tiles) for qz in qzs]
        try:
            out[str(tiles)] = round(run.time(fns) * 1e6, 2)
        except Exception as exc:  # noqa: BLE001 (a tile that does not compile or fit is reported)
            out[str(tiles)] = repr(exc)[:120]
    timed = sorted((v, k) for k, v in out.items() if isinstance(v, float))
    return {"best": timed[0][1] if timed else None, "us": dict(sorted(out.items(), key=lambda kv: str(kv[1])))}


def shape_case(run: Run, name: str, n: int, k: int) -> dict:
    g = torch.Generator(device=run.device).manual_seed(0)
    res: dict = {"N_K": [n, k]}
    for m in run.rows:
        ws = [(torch.randn(n, k, device=run.device, generator=g) * k**-0.5).to(run.dtype)
              for _ in range(run.copies(n, k, m))]
        x = torch.randn(m, k, device=run.device, generator=g).to(run.dtype)
        flops = 2 * m * n * k
        t_bf16 = run.time([lambda w=w, x=x: torch.matmul(x, w.T) for w in ws])
        row: dict = {"weights_per_graph": len(ws),
                     "bf16": {"us": round(t_bf16 * 1e6, 2), "TFLOPs": round(flops / t_bf16 / 1e12, 2)}}
        if m == 1:
            row["bf16"]["frac_copy"] = round(2 * n * k / t_bf16 / run.copy_Bps, 3)
        for fmt in run.formats:
            row[fmt] = timed_section(lambda fmt=fmt, x=x, m=m, f=flops, t=t_bf16, ws=ws:
                                     _format_case(run, fmt, ws, x, m, f, t))
        del ws
        res[f"M={m}"] = row
    return res


def _format_case(run: Run, fmt: str, ws: list[torch.Tensor], x: torch.Tensor, m: int, flops: int,
                 t_bf16: float) -> dict:
    qzs = [quantized(run, fmt, w) for w in ws]
    qz = qzs[0]
    t = run.time([lambda qz=qz: qz["op"](x) for qz in qzs])
    r = {"us": round(t * 1e6, 2), "TFLOPs": round(flops / t / 1e12, 2), "over_bf16": round(t_bf16 / t, 3),
         "rel_err_vs_reference": round(rel_err(qz["op"](x), qz["ref"](x)), 5)}
    if m == 1:
        r["bytes"] = qz["bytes"]
        r["frac_copy"] = round(qz["bytes"] / t / run.copy_Bps, 3)
    if fmt == "fp8_channel" and m > gemv.GEMV_MAX_M:
        r["act_quant_us"] = (round(run.time([lambda: fp8_gemm.quantize_act(x)] * len(qzs)) * 1e6, 2)
                             if run.kernels else None)
        if not run.quick and hasattr(torch, "_scaled_mm"):
            xq, xs = ops.quantize_act_fp8(x)
            try:
                ts = run.time([lambda qz=qz: torch._scaled_mm(xq, qz["weight"].T, scale_a=xs, scale_b=qz["scale"][None, :],
                                                              out_dtype=torch.bfloat16) for qz in qzs])
                r["scaled_mm_us"] = round(ts * 1e6, 2)
                r["scaled_mm_TFLOPs"] = round(flops / ts / 1e12, 2)
            except Exception as exc:  # noqa: BLE001 (not every torch/GPU has row-wise scaling)
                r["scaled_mm_us"] = repr(exc)[:120]
    if run.sweep and run.kernels:
        r["sweep"] = sweep(run, fmt, qzs, x)
    return r


def table(results: dict, formats: list[str]) -> list[str]:
    head = f"{'shape':8} {'M':>6} {'format':20} {'us':>9} {'TFLOP/s':>8} {'x bf16':>7} {'frac copy':>9} {'err':>8}"
    lines = [head, "-" * len(head)]
    for name, res in results.items():
        if not isinstance(res, dict) or "N_K" not in res:
            continue
        for key, row in res.items():
            if not key.startswith("M="):
                continue
            for fmt in ["bf16", *formats]:
                r = row.get(fmt, {})
                if "error" in r:
                    lines.append(f"{name:8} {key[2:]:>6} {fmt:20} error: {r['error'][:60]}")
                    continue
                lines.append(f"{name:8} {key[2:]:>6} {fmt:20} {r.get('us', ''):>9} {r.get('TFLOPs', ''):>8} "
                             f"{r.get('over_bf16', ''):>7} {r.get('frac_copy', ''):>9} "
                             f"{r.get('rel_err_vs_reference', ''):>8}")
                if "scaled_mm_us" in r:
                    lines.append(f"{'':8} {'':>6} {'  _scaled_mm':20} {r['scaled_mm_us']:>9} "
                                 f"{r.get('scaled_mm_TFLOPs', ''):>8}   (act_quant {r.get('act_quant_us')} us)")
    return lines


def gemv_kind(fmt: str) -> str | None:
    """``gemv``'s tuned-table kind of a format (None for act-order: its x is gathered, its
    kernel the symmetric one's)."""
    kind, q = FORMATS[fmt]
    if kind == "fp8":
        return gemv.fp8_kind(torch.ones(1), (128, 128) if q["granularity"] == "block" else None)
    return None if q.get("act_order") else gemv.int_kind(q["bits"], q["group_size"], q["symmetric"])


def write_tuned(path: Path, summary: dict, device: str) -> dict:
    """Each shape and format's fastest one-row GEMV tiles from the sweep, merged into
    ``path`` under the GPU's name ("cpu" for a ``--quick`` run); returns what was written."""
    found = {}
    for res in summary.values():
        row = res.get("M=1") if isinstance(res, dict) and "N_K" in res else None
        for fmt, r in (row or {}).items():
            best = r.get("sweep", {}).get("best") if isinstance(r, dict) else None
            if best and fmt in FORMATS and gemv_kind(fmt):
                found[gemv.tuned_key(gemv_kind(fmt), *res["N_K"])] = list(ast.literal_eval(best))
    table = json.loads(path.read_text()) if path.exists() else {}
    gpu = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    table.setdefault(gpu, {}).update(found)
    path.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    return found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(RESULTS / "quant"), help="directory for quant_kernels.json")
    ap.add_argument("--quick", action="store_true", help="tiny shapes on the CPU (the logic, not a figure)")
    ap.add_argument("--rows", default="", help="row counts M (default 1,64,16384)")
    ap.add_argument("--shapes", default="", help=f"some of {','.join(SHAPES)}")
    ap.add_argument("--formats", default="", help=f"some of {','.join(FORMATS)}")
    ap.add_argument("--sweep", action="store_true", help="also time each kernel over candidate tiles")
    ap.add_argument("--write-tuned", default="", help="with --sweep: write each one-row GEMV's fastest tiles for "
                    "this GPU into this JSON (radixd/core/tuned/quant_gemv.json is the one radixd reads)")
    args = ap.parse_args(argv)
    if not args.quick and not torch.cuda.is_available():
        print("no CUDA device: use --quick for the CPU smoke run", file=sys.stderr)
        return 2
    run = Run(args)
    summary: dict = {"environment": environment(), "kernels": run.kernels, "ceilings": timed_section(lambda: ceilings(run))}
    for name, (n, k) in run.shapes.items():
        summary[name] = timed_section(lambda n=n, k=k, name=name: shape_case(run, name, n, k))
    print("\n".join(table(summary, run.formats)), flush=True)
    if args.write_tuned:
        print(f"tuned tiles: {write_tuned(Path(args.write_tuned), summary, run.device)}")
    path = write_json(Path(args.out) / "quant_kernels.json", summary)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
