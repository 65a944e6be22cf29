"""The default model's GGUF served as shipped (``gguf_weights = "native"``) against its fp32
conversion, on the CPU: the bytes of weights each holds, and decode tokens/s at batch 1 and
8 (greedy, EOS ignored; the median of the rounds), A and B alternated in one process.

    python benchmarks/gguf_native.py [--rounds 3] [--new 32] [--out benchmarks/results/gguf_native.json]
    python benchmarks/gguf_native.py --quick     (a smoke run: one round, a few tokens)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import torch

from benchmarks.common import generate_all

MODES = ("native", "fp32")


def weight_bytes(model: torch.nn.Module) -> int:
    """Parameters and buffers, each storage once, and the CPU kernels' packed weights."""
    from radixd.core.quant.cpu_int import CpuIntWeight

    seen: dict[int, int] = {}
    for t in [*model.parameters(), *model.buffers()]:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    for m in model.modules():
        for v in vars(m).values():
            if isinstance(v, CpuIntWeight):
                seen[v.q.data_ptr()] = v.q.nbytes
                seen[v.scales.data_ptr()] = v.scales.nbytes
    rotary = sum(b.untyped_storage().nbytes() for b in model.rotary.buffers())
    return sum(seen.values()) - rotary  # (the rotary tables are not weights)


async def bench(rounds: int, new: int, batches: tuple[int, ...]) -> dict:
    from radixd import Engine

    engines = {m: Engine(model="default", gguf_weights=m, kv_cache_tokens=4096) for m in MODES}
    runs: dict[str, dict[str, list[float]]] = {m: {str(b): [] for b in batches} for m in MODES}
    cpu: dict[str, dict[str, list[float]]] = {m: {str(b): [] for b in batches} for m in MODES}
    held = {m: weight_bytes(e.worker.model) for m, e in engines.items()}
    try:
        prompt = engines["fp32"].apply_chat_template([{"role": "user", "content": "Tell me about the sea."}])
        for m in MODES:  # warm-up
            await generate_all(engines[m], [prompt], 2)
        for _ in range(rounds):
            for b in batches:
                for m in MODES:
                    c0 = time.process_time()
                    t = await generate_all(engines[m], [prompt] * b, new)
                    runs[m][str(b)].append(b * (new - 1) / (t["end"] - t["all_first"]))
                    cpu[m][str(b)].append(1e3 * (time.process_time() - c0) / (b * new))
    finally:
        for e in engines.values():
            await e.stop()
    def median(d: dict) -> dict:
        return {m: {b: sorted(v)[len(v) // 2] for b, v in r.items()} for m, r in d.items()}

    # (CPU time, prefill included, is what the other processes on a shared machine do not distort)
    return {"weight_bytes": held, "decode_tok_s": median(runs), "cpu_ms_per_token": median(cpu), "runs": runs,
            "cpu_runs": cpu}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    rounds, new, batches = (1, 4, (1,)) if a.quick else (a.rounds, a.new, (1, 8))
    t0 = time.time()
    result = asyncio.run(bench(rounds, new, batches)) | {"rounds": rounds, "new_tokens": new, "torch_threads": torch.get_num_threads(),
              "wall_s": round(time.time() - t0, 1)}
    print(json.dumps(result, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
