"""A mixed step's attention on a CUDA GPU: decodes beside a prompt chunk, per layer, at the 8B
shape (32 query heads, 8 KV heads, head dim 128, bf16 pool, slots shuffled).

  all-extend   every request through the extend kernel (a decode is an extend of one token),
               as the triton backend ran mixed steps before
  split        the chunk through the extend kernel, the decodes through the split-KV decode
               kernel (``TritonAttention`` now)
  decode-only  the decodes alone (a plain decode step's attention), and the chunk alone

Both mixed variants are checked against a float32 reference per request before they are timed.
Times are device times: each call's launches queue behind a sleep kernel
(``benchmarks.common.cuda_device_s``), as a mixed step's kernels queue behind its projections
in serving, so the host's cost of issuing them is not counted. The chunk alone is also timed
in a few other tiles of the extend kernel.

  python -m benchmarks.mixed_step --out OUT.json [--decodes 64,256] [--context 576] [--chunks 512,2048]
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import cuda_device_s, environment, write_json
from radixd.core.attention import triton_backend as tb
from radixd.core.attention import triton_kernels as tk

H, HKV, D = 32, 8, 128
# the chunk alone in these extend tiles too (BLOCK_M, BLOCK_N, warps, stages, K_ROWS, PACK)
CHUNK_CONFIGS = [(64, 64, 4, 3, True, 4), (128, 64, 8, 3, True, 4), (128, 64, 4, 3, True, 4), (64, 64, 4, 3, True)]
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # (on the CPU: the Triton interpreter, --smoke)
DTYPE = torch.bfloat16 if DEV == "cuda" else torch.float32  # (the interpreter has no bf16)


def case(decodes: int, context: int, chunk: int, prefix: int) -> dict:
    """``decodes`` requests of ``context`` keys (their new token the last) and one request
    extending ``chunk`` tokens after ``prefix`` cached, the decodes first (the scheduler's order)."""
    g = torch.Generator(device=DEV).manual_seed(decodes + chunk)
    lens = [context] * decodes + [prefix + chunk]
    slots = sum(lens) + 1
    kb = torch.randn(slots, HKV, D, device=DEV, dtype=DTYPE, generator=g)
    vb = torch.randn(slots, HKV, D, device=DEV, dtype=DTYPE, generator=g)
    perm = torch.randperm(slots - 1, device=DEV, generator=g) + 1
    table = torch.zeros(decodes + 1, max(lens), dtype=torch.int64, device=DEV)
    off = 0
    for r, n in enumerate(lens):
        table[r, :n] = perm[off : off + n]
        off += n
    i64 = dict(dtype=torch.int64, device=DEV)
    tokens = decodes + chunk
    q = torch.randn(tokens, H, D, device=DEV, dtype=DTYPE, generator=g)
    ext = [1] * decodes + [chunk]
    pre = [context - 1] * decodes + [prefix]
    c = dict(kb=kb, vb=vb, table=table, q=q, decodes=decodes, chunk=chunk, context=context, prefix=prefix,
             rows=torch.arange(decodes + 1, **i64), prefix_lens=torch.tensor(pre, **i64),
             extend_lens=torch.tensor(ext, **i64), q_starts=torch.tensor([*range(decodes), decodes], **i64))
    # reference (float32) for the decodes and the chunk's last 64 rows
    ref = torch.empty(tokens, H, D, device=DEV)
    for r in range(decodes + 1):
        idx = table[r, : lens[r]]
        k, v = kb[idx].float().repeat_interleave(H // HKV, 1), vb[idx].float().repeat_interleave(H // HKV, 1)
        start, n = (r, 1) if r < decodes else (decodes + chunk - min(64, chunk), min(64, chunk))
        qpos = torch.arange(lens[r] - n, lens[r], device=DEV)
        s = torch.einsum("thd,shd->hts", q[start : start + n].float(), k) * D**-0.5
        s = s.masked_fill(torch.arange(lens[r], device=DEV)[None, None, :] > qpos[None, :, None], float("-inf"))
        ref[start : start + n] = torch.einsum("hts,shd->thd", s.softmax(-1), v)
    c["check"] = torch.cat((torch.arange(decodes, device=DEV), torch.arange(tokens - min(64, chunk), tokens, device=DEV)))
    c["ref"] = ref[c["check"]]
    return c


def all_extend(c: dict, out: torch.Tensor) -> None:
    tk.extend_attention(c["q"], c["kb"], c["vb"], c["table"], c["rows"], c["prefix_lens"], c["extend_lens"],
                        c["q_starts"], c["chunk"], D**-0.5, out=out)


def split(c: dict, out: torch.Tensor, mid) -> None:
    n = c["decodes"]
    tk.extend_attention(c["q"], c["kb"], c["vb"], c["table"], c["rows"][n:], c["prefix_lens"][n:],
                        c["extend_lens"][n:], c["q_starts"][n:], c["chunk"], D**-0.5, out=out)
    decode_only(c, out, mid)


def decode_only(c: dict, out: torch.Tensor, mid) -> None:
    n = c["decodes"]
    seq = c["prefix_lens"][:n] + 1
    tk.decode_attention(c["q"][:n], c["kb"], c["vb"], c["table"], c["rows"][:n], seq, D**-0.5,
                        num_splits=mid[0].shape[2], out=out[:n], mid_o=mid[0], mid_lse=mid[1])


def chunk_only(c: dict, out: torch.Tensor, config: tuple | None = None) -> None:
    n = c["decodes"]
    tk.extend_attention(c["q"], c["kb"], c["vb"], c["table"], c["rows"][n:], c["prefix_lens"][n:],
                        c["extend_lens"][n:], c["q_starts"][n:], c["chunk"], D**-0.5, out=out, config=config)


def measure(c: dict) -> dict:
    processors = torch.cuda.get_device_properties(0).multi_processor_count if DEV == "cuda" else 8
    timed = cuda_device_s if DEV == "cuda" else (lambda fn, reps: (fn(), 0.0)[1])
    splits = tb.decode_splits(c["decodes"], HKV, processors)
    mid = (torch.empty(c["decodes"], H, splits, D, device=DEV), torch.empty(c["decodes"], H, splits, device=DEV))
    res: dict = {"decodes": c["decodes"], "context": c["context"], "chunk": c["chunk"], "prefix": c["prefix"],
                 "splits": splits}
    for name, fn in (("all_extend", lambda o: all_extend(c, o)), ("split", lambda o: split(c, o, mid))):
        out = torch.full_like(c["q"], float("nan"))
        fn(out)
        err = float((out[c["check"]].float() - c["ref"]).norm() / c["ref"].norm())
        if not err < 2e-2:
            res[name] = {"error": f"relative error {err:.3g}"}
            continue
        res[name] = {"us": round(timed(lambda fn=fn, out=out: fn(out), reps=30) * 1e6, 1), "rel_err": round(err, 5)}
    for k in (2, 4, 8):  # the decode kernel's other split counts, in the mixed step
        if k != splits:
            m = (torch.empty(c["decodes"], H, k, D, device=DEV), torch.empty(c["decodes"], H, k, device=DEV))
            o = torch.empty_like(c["q"])
            res[f"split_{k}_us"] = round(timed(lambda m=m, o=o: split(c, o, m), reps=30) * 1e6, 1)
    out = torch.empty_like(c["q"])
    res["decode_only_us"] = round(timed(lambda: decode_only(c, out, mid), reps=30) * 1e6, 1)
    res["chunk_only_us"] = round(timed(lambda: chunk_only(c, out), reps=30) * 1e6, 1)
    for conf in CHUNK_CONFIGS if DEV == "cuda" else ():  # the chunk alone in other tiles
        try:
            t = timed(lambda conf=conf: chunk_only(c, out, conf), reps=30)
        except Exception as exc:  # (a tile that does not fit)
            res[f"chunk_{conf}"] = repr(exc)[:60]
            continue
        res[f"chunk_{conf}"] = round(t * 1e6, 1)
    if res.get("split", {}).get("us"):
        res["all_extend_over_split"] = round(res["all_extend"]["us"] / res["split"]["us"], 2)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--decodes", default="64,256")
    ap.add_argument("--context", type=int, default=576)
    ap.add_argument("--chunks", default="512,2048")
    ap.add_argument("--prefix", type=int, default=0, help="cached tokens before the chunk")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, checks only (the CPU's Triton interpreter)")
    a = ap.parse_args()
    if a.smoke:
        a.decodes, a.context, a.chunks = "3", 80, "70"
    rows = []
    for d in map(int, a.decodes.split(",")):
        for ch in map(int, a.chunks.split(",")):
            r = measure(case(d, a.context, ch, a.prefix))
            print(r, flush=True)
            rows.append(r)
    write_json(a.out, {"what": "one layer's attention in a mixed step, 8B shape (benchmarks/mixed_step.py)",
                       "rows": rows, "environment": environment()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
