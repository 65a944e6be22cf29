"""radixd: an LLM serving daemon with radix attention and continuous batching.

The public Python API is ``radixd.Engine``: the core engine with its plugins wired in
(``radixd.plugins.wiring``; lazy import keeps ``import radixd`` cheap).

Importing radixd before torch bounds how long torch's OpenMP threads spin before they sleep
while waiting for each other (``GOMP_SPINCOUNT=1000``, unless ``GOMP_SPINCOUNT`` or
``OMP_WAIT_POLICY`` is set): on a CPU shared with other processes a spinning thread burns
the time slice its peer needs, and a decode step took 3-4x as long with the default spin
(OpenMP reads the variables once, when torch loads it). A short spin keeps most of the
default's speed on an idle machine, where sleeping at once (``OMP_WAIT_POLICY=PASSIVE``)
costs a wake-up per parallel op.
"""

import os

if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "1000")

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
