"""CPU compute defaults: the dtype ``dtype = "auto"`` picks on a CPU, and torch's threads.

``auto_dtype``: bfloat16 where the CPU multiplies it natively (AVX512-BF16 or AMX tiles: a
decode step's matmuls read half the bytes of float32 and run faster), float32 elsewhere.
The environment variable ``RADIXD_CPU_AUTO_DTYPE`` (``float32`` or ``bfloat16``) replaces the
probe: a test run comparing with float32 references sets it, so ``auto`` means the same on
every machine it runs on.

``set_threads``: torch's intra-op threads to the cores the process may run on (its affinity
mask, which ``taskset``, cgroups' cpusets and container limits narrow) less one, once when an
engine on the CPU starts; left alone where the user chose (``OMP_NUM_THREADS``). The core left
over is for what else must run: the event loop, HTTP, tokenizers, a client on the same
machine, other processes. An OpenMP parallel region waits at its barrier for its slowest
thread, so with a thread on every core one preempted thread stalls them all: on 2 cores a busy
loop beside the daemon halved its throughput with 2 threads and cost nothing with 1, and one
thread's runs spread less and served more on that shared machine
(``docs/benchmarks/cpu_spread.md``). vLLM's CPU backend reserves a core the same way.

``step_threads``: a step of ``PREFILL_TOKENS`` tokens or more (a prefill) runs on every
allowed core: its GEMMs are compute-bound and long, so a thread preempted now and then
delays a region by its own share only (``docs/benchmarks/cpu_kernels.md``); decode steps,
short regions bound by memory, stay on the cores less one. Not where the user chose (``OMP_NUM_THREADS``).

``kernel_threads``: radixd's own C kernels (the int matmuls, the fused decode step's
attention: ``cpu_kernels``) take a second core where two are allowed, through a helper thread
whose units the calling thread takes back when the helper is preempted, so that a busy core
costs a unit's wait at most, not a barrier's. Over HTTP with the client on the same 2-core
machine it served 1.3x the requests of one thread at concurrency 8 and cut single-stream TPOT
from 12.4 to 8.4 ms; with a busy loop on one core it was still 8% ahead
(``docs/benchmarks/cpu_kernels.md``). ``RADIXD_CPU_KERNEL_THREADS=1`` keeps them on one
thread (with other processes keeping both cores busy, two threads got one core's time between
them and decode steps took 10-20% longer).
"""

from __future__ import annotations

import os

import torch

AUTO_DTYPE_ENV = "RADIXD_CPU_AUTO_DTYPE"
KERNEL_THREADS_ENV = "RADIXD_CPU_KERNEL_THREADS"
PREFILL_TOKENS = 64  # a step of this many tokens or more runs on every allowed core
_AUTO_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def native_bf16() -> bool:
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def auto_dtype() -> torch.dtype:
    name = os.environ.get(AUTO_DTYPE_ENV)
    if name is None:
        return torch.bfloat16 if native_bf16() else torch.float32
    if name not in _AUTO_DTYPES:
        raise ValueError(f"{AUTO_DTYPE_ENV}={name!r}: expected one of {sorted(_AUTO_DTYPES)}")
    return _AUTO_DTYPES[name]


def allowed_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def set_threads() -> int:
    """Set torch's thread count to the allowed cores less one (at least one) unless
    ``OMP_NUM_THREADS`` is set, and radixd's kernels' to ``kernel_threads()``; returns
    torch's count in use."""
    from radixd.core import cpu_kernels

    if "OMP_NUM_THREADS" not in os.environ:
        n = max(1, allowed_cores() - 1)
        if torch.get_num_threads() != n:
            torch.set_num_threads(n)
    cpu_kernels.set_threads(kernel_threads())
    return torch.get_num_threads()


def kernel_threads() -> int:
    """Threads for radixd's C kernels (module docstring): 2 where two cores are allowed, unless
    ``RADIXD_CPU_KERNEL_THREADS`` is 1."""
    value = os.environ.get(KERNEL_THREADS_ENV)
    wanted = 2
    if value:
        try:
            wanted = int(value)
        except ValueError:
            raise ValueError(f"{KERNEL_THREADS_ENV}={value!r}: expected 1 or 2") from None
    return 2 if wanted > 1 and allowed_cores() > 1 else 1


def step_threads(num_tokens: int) -> None:
    """torch's threads for the next forward step of ``num_tokens`` tokens on the CPU (module
    docstring); unchanged where ``OMP_NUM_THREADS`` is set."""
    if "OMP_NUM_THREADS" in os.environ:
        return
    cores = allowed_cores()
    n = cores if num_tokens >= PREFILL_TOKENS else max(1, cores - 1)
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
