"""Where radixd keeps what it fetches and builds: converted models, downloads, compiled CPU
kernels. ``[model] cache_dir`` (or ``--cache-dir``), else ``$RADIXD_CACHE``, else
``$XDG_CACHE_HOME/radixd`` (``~/.cache/radixd``).

Entries are built by ``build_once``: one builder at a time per entry (threads of one process
and processes sharing the cache alike), written under a name of its own and renamed into place,
so a reader sees a whole entry or none."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock


def cache_root(cache_dir: str | None = None) -> Path:
    if cache_dir:
        return Path(cache_dir).expanduser()
    env = os.environ.get("RADIXD_CACHE")
    if env:
        return Path(env).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser() / "radixd"


def build_once(target: Path, build: Callable[[Path], None], done: Callable[[Path], bool]) -> Path:
    """``target``, made by ``build(staging)`` unless ``done(target)`` already holds.

    Concurrent callers for one ``target`` queue on ``<target>.lock``; the first builds, the
    others find the entry done and return it. ``build`` writes ``staging`` (a file or directory
    path of its own next to ``target``, not yet existing); it is renamed onto ``target`` only
    when ``build`` returns, and removed if it raises. An entry left incomplete by a killed
    builder (``done`` false) is replaced."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if done(target):
            return target
        scratch = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp"))
        staging = scratch / target.name
        try:
            build(staging)
            _remove(target)
            staging.rename(target)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    return target


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def is_checkpoint(path: Path) -> bool:
    """Whether ``path`` holds a built checkpoint directory (``build_once``'s ``done`` for one:
    the directory is renamed into place whole, so its config.json marks it complete)."""
    return (path / "config.json").exists()
