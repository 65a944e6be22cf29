"""Python's cyclic garbage collector while engines run.

A full (oldest-generation) collection walks every container object the process holds. After
torch, transformers and a model are loaded that is several hundred thousand objects: 100-200
ms with the event loop stopped, every few hundred milliseconds under a busy decode loop, and
a device whose next step was not launched in time sits idle for all of it (every replica's
device, with ``dp_size`` > 1: one loop drives them all). So while an engine runs:

- ``freeze``: what exists when it starts (libraries, model, captured graphs) goes to the
  collector's permanent generation, never walked again (``gc.freeze``); put back when an
  engine stops (``gc.unfreeze``), so that its cycles (a model's weights on a device among
  them) can be freed. Where other engines still run, what survives the next full
  collection is frozen again.
- ``threshold``: the youngest generation's threshold is raised (Python's default is 700
  allocations); a step allocates thousands of short-lived objects, and each young
  collection moves survivors on, toward the next full one.

The collector is one per process, so this state is too: the first engine to start saves
the settings, the last to stop restores them. Pauses are timed through ``gc.callbacks``.
"""

from __future__ import annotations

import gc
import logging
import threading
import time

log = logging.getLogger(__name__)

SLOW_PAUSE_S = 0.05  # a collection longer than this is logged


class GcPauses:
    """Collections seen while any engine runs: how many, how long in all, the longest."""

    def __init__(self) -> None:
        self.count = 0
        self.full = 0
        self.seconds = 0.0
        self.max_seconds = 0.0
        self._t0 = 0.0
        self.refreeze = False  # freeze what the next full collection leaves

    def callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
            return
        if self.refreeze and info["generation"] == 2:
            self.refreeze = False
            gc.freeze()
        dt = time.perf_counter() - self._t0
        self.count += 1
        self.seconds += dt
        if dt > self.max_seconds:
            self.max_seconds = dt
        if info["generation"] == 2:
            self.full += 1
        if dt > SLOW_PAUSE_S:
            log.warning("garbage collection of generation %d took %.0f ms", info["generation"], dt * 1e3)

    def as_dict(self) -> dict:
        return {"collections": self.count, "full_collections": self.full,
                "pause_seconds": round(self.seconds, 4), "max_pause_seconds": round(self.max_seconds, 4)}


class _Holders:
    """The engines holding the collector's run-time settings (one per process, like gc)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count = 0
        self._saved: tuple[int, ...] | None = None
        self._froze = False
        self.pauses = GcPauses()

    def acquire(self, *, freeze: bool, threshold: int) -> None:
        with self._lock:
            if self._count == 0:
                self._saved = gc.get_threshold()
                self.pauses = GcPauses()
                gc.callbacks.append(self.pauses.callback)
            self._count += 1
            if threshold:
                t = gc.get_threshold()
                if t[0] < threshold:
                    gc.set_threshold(threshold, *t[1:])
            if freeze:  # (each engine's start-up state too, when several start in turn)
                gc.freeze()
                self._froze = True

    def release(self) -> None:
        with self._lock:
            if self._count == 0:
                return
            self._count -= 1
            if self._count:
                if self._froze:  # the stopped engine's objects walked again, and freed with the next full collection
                    gc.unfreeze()
                    self.pauses.refreeze = True
                return
            if self._froze:
                gc.unfreeze()
                self._froze = False
            if self._saved is not None:
                gc.set_threshold(*self._saved)
                self._saved = None
            if self.pauses.callback in gc.callbacks:
                gc.callbacks.remove(self.pauses.callback)


_holders = _Holders()


def acquire(*, freeze: bool, threshold: int) -> None:
    """An engine starts: apply its settings (``threshold`` 0: leave the collector's)."""
    _holders.acquire(freeze=freeze, threshold=threshold)


def release() -> None:
    """An engine stopped: the last one out restores the collector."""
    _holders.release()


def pauses() -> dict:
    """The collections timed since the first running engine started."""
    return _holders.pauses.as_dict()
