"""transformers' names, resolved one thread at a time.

transformers imports its submodules lazily, on the first attribute access. Two threads making
that first access at once (engines built side by side, replicas converting one GGUF) can each
meet the other's half-imported module, and ``from transformers import AutoModelForCausalLM``
then fails with "cannot import name". The engine's lookups of transformers names (the
tokenizer, the GGUF conversion) go through ``hf_names``, which serialises them in a process.
"""

from __future__ import annotations

import importlib
import threading

_RESOLVING = threading.Lock()  # (a lock, not state: a process imports through one importer)


def hf_names(*names: str, module: str = "transformers") -> tuple:
    """``getattr(import module, name)`` for each name, under the process's import lock."""
    with _RESOLVING:
        mod = importlib.import_module(module)
        return tuple(getattr(mod, name) for name in names)
