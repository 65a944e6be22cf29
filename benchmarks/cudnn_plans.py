"""What a new shape costs cuDNN's attention on a CUDA GPU: the first call of each (batch,
length) against the warm one, 8B heads (32 query, 8 KV, head dim 128, bf16), for torch's SDPA
(causal; cuDNN's kernel on Hopper), the private cuDNN op over a 4096-token prefix (what
``dense_prefill``'s chunks after a cached prefix call) and the flash kernel's varlen entry,
which plans nothing: why ``dense_prefill`` builds its plans at start, bucketed
(``benchmarks.cudnn_buckets``).

    python3 -m benchmarks.cudnn_plans
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

H, HKV, D = 32, 8, 128
LENGTHS = (512, 513, 777, 1024, 2048, 2049, 4000)


def ms(fn: Callable[[], object]) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def rand(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, device="cuda", dtype=torch.bfloat16)


def sdpa(b: int, n: int) -> Callable[[], object]:
    q, k, v = rand(b, H, n, D), rand(b, HKV, n, D), rand(b, HKV, n, D)
    return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def over_prefix(n: int, prefix: int = 4096) -> Callable[[], object]:
    q, k, v = rand(1, H, n, D), rand(1, HKV, n + prefix, D), rand(1, HKV, n + prefix, D)
    return lambda: torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, False, False,
                                                                       scale=D**-0.5)


def flash_varlen(n: int) -> Callable[[], object]:
    q, k, v = rand(n, H, D), rand(n, H, D), rand(n, H, D)
    cu = torch.tensor([0, n], device="cuda", dtype=torch.int32)
    return lambda: torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, n, n, 0.0, True, False, scale=D**-0.5)


def main() -> None:
    print("torch", torch.__version__, "cudnn", torch.backends.cudnn.version())
    sdpa(1, 256)()  # (the first call of all: libraries load)
    cases = [("sdpa B1", lambda n: sdpa(1, n)), ("sdpa B2", lambda n: sdpa(2, n)),
             ("priv prefix4096 noncausal", over_prefix), ("flash_varlen", flash_varlen)]
    for name, make in cases:
        for n in LENGTHS:
            fn = make(n)
            first = ms(fn)
            warm = min(ms(fn) for _ in range(3))
            print(f"{name:28s} L={n:5d} first {first:8.2f} ms  warm {warm:7.3f} ms", flush=True)


if __name__ == "__main__":
    main()
