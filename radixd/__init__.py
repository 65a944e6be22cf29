"""radixd: an LLM serving daemon with radix attention and continuous batching.

The public Python API is ``radixd.Engine``: the core engine with its plugins wired in
(``radixd.plugins.wiring``; lazy import keeps ``import radixd`` cheap).

Importing radixd before torch makes torch's OpenMP threads sleep, not spin, while they wait
(``OMP_WAIT_POLICY=PASSIVE`` unless set): on a CPU shared with other processes a spinning
thread burns the time slice its peer needs, and a decode step then takes several times as
long (OpenMP reads the variable once, when torch loads it).
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"

__all__ = ["Engine", "EngineConfig", "SamplingParams", "__version__"]


def __getattr__(name: str):
    if name == "Engine":
        from radixd.plugins.wiring import Engine

        return Engine
    if name == "EngineConfig":
        from radixd.core.config import EngineConfig

        return EngineConfig
    if name == "SamplingParams":
        from radixd.core.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'radixd' has no attribute {name!r}")
