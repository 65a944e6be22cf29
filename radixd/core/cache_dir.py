"""Where radixd keeps what it fetches and builds: converted models, downloads, compiled CPU
kernels. ``[model] cache_dir`` (or ``--cache-dir``), else ``$RADIXD_CACHE``, else
``$XDG_CACHE_HOME/radixd`` (``~/.cache/radixd``)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root(cache_dir: str | None = None) -> Path:
    if cache_dir:
        return Path(cache_dir).expanduser()
    env = os.environ.get("RADIXD_CACHE")
    if env:
        return Path(env).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser() / "radixd"
