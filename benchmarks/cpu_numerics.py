"""How far the default model's native-GGUF kernels are from its fp32 conversion on the CPU.

The prompt log-probabilities of a fixed English text (its first ``--chars`` characters: under
64 tokens every projection of the prefill goes through the int kernels, beyond it the int4
ones dequantize for a bf16 GEMM) under ``gguf_weights = "fp32"`` (the reference) and
``"native"`` with each activation mode, float32 activations elsewhere, one engine each:

- ``bf16``: torch's int kernels (``RADIXD_CPU_ISA=baseline``, as on a CPU without VNNI);
- ``int8``: one int8 plane per block of 32 (``RADIXD_CPU_ACT_BITS=8``, llama.cpp's);
- ``int16``: two planes (as shipped on a CPU with AVX512-VNNI).

    python -m benchmarks.cpu_numerics --chars 250
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from pathlib import Path

import numpy as np

TEXT = ("The history of the city begins in the third century BC, when a Celtic people settled on an island in the "
        "river. The Romans conquered the area in 52 BC and founded a town on the left bank. In the following centuries "
        "the town grew into a centre of trade and learning; its university, founded in the twelfth century, drew "
        "students from all over Europe. During the Middle Ages the city became the capital of the kingdom and the seat "
        "of its kings, who built palaces, churches and walls around it. Today it is one of the largest cities in Europe "
        "and a world centre of art, fashion, gastronomy and culture.")
MODES = {"bf16": {"RADIXD_CPU_ISA": "baseline"}, "int8": {"RADIXD_CPU_ACT_BITS": "8"}, "int16": {"RADIXD_CPU_ACT_BITS": "16"}}


async def prompt_logprobs(weights: str, text: str) -> np.ndarray:
    from radixd import Engine, SamplingParams

    eng = Engine(model="default", gguf_weights=weights, dtype="float32", kv_cache_tokens=4096)
    try:
        lp = None
        async for out in eng.generate(prompt=text, params=SamplingParams(max_new_tokens=1, prompt_logprobs_from=1)):
            lp = out.prompt_logprobs or lp
        return np.array(lp)
    finally:
        await eng.stop()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chars", type=int, default=250, help="the text's first N characters")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    from radixd.core import cpu_kernels

    text = TEXT[: args.chars]
    ref = asyncio.run(prompt_logprobs("fp32", text))
    doc = {"chars": args.chars, "tokens": len(ref), "fp32_mean_logprob": float(ref.mean()), "native": {}}
    for mode, env in MODES.items():
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        cpu_kernels.reset()
        try:
            lp = asyncio.run(prompt_logprobs("native", text))
        finally:
            for k, v in saved.items():
                os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
            cpu_kernels.reset()
        diff = np.abs(lp - ref)
        doc["native"][mode] = {"mean_abs_diff": float(diff.mean()), "max_abs_diff": float(diff.max()),
                               "mean_logprob": float(lp.mean())}
        print(f"{mode:>6}: mean |diff| {diff.mean():.4f}, max {diff.max():.3f} (mean logprob {lp.mean():.4f}, "
              f"fp32 {ref.mean():.4f}, {len(ref)} tokens)")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=2) + "\n")
    return doc


if __name__ == "__main__":
    main()
